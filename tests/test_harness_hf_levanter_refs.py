"""Downstream evaluation, Hugging Face import, Levanter / LLM-Trainer config reading and the
filesystem layer, each against a reference that does not go through the code under test.

* ``HarnessLM`` (lm-evaluation-harness over our JAX models): token-level log-likelihoods and
  greedy flags against NumPy log-softmax sums over the exact continuation tokens of the
  ``transformers`` model of the same export (a ``max_length`` shorter than the model's positions,
  requests that share their tokens but not the context/continuation boundary); encodings of text
  that already starts with BOS, and ``generate_until`` (left-truncated contexts, ``do_sample:
  false`` with a temperature, different ``max_gen_toks`` on prompts of one length) against the
  harness's own Hugging Face backend (``HFLM``) on that export.
* Results: flattened metric names of filtered metrics, ``--tasks NAME:K`` and the files written,
  against values written down here.
* Hugging Face import: ``config.json`` files as older ``transformers`` wrote them (defaults left
  out), GPT-2's ``gelu_pytorch_tanh`` and a headless ``GPT2Model`` checkpoint, against the logits
  of ``transformers`` itself.
* Levanter's ``model_averaging`` default, LLM Trainer's ``d_ff``, ``max_grad_norm: 0`` and
  schedules, and URL path helpers, against values written down here.

Everything is built in ``tmp_path`` (tiny tokenizers, models, task results); nothing is fetched.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from helpers.harness_tasks import bos_tokenizer, harness_requests

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # the HF backend's import
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lm_pipeline import fs  # noqa: E402
from lm_pipeline.config import load_config  # noqa: E402
from lm_pipeline.eval.harness import load_harness_lm  # noqa: E402
from lm_pipeline.eval.harness_config import EvalHarnessConfig  # noqa: E402
from lm_pipeline.eval.tasks import harness_config, metrics, write_results  # noqa: E402
from lm_pipeline.hf import export_hf, load_hf_checkpoint  # noqa: E402
from lm_pipeline.schema import ConfigError, from_dict  # noqa: E402

MAX_LENGTH = 24  # shorter than the model's 64 positions: windows are cut at 24 (+1) tokens


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """(export dir, the ``transformers`` model loaded from it) of a tiny Llama with a BOS tokenizer."""
    from test_hf import CONFIGS, make  # random weights, vocabulary padded beyond the tokenizer's

    tmp = tmp_path_factory.mktemp("refs")
    out = export_hf(make(CONFIGS["llama"], seed=5), tmp / "hf", tokenizer_dir=bos_tokenizer(str(tmp / "tok")))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    return str(out), hf


@pytest.fixture(scope="module")
def ours(export):
    return load_harness_lm(export[0], batch_size=4, max_length=MAX_LENGTH)


@pytest.fixture(scope="module")
def ref(export):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=export[0], device="cpu", batch_size=4, dtype="float32", max_length=MAX_LENGTH)


def _log_softmax(hf, tokens: list[int]) -> np.ndarray:
    """float64 log-probabilities [len(tokens), vocab] of the next token after each prefix."""
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0].double().numpy()
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def _reference(hf, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The continuation's summed log-probability and whether every token is the argmax, reading
    the last ``MAX_LENGTH + 1`` tokens (the model sees all but the last)."""
    window = [*context, *continuation][-(MAX_LENGTH + 1):]
    logp = _log_softmax(hf, window[:-1])
    rows = range(len(window) - 1 - len(continuation), len(window) - 1)
    picked = [logp[r, window[r + 1]] for r in rows]
    greedy = all(int(np.argmax(logp[r])) == window[r + 1] for r in rows)
    return float(np.sum(picked)), greedy


def _argmax_after(hf, tokens: list[int]) -> int:
    return int(np.argmax(_log_softmax(hf, tokens)[-1]))


def _not_argmax_after(hf, tokens: list[int]) -> int:
    return int(np.argsort(_log_softmax(hf, tokens)[-1])[-7])  # the 7th most likely: never the argmax


# --------------------------------------------------------------------------- log-likelihoods


def test_loglikelihood_tokens_are_numpy_log_softmax_sums_over_the_continuation(ours, export):
    """Each request's (sum of the continuation's log-probabilities, every token greedy) is the
    NumPy reference's: requests whose tokens are the same but split at another place score
    differently; a greedy token followed by a non-greedy one is not greedy; contexts longer than
    ``max_length`` are cut from the left."""
    _, hf = export
    ctx = ours.tok_encode("the quick fox")
    g1 = _argmax_after(hf, ctx)
    g2 = _argmax_after(hf, [*ctx, g1])
    miss = _not_argmax_after(hf, [*ctx, g1])
    long_ctx = ours.tok_encode(" ".join(["alpha beta gamma delta"] * 12))
    assert len(long_ctx) > MAX_LENGTH + 5
    pairs = [
        (ctx, [g1, miss]),  # first token greedy, second not
        ([*ctx, g1], [miss]),  # the same tokens, one more in the context
        (ctx[:-1], [ctx[-1], g1, miss]),  # the same tokens again, one more in the continuation
        (ctx, [g1, g2]),  # all greedy
        (long_ctx, [g1, miss]),  # beyond max_length: the model reads the last tokens only
        (long_ctx, [g1]),
    ]
    got = ours._loglikelihood_tokens([(None, c, x) for c, x in pairs], disable_tqdm=True)
    want = [_reference(hf, c, x) for c, x in pairs]
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=1e-4, atol=1e-4)
    assert [g[1] for g in got] == [w[1] for w in want] == [False, False, False, True, False, want[5][1]]
    assert len({round(w[0], 3) for w in want[:3]}) == 3  # the three splits really differ


