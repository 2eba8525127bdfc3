"""Chat-formatted sources (Levanter's ``format: {type: chat}``), against independent references:

* the token cache's ids and loss mask of a few conversations equal what ``transformers``'
  ``apply_chat_template(..., return_assistant_tokens_mask=True)`` gives with the same tokenizer and
  template, and the loader's packed rows carry them aligned;
* the masked training loss of a batch (``model_loss_sums``, the eval step, the train step's
  reported loss) equals a NumPy cross-entropy averaged over the positions that predict an assistant
  token, found from the ``transformers`` mask (never from the batch's own mask);
* a mixture of a text component and a chat component trains end to end from the command line,
  its training loss going down and its chat validation set reported;
* config problems are refused in one line naming the field.

Everything is local: the tokenizer is trained here, the data written here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from helpers import pipeline as pt
from helpers.data import EOS, sample_texts

from lm_pipeline.config import load_config
from lm_pipeline.data.cache import build_cache, open_cache
from lm_pipeline.data.chat import source_chat
from lm_pipeline.data.config import DataConfig
from lm_pipeline.data.loader import CacheDataset
from lm_pipeline.data.sources.resolve import resolve_shards
from lm_pipeline.schema import ConfigError, from_dict
from lm_pipeline.train.loss import model_loss_sums
from lm_pipeline.train.sharding import make_mesh
from lm_pipeline.train.trainer import TrainState, build_step_functions, put_batch, step_args

SPECIALS = [EOS, "<|user|>", "<|assistant|>", "<|system|>"]
# transformers' chat-template dialect: the assistant's text (and its EOS) marked as generation
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
            "{{ m['content'] }}{{ eos_token }}{% endgeneration %}\n{% else %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
            "{% endif %}{% endfor %}")
CONVERSATIONS = [
    [{"role": "user", "content": "alpha beta café"}, {"role": "assistant", "content": "gamma 日本語 delta"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x 42"},
     {"role": "assistant", "content": "42 🙂 foo_bar"}, {"role": "user", "content": "foo_bar naïve"},
     {"role": "assistant", "content": "naïve данные alpha alpha"}],
    [{"role": "user", "content": "delta delta gamma beta alpha x"}, {"role": "assistant", "content": "x"}],
    [{"role": "user", "content": "🙂"}, {"role": "assistant", "content": "beta gamma"},
     {"role": "user", "content": "again"}, {"role": "assistant", "content": "café café 42"}],
]
T = 24
BATCH = 4


def chat_tokenizer(out: Path, template: str | None = TEMPLATE) -> Path:
    """A byte-level BPE with the chat's special tokens; its tokenizer_config.json has ``template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(sample_texts(200), trainer=trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {"eos_token": EOS, "bos_token": EOS, "pad_token": EOS, **({"chat_template": template} if template else {})}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return out


def write_chats(path: Path, conversations=CONVERSATIONS, key: str = "messages") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({key: c, "id": i}) + "\n" for i, c in enumerate(conversations)), encoding="utf-8")
    return path


