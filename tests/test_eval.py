"""Evaluation: loading trainer checkpoints, bits-per-byte checked by hand, the unigram baseline,
micro/macro aggregates, the report schema and its files."""

from __future__ import annotations

import json
import math
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pandas as pd
import pytest
from helpers.data import tiny_tokenizer

from lm_pipeline.batch import ArrayDataset
from lm_pipeline.config import RunConfig, dump_config, load_config
from lm_pipeline.data.cache import build_cache, open_cache
from lm_pipeline.data.loader import CacheDataset
from lm_pipeline.data.textshard import TextShard
from lm_pipeline.data.tokenizer import load_tokenizer
from lm_pipeline.eval import (
    EvalConfig,
    evaluate_checkpoint,
    evaluate_checkpoints,
    evaluate_model,
    load_model_from_checkpoint,
    read_report,
    report_schema,
    target_byte_weights,
    unigram_baseline,
    validate_report,
    write_report,
)
from lm_pipeline.models import Gpt2Config, LlamaConfig
from lm_pipeline.models.layers import named_params
from lm_pipeline.schema import ConfigError, from_dict
from lm_pipeline.train.checkpoint import Checkpointer, CheckpointerConfig
from lm_pipeline.train.trainer import TrainState

TOK_VOCAB = 300
PADDED = 320
GPT2 = Gpt2Config(seq_len=64, hidden_dim=32, num_layers=2, num_heads=4, gradient_checkpointing=False)
TRAIN_TEXTS = ["alpha beta gamma", "beta beta", "café 日本語 alpha", "x 42 x 42 x"]
EVAL_TEXTS = ["héllo wörld", "alpha gamma alpha", "日本語 text ✓", "42", "delta naïve 🙂 beta"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("eval")
    tokdir = tiny_tokenizer(str(base / "tok"), vocab_size=TOK_VOCAB)
    for name, texts in (("train", TRAIN_TEXTS), ("validation", EVAL_TEXTS)):
        build_cache(str(base / name), [TextShard(name, tuple(texts))], tokdir, num_workers=1, progress=False)
    return {"tok": tokdir, "train": open_cache(str(base / "train")), "validation": open_cache(str(base / "validation")),
            "base": base}


def write_checkpoint(base: pathlib.Path, cfg, model, tokdir: str, step: int = 7, mp: str = "f32") -> str:
    """A checkpoint as the trainer writes it: TrainState (with optimizer state), config, tokenizer."""
    params = eqx.filter(model, eqx.is_array)
    state = TrainState(jnp.asarray(step, jnp.int32), params, optax.adamw(1e-3).init(params),
                       jax.random.key_data(jax.random.key(0)))
    run_cfg = load_config(None, {"model": {"type": cfg.type, "seq_len": cfg.seq_len, "hidden_dim": cfg.hidden_dim,
                                           "num_layers": cfg.num_layers, "num_heads": cfg.num_heads},
                                 "trainer.mp": mp})
    with Checkpointer(CheckpointerConfig(base_path=str(base)), async_save=False) as ckpt:
        return ckpt.save(step, state, extra_files={"config.yaml": dump_config(run_cfg), "tokenizer": pathlib.Path(tokdir)})


def uniform_model():
    """Zero token embeddings (tied head): every logit is 0, so each prediction costs ln(vocab)."""
    model = GPT2.build(PADDED, key=jax.random.PRNGKey(0))
    return eqx.tree_at(lambda m: m.token_embeddings, model, jnp.zeros_like(model.token_embeddings))


def hand_docs(tokdir: str, texts: list[str]) -> list[tuple[list[int], int]]:
    """(token ids with the EOS every cached document ends with, UTF-8 bytes) per text."""
    tok = load_tokenizer(tokdir)
    eos = tok.token_to_id("<|endoftext|>")
    return [(tok.encode(t).ids + [eos], len(t.encode("utf-8"))) for t in texts]


def hand_unigram(tokdir: str) -> np.ndarray:
    counts = np.zeros(TOK_VOCAB)
    for ids, _ in hand_docs(tokdir, TRAIN_TEXTS):
        for i in ids:
            counts[i] += 1
    return np.log((counts + 1) / (counts.sum() + TOK_VOCAB))


def test_bits_per_byte_by_hand(data, tmp_path):
    """Uniform model (loss ln 320 per token) on whole documents (greedy packing: one document per
    segment, its first token unpredicted) and on a concat layout cut mid-document, with and
    without max_eval_batches, checked against sums written out by hand."""
    docs = hand_docs(data["tok"], EVAL_TEXTS)
    cache = data["validation"]
    assert cache.doc_lengths.tolist() == [len(ids) for ids, _ in docs]
    assert cache.doc_bytes.tolist() == [b for _, b in docs]
    logp = hand_unigram(data["tok"])
    ln_v = math.log(PADDED)

    step_dir = write_checkpoint(tmp_path / "run", GPT2, uniform_model(), data["tok"], step=3)
    sets = {"whole": CacheDataset(cache, 16, "greedy"), "concat": CacheDataset(cache, 4, "concat")}
    df = evaluate_checkpoint(step_dir, sets, batch_size=2, train_cache=data["train"])
    rows = {r["dataset"]: r for r in df.to_dict("records")}

    # whole documents: every token but each document's first is predicted; bytes pro rata
    tokens = sum(len(ids) - 1 for ids, _ in docs)
    nbytes = sum(b * (len(ids) - 1) / len(ids) for ids, b in docs)
    uni = sum(-logp[t] for ids, _ in docs for t in ids[1:])
    w = rows["whole"]
    assert w["tokens"] == tokens and w["bytes"] == pytest.approx(nbytes, rel=1e-12)
    assert w["loss"] == pytest.approx(ln_v, rel=1e-6) and w["perplexity"] == pytest.approx(PADDED, rel=1e-5)
    assert w["bpb"] == pytest.approx(tokens * ln_v / math.log(2) / nbytes, rel=1e-6)
    assert w["unigram_loss"] == pytest.approx(uni / tokens, rel=1e-9)
    assert w["unigram_bpb"] == pytest.approx(uni / math.log(2) / nbytes, rel=1e-9)
    assert w["step"] == 3 and w["kind"] == "dataset" and w["checkpoint"] == step_dir

    # concat rows of 4 tokens over the whole stream: positions 1..3 of each row are predicted
    stream = [t for ids, _ in docs for t in ids]
    per_token = [b / len(ids) for ids, b in docs for _ in ids]
    rows4 = len(stream) // 4
    predicted = [r * 4 + j for r in range(rows4) for j in (1, 2, 3)]
    c = rows["concat"]
    assert c["tokens"] == len(predicted) and c["rows"] == rows4
    assert c["bytes"] == pytest.approx(sum(per_token[i] for i in predicted), rel=1e-12)
    assert c["bpb"] == pytest.approx(len(predicted) * ln_v / math.log(2) / c["bytes"], rel=1e-6)
    assert c["unigram_loss"] == pytest.approx(sum(-logp[stream[i]] for i in predicted) / len(predicted), rel=1e-9)

    # aggregates: micro = totals, macro = unweighted means
    m, a = rows["_micro"], rows["_macro"]
    assert m["tokens"] == w["tokens"] + c["tokens"] and m["bytes"] == pytest.approx(w["bytes"] + c["bytes"])
    assert m["bpb"] == pytest.approx(m["tokens"] * ln_v / math.log(2) / m["bytes"], rel=1e-6)
    assert a["bpb"] == pytest.approx((w["bpb"] + c["bpb"]) / 2) and a["loss"] == pytest.approx(ln_v, rel=1e-6)
    assert a["unigram_loss"] == pytest.approx((w["unigram_loss"] + c["unigram_loss"]) / 2)

    # max_eval_batches: only the first rows, and exactly their bytes
    sub = evaluate_checkpoint(step_dir, {"concat": sets["concat"]}, batch_size=2, max_eval_batches=1)
    s = sub[sub.dataset == "concat"].iloc[0]
    first = [i for i in predicted if i < 8]
    assert s["rows"] == 2 and s["tokens"] == 6 and s["max_eval_batches"] == 1
    assert s["bytes"] == pytest.approx(sum(per_token[i] for i in first), rel=1e-12)
    assert np.isnan(s["unigram_loss"])  # no train cache given
    np.testing.assert_allclose(target_byte_weights(sets["concat"], [0, 1]).sum(), s["bytes"], rtol=1e-12)


def test_unigram_baseline_standalone(data):
    logp = hand_unigram(data["tok"])
    base = unigram_baseline(data["train"], data["validation"])
    assert base.vocab_size == TOK_VOCAB and base.train_tokens == sum(len(i) for i, _ in hand_docs(data["tok"], TRAIN_TEXTS))
    np.testing.assert_allclose(base.log_probs, logp, rtol=1e-12)
    p = np.exp(logp)
    assert base.entropy == pytest.approx(-(p * logp).sum(), rel=1e-12)
    docs = hand_docs(data["tok"], EVAL_TEXTS)
    nats = sum(-logp[t] for ids, _ in docs for t in ids)
    assert base.eval_tokens == sum(len(ids) for ids, _ in docs) and base.eval_bytes == sum(b for _, b in docs)
    assert base.loss == pytest.approx(nats / base.eval_tokens, rel=1e-12)
    assert base.bpb == pytest.approx(nats / math.log(2) / base.eval_bytes, rel=1e-12)


def test_load_model_and_evaluate_llama_checkpoint(data, tmp_path):
    cfg = LlamaConfig(seq_len=32, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2)
    model = cfg.build(PADDED, key=jax.random.PRNGKey(1))
    params = eqx.filter(model, eqx.is_array)
    state = TrainState(jnp.asarray(5, jnp.int32), params, optax.adamw(1e-3).init(params),
                       jax.random.key_data(jax.random.key(0)))
    run_cfg = RunConfig(model=cfg)
    files = {"config.yaml": dump_config(run_cfg), "tokenizer": pathlib.Path(data["tok"])}
    with Checkpointer(CheckpointerConfig(base_path=str(tmp_path)), async_save=False) as ckpt:
        early = ckpt.save(4, state, extra_files=files)
        step_dir = ckpt.save(5, state, extra_files=files)
    loaded = load_model_from_checkpoint(tmp_path)  # the run dir: its latest checkpoint
    got_cfg, got, tok, vocab = loaded
    assert got_cfg.model == cfg and vocab == PADDED and tok == str(pathlib.Path(step_dir) / "tokenizer")
    for name, value in named_params(model).items():
        np.testing.assert_array_equal(np.asarray(named_params(got)[name]), np.asarray(value), err_msg=name)
    bf16 = load_model_from_checkpoint(step_dir, dtype="bfloat16").model
    assert bf16.token_embeddings.dtype == jnp.bfloat16

    sets = {"validation": CacheDataset(data["validation"], 16, "first_fit"), "array": ArrayDataset(np.arange(64) % 50, 16)}
    df = evaluate_checkpoints([early, step_dir, tmp_path], sets, batch_size=3, train_cache=str(data["train"].location))
    assert len(df) == 8 and set(df.kind) == {"dataset", "micro", "macro"}  # run dir = step 5: once
    assert sorted(set(df.step)) == [4, 5]
    df = df[df.step == 5]
    arr = df[df.dataset == "array"].iloc[0]
    assert np.isnan(arr["bpb"]) and np.isnan(arr["bytes"])  # no byte information: no bpb, ...
    assert df[df.dataset == "_micro"]["bpb"].isna().all()  # ... nor for the aggregates
    val = df[df.dataset == "validation"]
    assert (val["bpb"] > 0).all() and val["compute_dtype"].eq("float32").all() and (val["step"] == 5).all()
    direct = evaluate_model(got, {"validation": sets["validation"]}, batch_size=3)["validation"]
    assert direct.loss == pytest.approx(float(val["loss"].iloc[0]), rel=1e-6)


@pytest.mark.slow  # compiles a train step (~15 s on 2 cores)
def test_checkpoint_written_by_the_trainer(data, tmp_path):
    """The loader reads what train() writes (TrainState with optimizer state, mixed precision)."""
    from lm_pipeline.train.run import train

    cfg = load_config(None, {
        "model": {"type": "gpt2", "seq_len": 16, "hidden_dim": 32, "num_layers": 2, "num_heads": 4},
        "trainer.num_train_steps": 2, "trainer.train_batch_size": 2, "trainer.mp": "p=f32,c=bfloat16",
        "trainer.log_dir": str(tmp_path / "logs"), "trainer.progress": False, "trainer.id": "t",
        "trainer.checkpointer.base_path": str(tmp_path / "ckpt"),
    })
    train_ds = CacheDataset(data["train"], 16, "concat")
    res = train(cfg, train_data=train_ds, vocab_size=PADDED, run_dir=str(tmp_path / "ckpt" / "t"),
                extra_checkpoint_files={"tokenizer": pathlib.Path(data["tok"])})
    loaded = load_model_from_checkpoint(tmp_path / "ckpt")
    assert loaded.config == cfg and loaded.vocab_size == PADDED and loaded.tokenizer_dir is not None
    for name, value in named_params(res.state.model).items():
        np.testing.assert_array_equal(np.asarray(named_params(loaded.model)[name]), np.asarray(value), err_msg=name)
    df = evaluate_checkpoint(tmp_path / "ckpt", {"validation": CacheDataset(data["validation"], 16, "concat")})
    assert (df["compute_dtype"] == "bfloat16").all() and (df["step"] == 2).all()

    from lm_pipeline.hf import export_hf, read_safetensors_dir

    out = export_hf(tmp_path / "ckpt", tmp_path / "hf")  # model, config and tokenizer from the checkpoint
    conf = json.loads((pathlib.Path(out) / "config.json").read_text())
    assert conf["vocab_size"] == TOK_VOCAB and conf["n_positions"] == 16
    assert read_safetensors_dir(out)["transformer.wte.weight"].shape == (TOK_VOCAB, 32)
    assert (pathlib.Path(out) / "tokenizer.json").is_file()


@pytest.fixture(scope="module")
def report(data, tmp_path_factory):
    step_dir = write_checkpoint(tmp_path_factory.mktemp("rep"), GPT2, uniform_model(), data["tok"], step=1)
    return evaluate_checkpoint(step_dir, {"validation": CacheDataset(data["validation"], 8, "concat")},
                               train_cache=data["train"])


def test_report_files_round_trip(report, tmp_path):
    files = write_report(report, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["eval_report.json", "eval_report.parquet"]
    back = read_report(tmp_path / "out")
    pd.testing.assert_frame_equal(back, report)
    records = json.loads(pathlib.Path(files["json"]).read_text())
    assert [r["dataset"] for r in records] == ["validation", "_micro", "_macro"]
    assert records[0]["loss"] == pytest.approx(report.loss.iloc[0], rel=1e-12)


def test_report_schema_rejects_malformed_tables(report):
    from pandera.errors import SchemaErrors

    validate_report(report)
    bad = {
        "missing column": report.drop(columns=["bpb"]),
        "extra column": report.assign(note="x"),
        "negative loss": report.assign(loss=-report.loss),
        "perplexity != exp(loss)": report.assign(perplexity=report.perplexity * 1.01),
        "tokens as float": report.assign(tokens=report.tokens.astype(float)),
        "unknown kind": report.assign(kind="other"),
        "duplicate rows": pd.concat([report, report], ignore_index=True),
        "null loss": report.assign(loss=np.nan),
        "aggregate named like a dataset": report.assign(dataset=["validation", "micro", "macro"]),
    }
    for what, df in bad.items():
        with pytest.raises(SchemaErrors):
            validate_report(df)
            pytest.fail(f"accepted a table with {what}")
    assert report_schema().name == "eval_report"
    with pytest.raises(SchemaErrors):
        write_report(bad["negative loss"], "/nonexistent/never-written")


def test_eval_config():
    cfg = from_dict(EvalConfig, {"max_eval_batches": 4, "compute_dtype": "bf16"})
    assert cfg.batch_size == 8 and cfg.unigram_baseline
    for data_, path in (({"batch_size": 0}, "batch_size"), ({"compute_dtype": "int4"}, "compute_dtype"),
                        ({"max_eval_batches": 0}, "max_eval_batches")):
        with pytest.raises(ConfigError) as e:
            from_dict(EvalConfig, data_)
        assert e.value.path == path
    with pytest.raises(ValueError, match="no rows"):
        evaluate_model(uniform_model(), {"empty": _Empty()})


class _Empty:
    seq_len = 8

    def __len__(self) -> int:
        return 0

    def get_many(self, indices):
        raise AssertionError("never read")



def test_evaluate_model_shows_progress_and_passes_its_faultpoint(data, tmp_path, capsys, monkeypatch):
    trace = tmp_path / "trace"
    monkeypatch.setenv("LM_PIPELINE_FAULTPOINT_TRACE", str(trace))
    sets = {"validation": CacheDataset(data["validation"], 4, "concat")}
    shown = evaluate_model(uniform_model(), sets, batch_size=2, progress=True)["validation"]
    assert shown.batches >= 2
    err = capsys.readouterr().err
    assert "eval validation" in err and "100%" in err and "batch" in err
    assert trace.read_text().split().count("eval.after_batch") == shown.batches
    evaluate_model(uniform_model(), sets, batch_size=2)  # not a terminal: quiet
    assert "eval validation" not in capsys.readouterr().err