def test_text_that_starts_with_bos_gets_no_second_bos(ours, ref):
    """A context that already begins with the BOS text is encoded without another BOS, as the
    harness's HF backend does; its log-likelihoods and rolling log-likelihood are the backend's."""
    bos = ours.tok_decode([ours.prefix_token_id], skip_special_tokens=False)
    assert bos == "<s>"
    for text in (f"{bos}the quick", f"{bos} alpha beta", "the quick"):
        assert ours.tok_encode(text) == ref.tok_encode(text), text
    assert ours.tok_encode(f"{bos}the quick").count(ours.prefix_token_id) == 1
    pairs = [(f"{bos}the quick", " fox"), (f"{bos}alpha", " beta gamma")]
    got = ours.loglikelihood(harness_requests("loglikelihood", pairs), disable_tqdm=True)
    want = ref.loglikelihood(harness_requests("loglikelihood", pairs), disable_tqdm=True)
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=1e-4)
    texts = [(f"{bos}gamma delta x gamma",)]
    np.testing.assert_allclose(ours.loglikelihood_rolling(harness_requests("loglikelihood_rolling", texts), disable_tqdm=True),
                               ref.loglikelihood_rolling(harness_requests("loglikelihood_rolling", texts), disable_tqdm=True),
                               rtol=1e-4)


def test_generate_until_gives_the_hf_backends_text(ours, ref):
    """Left-truncated long contexts, ``do_sample: false`` with a temperature (greedy), and two
    prompts of one length asking for different numbers of new tokens: the backend's text."""
    long_ctx = " ".join(["alpha beta gamma delta"] * 12)
    args = [
        (long_ctx, {"until": ["\n\n"], "max_gen_toks": 4}),
        ("the quick", {"until": ["\n\n"], "max_gen_toks": 5, "do_sample": False, "temperature": 2.0}),
        ("alpha beta", {"until": ["\n\n"], "max_gen_toks": 2}),
        ("alpha beta", {"until": ["\n\n"], "max_gen_toks": 7}),
    ]
    got = ours.generate_until(harness_requests("generate_until", args), disable_tqdm=True)
    want = ref.generate_until(harness_requests("generate_until", args), disable_tqdm=True)
    assert got == want
    assert len(ref.tok_encode(want[3], add_special_tokens=False)) > 2  # the longer answer really is longer


# --------------------------------------------------------------------------- results and --tasks


def test_metrics_keep_each_filter_apart():
    """``acc,none`` is ``acc``; other filters stay in the name (``exact_match/strict-match``);
    aliases, strings (``N/A``), booleans and NaN are left out."""
    results = {"results": {"t": {
        "alias": "t", "acc,none": 0.25, "acc_stderr,none": 0.125, "exact_match,strict-match": 0.5,
        "exact_match,flexible-extract": 0.75, "exact_match_stderr,strict-match": "N/A", "bleu,none": float("nan"),
        "flag,none": True, "n,none": 3,
    }}}
    assert metrics(results) == {
        "lm_eval/t/acc": 0.25, "lm_eval/t/acc_stderr": 0.125, "lm_eval/t/exact_match/strict-match": 0.5,
        "lm_eval/t/exact_match/flexible-extract": 0.75, "lm_eval/t/n": 3.0,
    }


def test_tasks_option_sets_the_few_shot_count_and_keeps_the_section():
    """``--tasks a:2,b``: task ``a`` with 2 few-shot examples under the alias ``a_2shot``, task ``b``
    as defined; the section's other settings stay; a non-number shot count is an error."""
    section = from_dict(EvalHarnessConfig, {"task_spec": ["old"], "max_examples": 3, "batch_size": 2})
    cfg = harness_config(section, "tiny_arc:2, tiny_hellaswag")
    assert cfg.task_list() == [{"task": "tiny_arc", "task_alias": "tiny_arc_2shot", "num_fewshot": 2}, "tiny_hellaswag"]
    assert (cfg.max_examples, cfg.batch_size) == (3, 2)
    assert harness_config(section, None) is section
    with pytest.raises(ConfigError):
        harness_config(section, "tiny_arc:two")