def hf_reference(tokdir: Path, conversation, template: str = TEMPLATE) -> tuple[list[int], list[int]]:
    """transformers' rendering of one conversation: (input_ids, assistant_masks)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tokdir / "tokenizer.json")),
                                 eos_token=EOS, bos_token=EOS, pad_token=EOS)
    out = hf.apply_chat_template(conversation, chat_template=template, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def chat_cache(tmp: Path, **fmt) -> tuple[Path, object]:
    """The token cache of CONVERSATIONS (format: {type: chat, **fmt}) with the chat tokenizer."""
    tokdir = chat_tokenizer(tmp / "tok")
    data = write_chats(tmp / "chat.jsonl")
    cfg = from_dict(DataConfig, {"train_urls": [str(data)], "format": {"type": "chat", **fmt},
                                 "tokenizer": {"kind": "hf", "name_or_path": str(tokdir)}})
    build_cache(str(tmp / "cache"), resolve_shards(cfg, "train"), str(tokdir), num_workers=1, progress=False,
                chat=source_chat(cfg, str(tokdir)))
    return tokdir, open_cache(str(tmp / "cache"))


# --- (a) the cache's ids and mask: transformers' apply_chat_template -----------------------------


@pytest.mark.parametrize("template_in", ["tokenizer", "config"])
def test_cached_ids_and_mask_equal_transformers(tmp_path, template_in):
    fmt = {"chat_template": TEMPLATE} if template_in == "config" else {}
    tokdir, cache = chat_cache(tmp_path, **fmt)
    assert cache.num_docs == len(CONVERSATIONS) and cache.has_loss_mask
    off = cache.doc_offsets
    for i, conv in enumerate(CONVERSATIONS):
        ids, mask = hf_reference(tokdir, conv)
        assert 0 < sum(mask) < len(mask)  # user turns masked out, assistant turns in
        assert cache.doc(i).tolist() == ids, f"conversation {i}: ids"
        assert cache.read_loss_mask(int(off[i]), int(off[i + 1])).tolist() == mask, f"conversation {i}: mask"


def test_mask_user_turns_false_trains_on_every_token(tmp_path):
    tokdir, cache = chat_cache(tmp_path, mask_user_turns=False)
    for i, conv in enumerate(CONVERSATIONS):
        ids, _ = hf_reference(tokdir, conv)
        assert cache.doc(i).tolist() == ids
    assert cache.read_loss_mask(0, cache.num_tokens).tolist() == [1] * cache.num_tokens


@pytest.mark.parametrize("pack", [True, False])
def test_loader_rows_carry_each_conversations_ids_and_mask(tmp_path, pack):
    """Every row's segments are whole conversations (or seq_len pieces of one), with the mask of
    the same tokens; padding is masked out; pack: false puts one piece per row."""
    tokdir, cache = chat_cache(tmp_path, pack=pack)
    refs = [hf_reference(tokdir, c) for c in CONVERSATIONS]
    stream_ids = [t for ids, _ in refs for t in ids]
    stream_mask = [m for _, mask in refs for m in mask]
    ds = CacheDataset(cache, T, "concat", chat_pack=pack)  # a chat cache packs its own way whatever is asked
    assert ds.packing == ("greedy" if pack else "single") and ds.has_loss_mask
    batch = ds.get_many(np.arange(len(ds)))
    seen_ids, seen_mask = [], []
    for r in range(len(ds)):
        seg = batch.segment_ids[r]
        assert (batch.loss_mask[r][seg == 0] == 0).all()
        if not pack:
            assert set(seg.tolist()) <= {0, 1}
        for s in sorted(set(seg.tolist()) - {0}):
            seen_ids += batch.tokens[r][seg == s].tolist()
            seen_mask += batch.loss_mask[r][seg == s].tolist()
    assert seen_ids == stream_ids and seen_mask == stream_mask  # greedy keeps the cache's order


# --- (b) the masked loss: NumPy cross-entropy over the assistant's targets ----------------------


def _numpy_model(cfg, vocab: int):
    rng = np.random.default_rng(0)
    abstract = eqx.filter_eval_shape(cfg.model.build, vocab, key=jax.random.key(0))
    return jax.tree.map(lambda a: jnp.asarray(rng.normal(0.0, 0.3, a.shape), a.dtype)
                        if isinstance(a, jax.ShapeDtypeStruct) else a, abstract)


def test_masked_training_loss_equals_numpy_over_assistant_targets(tmp_path):
    tokdir, cache = chat_cache(tmp_path)
    refs = [hf_reference(tokdir, c) for c in CONVERSATIONS]
    ref_mask = np.array([m for _, mask in refs for m in mask])  # the assistant's tokens, in stream order
    ds = CacheDataset(cache, T, "greedy")
    assert len(ds) >= BATCH
    batch = ds.get_many(np.arange(BATCH))
    # where each slot's token lies in the stream, from the layout (independently of the batch's mask)
    plan = ds.layout.plan(np.arange(BATCH))
    pos = np.full((BATCH, T), -1)
    stream = np.concatenate([np.arange(s, s + n) for s, n in zip(plan.run_start, plan.run_len, strict=True)])
    pos[np.arange(T)[None] < plan.row_len[:, None]] = stream
    seg = batch.segment_ids
    # position t predicts token t+1: counted where t+1 is in t's conversation and an assistant token
    predicts = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
    assistant_target = np.where(pos[:, 1:] >= 0, ref_mask[np.maximum(pos[:, 1:], 0)], 0) == 1
    keep = predicts & assistant_target
    assert 0 < keep.sum() < predicts.sum()

    cfg = load_config(None, {"model.type": "gpt2", "model.num_heads": 4, "model.seq_len": T, "model.hidden_dim": 32,
                             "model.num_layers": 2, "model.gradient_checkpointing": False,
                             "trainer.train_batch_size": BATCH, "trainer.mp": "f32", "trainer.progress": False})
    vocab = 320
    model = _numpy_model(cfg, vocab)
    tokens, segs, mask = (jnp.asarray(batch.tokens), jnp.asarray(seg), jnp.asarray(batch.loss_mask))
    logits = np.asarray(model(tokens, segs, key=None, inference=True), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp[:, :-1], batch.tokens[:, 1:, None].astype(np.int64), -1)[..., 0]
    ref = nll[keep].mean()

    s, n = model_loss_sums(model, tokens, segs, key=None, inference=True, loss_mask=mask)
    assert float(n) == keep.sum() and float(s) / float(n) == pytest.approx(ref, rel=1e-5)
    # the compiled steps: eval and train take the mask as their 4th argument
    plan_ = make_mesh(cfg.trainer, jax.devices()[:1])
    fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=vocab, num_train_steps=4,
                               plan=plan_, has_segments=True, has_loss_mask=True)
    a = fns.abstract_state
    state = TrainState(jnp.zeros((), jnp.int32), eqx.filter(model, eqx.is_array),
                       jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), a.opt_state), jax.random.key_data(jax.random.key(0)))
    args = step_args(fns, put_batch(batch, plan_))
    assert len(args) == 3
    s, n = fns.eval_step(state, *args)
    assert float(n) == keep.sum() and float(s) / float(n) == pytest.approx(ref, rel=1e-5), "eval_step"
    _, metrics = fns.train_step(jax.tree.map(jnp.copy, state), *args)
    assert float(metrics["train/loss"]) == pytest.approx(ref, rel=1e-5), "train_step"
    # the evaluation report's loss: rows 0..BATCH-1 in order, the same targets
    from lm_pipeline.eval import evaluate_model

    got = evaluate_model(model, {"chat": ds}, batch_size=BATCH, max_eval_batches=1, progress=False)["chat"]
    assert got.tokens == keep.sum() and got.nats / got.tokens == pytest.approx(ref, rel=1e-5), "evaluate_model"


def _masked_reference(model, ds, ref_mask: np.ndarray) -> tuple[float, int]:
    """NumPy cross-entropy summed over every row of ``ds`` at the positions that predict an
    assistant token of the stream (``ref_mask``: transformers' mask, never the batch's own)."""
    rows = np.arange(len(ds))
    batch = ds.get_many(rows)
    n, t = batch.tokens.shape
    plan = ds.layout.plan(rows)
    pos = np.full((n, t), -1)
    stream = np.concatenate([np.arange(s, s + k) for s, k in zip(plan.run_start, plan.run_len, strict=True)])
    pos[np.arange(t)[None] < plan.row_len[:, None]] = stream
    seg = batch.segment_ids
    predicts = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
    keep = predicts & (np.where(pos[:, 1:] >= 0, ref_mask[np.maximum(pos[:, 1:], 0)], 0) == 1)
    logits = np.asarray(model(jnp.asarray(batch.tokens), jnp.asarray(seg), key=None, inference=True), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp[:, :-1], batch.tokens[:, 1:, None].astype(np.int64), -1)[..., 0]
    return float(nll[keep].sum()), int(keep.sum())


@pytest.mark.parametrize("own_cache", [True, False])
def test_eval_scores_a_chat_validation_set_on_the_assistant_tokens(tmp_path, own_cache):
    """``lm-pipeline eval``'s data (:func:`lm_pipeline.eval.data.eval_datasets`) reads a chat
    validation set rendered and masked as the training cache is: from the config's own token
    cache when built (and the unigram baseline from its training split), else from an evaluation
    cache it builds with the mask; the loss and bits per byte equal a NumPy cross-entropy over the
    assistant's targets (transformers' mask) and the assistant's UTF-8 bytes."""
    import math

    from lm_pipeline.eval import evaluate_model
    from lm_pipeline.eval.data import eval_datasets
    from lm_pipeline.steps import Pipeline

    seq = 64
    tokdir = chat_tokenizer(tmp_path / "tok")
    train = write_chats(tmp_path / "chat" / "train.jsonl", CONVERSATIONS[::-1])
    val = write_chats(tmp_path / "chat" / "val.jsonl")
    raw = pt.tiny_config(tmp_path)
    raw["data"].update({"train_urls": [str(train)], "validation_urls": [str(val)], "format": {"type": "chat"},
                        "tokenizer": {"kind": "hf", "name_or_path": str(tokdir)}})
    raw["model"]["seq_len"] = seq
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    cfg = load_config(exp)
    if own_cache:
        Pipeline(cfg, progress=False).token_cache()
    got = eval_datasets(cfg, str(tokdir), seq_len=seq, train=own_cache, progress=False)
    assert got.reused.get("validation", "").startswith("token_cache") == own_cache, got.reused
    assert got.built == (() if own_cache else ("validation",))
    assert (got.train_cache is not None) == own_cache
    assert open_cache(got.locations["validation"]).has_loss_mask
    ds = got.datasets["validation"]
    assert ds.has_loss_mask

    refs = [hf_reference(tokdir, c) for c in CONVERSATIONS]
    assert max(len(ids) for ids, _ in refs) <= seq  # every conversation whole in a row
    ref_mask = np.array([m for _, mask in refs for m in mask])
    model = _numpy_model(cfg, 320)
    nats, count = _masked_reference(model, ds, ref_mask)
    assert count == int(ref_mask.sum())  # every assistant token is a target once
    ref_bytes = sum(len((m["content"] + EOS).encode("utf-8")) for c in CONVERSATIONS for m in c
                    if m["role"] == "assistant")
    m = evaluate_model(model, {"validation": ds}, batch_size=len(ds), progress=False)["validation"]
    assert m.tokens == count
    assert m.loss == pytest.approx(nats / count, rel=1e-5)
    assert m.bpb == pytest.approx(nats / math.log(2) / ref_bytes, rel=1e-5)


# --- (c) a text + chat mixture trains from the command line ---------------------------------------


def test_text_and_chat_mixture_trains_from_the_command_line(tmp_path):
    tokdir = chat_tokenizer(tmp_path / "tok")
    raw = pt.tiny_config(tmp_path)
    d = raw["data"]
    train_urls, val = d.pop("train_urls"), d.pop("validation_urls")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "café", "x", "42"]
    convs = [[{"role": "user", "content": " ".join(rng.choice(words, 4))},
              {"role": "assistant", "content": " ".join(rng.choice(words[:3], 6))}] for _ in range(120)]
    write_chats(tmp_path / "chat" / "train.jsonl", convs[:100])
    write_chats(tmp_path / "chat" / "val.jsonl", convs[100:])
    d.update({"configs": {"web": {"train_urls": train_urls, "validation_urls": val},
                          "sft": {"train_urls": [str(tmp_path / "chat" / "train.jsonl")],
                                  "validation_urls": [str(tmp_path / "chat" / "val.jsonl")],
                                  "format": {"type": "chat"}}},
              "train_weights": {"web": 0.5, "sft": 0.5}, "mixture_block_size": 8,
              "tokenizer": {"kind": "hf", "name_or_path": str(tokdir)}})
    raw["trainer"].update({"num_train_steps": 30, "steps_per_eval": 30, "log_every": 1})
    raw["optimizer"]["learning_rate"] = 3e-3
    experiment = tmp_path / "mix.yaml"
    experiment.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "lm_pipeline.cli", "train", "--config_path", str(experiment)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    from lm_pipeline.plots import read_metrics
    from lm_pipeline.steps import Pipeline

    pipe = Pipeline(load_config(experiment), progress=False)
    run = pipe.cached("train_ckpt")
    assert run is not None and run.manifest["summary"]["final_step"] == 30
    losses = [r["train/loss"] for r in read_metrics(run.manifest["run_dir"]) if "train/loss" in r]
    assert len(losses) >= 20
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses
    rows = {r["dataset"]: r for r in pipe.eval_report().manifest["rows"]}
    assert {"web/validation", "sft/validation"} <= set(rows)
    # every row evaluated: the targets are the assistant's tokens (transformers' mask), the bytes
    # the assistant's text's
    import math

    refs = [hf_reference(tokdir, c) for c in convs[100:]]
    assert max(len(ids) for ids, _ in refs) <= raw["model"]["seq_len"]  # whole conversations per row
    ref_bytes = sum(len((m["content"] + EOS).encode("utf-8")) for c in convs[100:] for m in c if m["role"] == "assistant")
    sft = rows["sft/validation"]
    assert sft["tokens"] == sum(sum(mask) for _, mask in refs)
    assert sft["loss"] > 0 and sft["bpb"] == pytest.approx(sft["loss"] * sft["tokens"] / math.log(2) / ref_bytes,
                                                           rel=1e-6)
    # lm-pipeline eval on the final checkpoint: the component's own chat cache, the same numbers
    from lm_pipeline.cli import main

    assert main(["eval", "--config_path", str(experiment), "--output_dir", str(tmp_path / "eval")]) == 0
    report = json.loads((tmp_path / "eval" / "eval_report.json").read_text())
    report = report if isinstance(report, list) else report.get("rows", report)
    got = {r["dataset"]: r for r in report}
    for name in ("web/validation", "sft/validation"):
        for metric in ("loss", "bpb", "tokens"):
            assert got[name][metric] == pytest.approx(rows[name][metric], rel=0, abs=1e-6), (name, metric)
    assert not (tmp_path / "store" / "eval_cache").exists()  # nothing tokenized for the evaluation