def test_results_and_samples_files(tmp_path):
    """``harness_results.json`` holds everything but the samples; ``samples_<task>.jsonl`` one JSON
    document per line, in order."""
    samples = {"a": [{"doc_id": 0, "resps": [["x"]]}, {"doc_id": 1, "resps": [["y"]]}], "b": [{"doc_id": 0}]}
    results = {"results": {"a": {"acc,none": 1.0}}, "samples": samples}
    files = write_results(results, str(tmp_path / "out"))
    assert files == {"results": str(tmp_path / "out" / "harness_results.json"),
                     "samples_a": str(tmp_path / "out" / "samples_a.jsonl"),
                     "samples_b": str(tmp_path / "out" / "samples_b.jsonl")}
    assert json.loads((tmp_path / "out" / "harness_results.json").read_text()) == {"results": {"a": {"acc,none": 1.0}}}
    for task, want in samples.items():
        lines = (tmp_path / "out" / f"samples_{task}.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == want


# --------------------------------------------------------------------------- Hugging Face import


def _hf_logits(model, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(x)).logits.numpy()


def _our_logits(model, x: np.ndarray) -> np.ndarray:
    import equinox as eqx

    return np.asarray(eqx.filter_jit(lambda m, t: m(t))(model, x.astype(np.int32)))


def _close(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max(), np.abs(ours - ref).max()


def _perturbed(model, scale: float):
    torch.manual_seed(0)
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: make every tensor matter
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model.eval()


def test_an_untied_llama_whose_config_json_leaves_out_its_defaults(tmp_path):
    """``config.json`` as older ``transformers`` wrote it (keys at their default left out, e.g.
    ``tie_word_embeddings: false``): the import is the model ``transformers`` loads, untied."""
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    _perturbed(transformers.LlamaForCausalLM(cfg), 0.05).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    written = json.loads(path.read_text())
    for key in ("tie_word_embeddings", "rms_norm_eps", "attention_bias", "mlp_bias", "head_dim", "pretraining_tp"):
        written.pop(key, None)
    path.write_text(json.dumps(written))
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert not reference.config.tie_word_embeddings
    got, model = load_hf_checkpoint(str(tmp_path))
    assert got.tie_word_embeddings is False
    x = np.random.default_rng(0).integers(0, 97, (2, 10))
    _close(_our_logits(model, x), _hf_logits(reference, x))


def test_gpt2_with_gelu_pytorch_tanh_and_a_headless_gpt2model_checkpoint(tmp_path):
    """GPT-2 with ``activation_function: gelu_pytorch_tanh``, saved as a headless ``GPT2Model``
    (tensor names without ``transformer.``, as the hub's ``gpt2`` repo): the import's logits are
    those of ``GPT2LMHeadModel`` with the same weights (its head tied to the embedding)."""
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                  activation_function="gelu_pytorch_tanh", bos_token_id=0, eos_token_id=0)
    lm = _perturbed(transformers.GPT2LMHeadModel(cfg), 0.5)
    lm.transformer.save_pretrained(tmp_path / "headless")
    got, model = load_hf_checkpoint(str(tmp_path / "headless"))
    assert got.activation_function == "gelu_new"  # the tanh approximation
    x = np.random.default_rng(1).integers(0, 97, (2, 12))
    _close(_our_logits(model, x), _hf_logits(lm, x))


# --------------------------------------------------------------------------- configs


def test_levanter_model_averaging_without_beta_is_levanters_default():
    """``trainer.model_averaging: {type: ema}`` is an EMA with Levanter's default beta 0.999."""
    assert load_config(None, {"trainer.model_averaging": {"type": "ema"}}).optimizer.ema_beta == 0.999
    assert load_config(None, {"trainer.model_averaging": {"type": "ema", "beta": 0.9}}).optimizer.ema_beta == 0.9


def test_llm_trainer_d_ff_grad_norm_and_schedule():
    """``d_ff`` 96 over ``d_model`` 64 is an MLP of 96 (scale 1.5); ``max_grad_norm=0`` is no
    clipping; ``constant_with_warmup`` is the constant schedule after warmup."""
    from lm_pipeline.compat.llm_trainer import DataConfig, ModelConfig, TrainingConfig, to_run_config

    model = ModelConfig(vocab_size=300, d_model=64, n_heads=4, n_layers=1, d_ff=96, max_seq_len=32)
    data = DataConfig(dataset_name=None, builtin="python_stdlib", max_length=32)
    training = TrainingConfig(max_grad_norm=0, lr_scheduler="constant_with_warmup", warmup_steps=3)
    cfg = to_run_config(model, training, data, devices=1)
    assert (cfg.model.mlp_scale, cfg.model.mlp_dim) == (1.5, 96)
    assert cfg.optimizer.max_grad_norm is None
    assert (cfg.optimizer.lr_schedule, cfg.optimizer.warmup) == ("constant", 3)


# --------------------------------------------------------------------------- filesystem


def test_url_joins_and_basenames():
    """URL joins keep every component (``/`` between them, none doubled); the basename of a URL
    ignores a trailing ``/`` (it is the directory's own name)."""
    assert fs.join("s3://b/runs/", "a", "/b/", "c.json") == "s3://b/runs/a/b/c.json"
    assert fs.basename("gs://b/dir/sub/") == "sub"
    assert fs.basename("gs://b/dir/sub") == "sub"
    assert fs.basename("memory://b/x.json") == "x.json"