# --- (d) config problems, one line naming the field ---------------------------------------------


@pytest.mark.parametrize(("fmt", "field", "says"), [
    ({"type": "chat", "pack": "yes"}, "format.pack", "boolean"),
    ({"type": "chat", "messages": "m"}, "format.messages", "messages_field"),
    ({"type": "chat", "messages_field": ""}, "format.messages_field", "must not be empty"),
    ({"type": "chat", "chat_template": "{{ messages }}"}, "format.chat_template", "generation"),
    ({"type": "chat", "single_turn": True, "chat_template": TEMPLATE}, "format.chat_template", "single_turn"),
])
def test_bad_chat_format_is_refused_in_one_line(fmt, field, says):
    with pytest.raises(ConfigError) as e:
        from_dict(DataConfig, {"configs": {"sft": {"train_urls": ["x.jsonl"], "format": fmt}},
                               "train_weights": {"sft": 1.0}, "tokenizer": "some/tok"}, "data")
    msg = str(e.value)
    assert "\n" not in msg and f"data.configs.sft.{field}" in msg and says in msg, msg


def test_bpe_tokenizer_without_template_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        from_dict(DataConfig, {"train_urls": ["x.jsonl"], "format": {"type": "chat"}}, "data")
    msg = str(e.value)
    assert "\n" not in msg and "data.chat.chat_template" in msg and "format.chat_template" in msg, msg


def test_local_tokenizer_without_template_fails_before_anything_is_built(tmp_path):
    tokdir = chat_tokenizer(tmp_path / "tok", template=None)
    data = write_chats(tmp_path / "chat.jsonl")
    raw = pt.tiny_config(tmp_path)
    raw["data"].update({"train_urls": [str(data)], "validation_urls": [], "format": {"type": "chat"},
                        "tokenizer": {"kind": "hf", "name_or_path": str(tokdir)}})
    experiment = tmp_path / "chat.yaml"
    experiment.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "lm_pipeline.cli", "train", "--config_path", str(experiment)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode != 0
    last = [line for line in out.stderr.strip().splitlines() if line.strip()][-1]
    assert "data.chat.chat_template" in last and "format.chat_template" in last, out.stderr[-2000:]
    assert not (tmp_path / "store" / "token_cache").exists()


def _chat_experiment(tmp_path: Path, tokdir: Path, data: Path, **fmt) -> Path:
    raw = pt.tiny_config(tmp_path)
    raw["data"].update({"train_urls": [str(data)], "validation_urls": [], "format": {"type": "chat", **fmt},
                        "tokenizer": {"kind": "hf", "name_or_path": str(tokdir)}})
    experiment = tmp_path / "chat.yaml"
    experiment.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return experiment


def _cli(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "lm_pipeline.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("template_in", ["config", "tokenizer"])
def test_a_template_with_a_jinja_syntax_error_is_refused_before_anything_is_built(tmp_path, template_in):
    broken = TEMPLATE.replace("{% endfor %}", "")  # the for loop never closed
    tokdir = chat_tokenizer(tmp_path / "tok", template=broken if template_in == "tokenizer" else TEMPLATE)
    data = write_chats(tmp_path / "chat.jsonl")
    fmt = {"chat_template": broken} if template_in == "config" else {}
    out = _cli(tmp_path, "cache", "--config_path", str(_chat_experiment(tmp_path, tokdir, data, **fmt)))
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert "data.chat.chat_template" in errors[0] and "not a valid Jinja template" in errors[0], errors
    # jinja's own message, and the line where it found the problem (the end: TEMPLATE has 3 lines)
    assert "'endfor'" in errors[0] and "line 3" in errors[0], errors
    assert not (tmp_path / "store" / "token_cache").exists() and not (tmp_path / "store" / "raw_shards").exists()


STRICT = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('conversations start with a user turn') }}"
          "{% endif %}" + TEMPLATE)


@pytest.mark.parametrize(("kind", "bad", "fmt", "says"), [
    ("no_assistant", [{"role": "user", "content": "alpha"}, {"role": "user", "content": "beta"}], {},
     "no assistant text"),
    ("raise_exception", [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}],
     {"chat_template": STRICT}, "conversations start with a user turn"),
    ("single_turn", [{"role": "user", "content": 42}, {"role": "assistant", "content": "x"}],
     {"single_turn": True}, "string content"),
])
def test_a_conversation_that_cannot_be_trained_on_is_an_invalid_record(tmp_path, kind, bad, fmt, says):
    """Through the command line: under on_invalid: fail, exit 2 and one error: line naming the file
    and line (no traceback); under skip, the cache is built without exactly that record (the others
    as transformers renders them) and the skip is counted as the reader's invalid records are."""
    from lm_pipeline.steps import Pipeline

    tokdir = chat_tokenizer(tmp_path / "tok")
    good = [CONVERSATIONS[0], CONVERSATIONS[2], CONVERSATIONS[3]]  # each starting with a user turn
    data = write_chats(tmp_path / "chat.jsonl", [good[0], bad, *good[1:]])
    experiment = _chat_experiment(tmp_path, tokdir, data, **fmt)
    out = _cli(tmp_path, "cache", "--config_path", str(experiment))
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{data} line 2" in errors[0] and says in errors[0], out.stderr[-3000:]
    assert "on_invalid: skip" in errors[0]

    out = _cli(tmp_path, "cache", "--config_path", str(experiment), "--data.on_invalid", "skip")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{data}: skipped 1 conversation" in out.stderr, out.stderr[-3000:]
    cache_art = Pipeline(load_config(experiment, ["--data.on_invalid", "skip"]), progress=False).cached("token_cache")
    cache = open_cache(f"{cache_art.path}/train")
    assert cache.num_docs == len(good)
    if kind != "single_turn":  # the rendered conversations: transformers' ids and mask
        off = cache.doc_offsets
        for i, conv in enumerate(good):
            ids, mask = hf_reference(tokdir, conv, fmt.get("chat_template", TEMPLATE))
            assert cache.doc(i).tolist() == ids
            assert cache.read_loss_mask(int(off[i]), int(off[i + 1])).tolist() == mask
    # counted per reason in the shard's report, as the reader's invalid records are
    from lm_pipeline.data.encode import DocumentEncoder

    cfg = load_config(experiment, ["--data.on_invalid", "skip"])
    shard = resolve_shards(cfg.data, "train")[0]
    enc = DocumentEncoder(str(tokdir), chat=source_chat(cfg.data, str(tokdir)))
    assert sum(len(p.doc_lengths) for p in enc.iter_shard(shard)) == len(good)
    assert shard.last_report.skipped == {"bad_conversation": 1} and shard.last_report.valid == len(good)


def test_a_bad_conversation_in_a_worker_process_is_the_same_record_error(tmp_path):
    from lm_pipeline.data.validation import DataValidationError

    tokdir = chat_tokenizer(tmp_path / "tok")
    bad = [{"role": "user", "content": "alpha"}]
    paths = [write_chats(tmp_path / "a.jsonl", CONVERSATIONS[:2]), write_chats(tmp_path / "b.jsonl", [CONVERSATIONS[2], bad])]
    cfg = from_dict(DataConfig, {"train_urls": [str(p) for p in paths], "format": {"type": "chat"},
                                 "tokenizer": {"kind": "hf", "name_or_path": str(tokdir)}})
    with pytest.raises(DataValidationError) as e:
        build_cache(str(tmp_path / "cache"), resolve_shards(cfg, "train"), str(tokdir), num_workers=2, progress=False,
                    chat=source_chat(cfg, str(tokdir)))
    assert e.value.source == str(paths[1]) and e.value.location == "line 2" and e.value.reason == "bad_conversation"


def test_a_hub_tokenizer_artifact_stored_without_its_template_reads_it_from_the_source(tmp_path):
    """A hub tokenizer's artifact built before the tokenizer stage copied the chat template (same
    address: its code version is unchanged) has none: the template is read from the tokenizer's
    source, here a hub repository in the local Hugging Face cache read offline, and the cache holds
    transformers' ids and mask."""
    src = chat_tokenizer(tmp_path / "src")
    repo = tmp_path / "hf" / "hub" / "models--testorg--chat-tok"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    conf = {**json.loads((src / "tokenizer_config.json").read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}
    (snap / "tokenizer_config.json").write_text(json.dumps(conf))
    (snap / "config.json").write_text(json.dumps({"model_type": "gpt2"}))  # AutoTokenizer reads it first
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_CACHE": str(tmp_path / "hf" / "hub")}
    data = write_chats(tmp_path / "chat.jsonl")
    raw = pt.tiny_config(tmp_path)
    raw["data"].update({"train_urls": [str(data)], "validation_urls": [], "format": {"type": "chat"},
                        "tokenizer": {"kind": "hf", "name_or_path": "testorg/chat-tok"}})
    experiment = tmp_path / "hub.yaml"
    experiment.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    out = _cli(tmp_path, "cache", "--config_path", str(experiment), env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    # the artifact as the former tokenizer stage stored it: no chat template; the cache rebuilt
    (art,) = [p for p in (tmp_path / "store" / "tokenizer").iterdir() if not p.name.startswith(".")]
    stored = json.loads((art / "tokenizer_config.json").read_text())
    assert stored.pop("chat_template") == TEMPLATE
    (art / "tokenizer_config.json").write_text(json.dumps(stored))
    import shutil

    shutil.rmtree(tmp_path / "store" / "token_cache")
    out = _cli(tmp_path, "cache", "--config_path", str(experiment), env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tokenizer " in out.stderr and "cache hit" in out.stderr  # the old artifact, reused
    (cache_dir,) = [p for p in (tmp_path / "store" / "token_cache").iterdir() if not p.name.startswith(".")]
    cache = open_cache(str(cache_dir / "train"))
    off = cache.doc_offsets
    for i, conv in enumerate(CONVERSATIONS):
        ids, mask = hf_reference(src, conv)
        assert cache.doc(i).tolist() == ids
        assert cache.read_loss_mask(int(off[i]), int(off[i + 1])).tolist() == mask


def test_chat_records_that_are_no_conversation_are_named(tmp_path):
    from lm_pipeline.data.validation import DataValidationError

    tokdir = chat_tokenizer(tmp_path / "tok")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n" + json.dumps({"messages": "hello"}) + "\n")
    cfg = from_dict(DataConfig, {"train_urls": [str(bad)], "format": {"type": "chat"},
                                 "tokenizer": {"kind": "hf", "name_or_path": str(tokdir)}})
    with pytest.raises(DataValidationError, match="line 2.*not a conversation"):
        list(resolve_shards(cfg, "train")[0].iter_texts())


def test_single_turn_is_prompt_then_reply_with_the_loss_on_the_reply(tmp_path):
    """Levanter's single-turn chat: the first user message and the first assistant reply as one
    text (then EOS), no template; the mask is 0 on the prompt's tokens, 1 on the reply's and EOS."""
    from tokenizers import Tokenizer

    tokdir, cache = chat_cache(tmp_path, single_turn=True)
    tok = Tokenizer.from_file(str(tokdir / "tokenizer.json"))
    tok.encode_special_tokens = True
    eos = tok.token_to_id(EOS)
    off = cache.doc_offsets
    for i, conv in enumerate(CONVERSATIONS):
        user = next(m["content"] for m in conv if m["role"] == "user")
        reply = next(m["content"] for m in conv if m["role"] == "assistant")
        ids = tok.encode(user + reply).ids + [eos]
        prompt = len(tok.encode(user).ids)
        assert cache.doc(i).tolist() == ids
        assert cache.read_loss_mask(int(off[i]), int(off[i + 1])).tolist() == [0] * prompt + [1] * (len(ids) - prompt)


def test_worker_processes_and_a_hugging_face_json_dataset_give_the_same_cache(tmp_path):
    """Conversations read as Hugging Face rows (the json builder) and tokenized by two worker
    processes: the same ids and mask as the transformers reference."""
    tokdir = chat_tokenizer(tmp_path / "tok")
    paths = [write_chats(tmp_path / f"chat-{k}.jsonl", CONVERSATIONS[k::2]) for k in range(2)]
    cfg = from_dict(DataConfig, {"hf_id": "json", "hf_data_files": [str(p) for p in paths], "format": {"type": "chat"},
                                 "hf_shard_rows": 1, "tokenizer": {"kind": "hf", "name_or_path": str(tokdir)}})
    shards = resolve_shards(cfg, "train")
    assert len(shards) > 1
    build_cache(str(tmp_path / "cache"), shards, str(tokdir), num_workers=2, progress=False,
                chat=source_chat(cfg, str(tokdir)))
    cache = open_cache(str(tmp_path / "cache"))
    order = [c for k in range(2) for c in CONVERSATIONS[k::2]]
    off = cache.doc_offsets
    assert cache.num_docs == len(order)
    for i, conv in enumerate(order):
        ids, mask = hf_reference(tokdir, conv)
        assert cache.doc(i).tolist() == ids
        assert cache.read_loss_mask(int(off[i]), int(off[i + 1])).tolist() == mask


def test_the_template_read_from_the_tokenizer_directory_enters_the_cache_address(tmp_path):
    """Editing a local tokenizer's chat template (tokenizer_config.json, not tokenizer.json) moves a
    chat source's token cache and run to new addresses, not its raw shards; a text source over the
    same tokenizer keeps its addresses; a config field of the format moves the cache, not the shards."""
    from lm_pipeline.steps import Pipeline

    tokdir = chat_tokenizer(tmp_path / "tok")
    data = write_chats(tmp_path / "chat.jsonl")
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": t}) + "\n" for t in sample_texts(20)[1:] if t.strip()))

    def addresses(path: Path, *overrides: str) -> dict[str, str]:
        raw = pt.tiny_config(tmp_path)
        raw["data"].update({"train_urls": [str(path)], "validation_urls": [],
                            "tokenizer": {"kind": "hf", "name_or_path": str(tokdir)}})
        if path == data:
            raw["data"]["format"] = {"type": "chat"}
        exp = tmp_path / "exp.yaml"
        exp.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
        pipe = Pipeline(load_config(exp, list(overrides)), progress=False)
        return {s: pipe.address(s).fingerprint for s in ("raw_shards", "token_cache", "train_ckpt")}

    chat0, text0 = addresses(data), addresses(text)
    config = json.loads((tokdir / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.replace("\n", " \n")
    (tokdir / "tokenizer_config.json").write_text(json.dumps(config))
    chat1, text1 = addresses(data), addresses(text)
    assert chat1["raw_shards"] == chat0["raw_shards"]
    assert chat1["token_cache"] != chat0["token_cache"] and chat1["train_ckpt"] != chat0["train_ckpt"]
    assert text1 == text0
    unmasked = addresses(data, "--data.chat.mask_user_turns", "false")
    assert unmasked["raw_shards"] == chat1["raw_shards"] and unmasked["token_cache"] != chat1["token_cache"]


def test_pack_is_decided_by_the_run_not_the_token_cache(tmp_path):
    """format.pack changes how the run packs conversations into rows, not the tokens: two configs
    differing only in it share the raw shards and the token cache (built once) and have different
    train_ckpt addresses and run ids; each run reads the shared cache its own way."""
    from lm_pipeline.steps import Pipeline

    tokdir = chat_tokenizer(tmp_path / "tok")
    exp = _chat_experiment(tmp_path, tokdir, write_chats(tmp_path / "chat.jsonl"))
    pipes = {pack: Pipeline(load_config(exp, ["--data.chat.pack", str(pack).lower()]), progress=False)
             for pack in (True, False)}
    a, b = (pipes[p] for p in (True, False))
    for stage in ("raw_shards", "tokenizer", "token_cache"):
        assert a.address(stage).fingerprint == b.address(stage).fingerprint, stage
    assert a.address("train_ckpt").fingerprint != b.address("train_ckpt").fingerprint
    assert a.run_id() != b.run_id()
    a.token_cache()
    assert b.cached("token_cache") is not None  # the cache built for pack: true serves pack: false
    for pack, pipe in pipes.items():
        train = pipe.datasets()[0]
        assert train.packing == ("greedy" if pack else "single") and train.has_loss_mask
        seg = train.get_many(np.arange(len(train))).segment_ids
        assert (seg.max(axis=1) > 1).any() == pack  # several conversations in a row only when packed


def test_merged_part_caches_equal_one_build(tmp_path):
    """The fan-out's merge of part caches (each a group of shards) copies the loss mask with the ids:
    the merged cache equals the one built whole."""
    from lm_pipeline.data.cache import merge_cache_parts

    tokdir = chat_tokenizer(tmp_path / "tok")
    paths = [write_chats(tmp_path / f"chat-{k}.jsonl", CONVERSATIONS[k::2]) for k in range(2)]
    cfg = from_dict(DataConfig, {"train_urls": [str(p) for p in paths], "format": {"type": "chat"},
                                 "tokenizer": {"kind": "hf", "name_or_path": str(tokdir)}})
    shards, chat = resolve_shards(cfg, "train"), source_chat(cfg, str(tokdir))
    build_cache(str(tmp_path / "whole"), shards, str(tokdir), num_workers=1, progress=False, chat=chat)
    for k, s in enumerate(shards):
        build_cache(str(tmp_path / f"part-{k}"), [s], str(tokdir), num_workers=1, progress=False, chat=chat)
    merge_cache_parts(str(tmp_path / "merged"), [([s], str(tmp_path / f"part-{k}")) for k, s in enumerate(shards)],
                      str(tokdir), chat=chat)
    whole, merged = open_cache(str(tmp_path / "whole")), open_cache(str(tmp_path / "merged"))
    assert merged.ledger["settings"] == whole.ledger["settings"] and merged.num_tokens == whole.num_tokens
    assert (merged.read_tokens(0, merged.num_tokens) == whole.read_tokens(0, whole.num_tokens)).all()
    assert merged.read_loss_mask(0, merged.num_tokens).tolist() == whole.read_loss_mask(0, whole.num_tokens).tolist()
    assert 0 < int(merged.read_loss_mask(0, merged.num_tokens).sum()) < merged.num_tokens
