"""Exports and evaluation numbers checked against independent references.

* A Hugging Face export of a GPT-2 and of a Llama whose config fields differ from transformers'
  defaults (norm epsilon, rope theta, tied embeddings, biases, grouped-query attention) loads in
  ``transformers`` with that config and gives our logits.
* A ``transformers`` Llama with such fields imports with the same config and logits.
* The evaluation report's per-set, ``_micro`` (totals) and ``_macro`` (unweighted means) rows
  follow the NumPy formulas: loss = nats / predicted tokens, bpb = nats / ln 2 / bytes.
"""

from __future__ import annotations

import json
import math
import pathlib

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers.data import tiny_tokenizer

from lm_pipeline.eval.evaluate import DatasetMetrics
from lm_pipeline.eval.report import report_frame, report_rows, validate_report
from lm_pipeline.hf import export_hf, load_hf_checkpoint
from lm_pipeline.models import Gpt2Config, LlamaConfig, LmConfig
from lm_pipeline.models.layers import named_params, replace_params

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOK_VOCAB = 300
# Config fields away from transformers' defaults, so an export that leaves one out is visible in the logits.
GPT2 = Gpt2Config(seq_len=48, hidden_dim=32, num_layers=2, num_heads=4, layer_norm_epsilon=0.5)
LLAMA = LlamaConfig(seq_len=48, hidden_dim=32, intermediate_dim=40, num_layers=3, num_heads=4, num_kv_heads=2,
                    rope_theta=37.0, layer_norm_epsilon=0.5, tie_word_embeddings=True, use_bias=True)


@pytest.fixture(autouse=True)
def exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return tiny_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab_size=TOK_VOCAB)


def _random_model(cfg: LmConfig, vocab: int, seed: int = 7, std: float = 0.2):
    """Our model with numpy-drawn weights: each layer's norms and biases distinct and nonzero."""
    skeleton = eqx.filter_eval_shape(cfg.build, vocab, key=jax.random.PRNGKey(0))
    rng = np.random.default_rng(seed)
    named = {name: (1.0 if name.endswith(".weight") else 0.0) + std * rng.standard_normal(leaf.shape, np.float32)
             for name, leaf in named_params(skeleton).items()}
    return replace_params(skeleton, named)


@eqx.filter_jit
def _forward(model, x):
    return model(x)


def _ids(b: int, t: int, high: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, high, (b, t), dtype=np.int64)


def _assert_close(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape
    err = np.abs(ours - ref).max()
    assert err <= 1e-4 * np.abs(ref).max(), err


@pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_export_with_nondefault_config_fields_matches_transformers(cfg, tokdir, tmp_path):
    model = _random_model(cfg, TOK_VOCAB)
    out = export_hf(model, tmp_path / "hf", tokenizer_dir=tokdir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    conf = hf.config
    if cfg.type == "llama":
        assert conf.rms_norm_eps == cfg.layer_norm_epsilon
        assert conf.max_position_embeddings == cfg.seq_len
        assert conf.tie_word_embeddings is True
        theta = (getattr(conf, "rope_parameters", None) or {}).get("rope_theta", getattr(conf, "rope_theta", None))
        assert theta == cfg.rope_theta
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # one tied matrix
    else:
        assert conf.layer_norm_epsilon == cfg.layer_norm_epsilon
        assert conf.n_positions == cfg.seq_len
    saved = json.loads(pathlib.Path(out, "config.json").read_text())
    assert saved["vocab_size"] == TOK_VOCAB
    if cfg.type == "llama":  # transformers 4.x reads rope_theta, 5.x rope_parameters: both written
        assert saved["rope_theta"] == saved["rope_parameters"]["rope_theta"] == cfg.rope_theta
    x = _ids(2, 20, TOK_VOCAB, seed=1)
    with torch.no_grad():
        ref = hf(torch.tensor(x)).logits.numpy()
    _assert_close(np.asarray(_forward(model, x.astype(np.int32))), ref)


def test_transformers_llama_with_nondefault_fields_imports_with_same_logits(tmp_path):
    hf_cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=48, rms_norm_eps=0.3, rope_theta=53.0,
        tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # norms start at exactly 1 and biases at 0: make every layer's its own
        for p in hf.parameters():
            p.add_(0.2 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    cfg, model = load_hf_checkpoint(str(tmp_path))
    assert (cfg.layer_norm_epsilon, cfg.rope_theta, cfg.seq_len, cfg.tie_word_embeddings) == (0.3, 53.0, 48, False)
    x = _ids(2, 16, 97, seed=2)
    with torch.no_grad():
        ref = hf(torch.tensor(x)).logits.numpy()
    _assert_close(np.asarray(_forward(model, x.astype(np.int32))), ref)


def test_report_rows_follow_the_loss_and_bpb_formulas():
    # two sets whose row, batch, token and byte counts all differ, so each total is told apart
    sets = {"a": DatasetMetrics(nats=700.0, tokens=250, bytes=1100.0, unigram_nats=1300.0, rows=5, batches=3,
                                seconds=1.5),
            "b": DatasetMetrics(nats=90.0, tokens=40, bytes=130.0, unigram_nats=200.0, rows=2, batches=1, seconds=0.5)}
    rows = report_rows("ckpt", 11, sets, entropy=5.0, max_eval_batches=None, model_type="gpt2", num_params=1000,
                       seq_len=64, compute_dtype="float32")
    df = validate_report(report_frame(rows)).set_index("dataset")
    nats = np.array([700.0, 90.0])
    tokens = np.array([250, 40])
    nbytes = np.array([1100.0, 130.0])
    uni = np.array([1300.0, 200.0])
    ln2 = np.log(2.0)
    loss, bpb = nats / tokens, nats / ln2 / nbytes
    np.testing.assert_allclose(df.loc[["a", "b"], "loss"], loss, rtol=1e-12)
    np.testing.assert_allclose(df.loc[["a", "b"], "bpb"], bpb, rtol=1e-12)
    np.testing.assert_allclose(df.loc[["a", "b"], "unigram_loss"], uni / tokens, rtol=1e-12)
    np.testing.assert_allclose(df.loc[["a", "b"], "unigram_bpb"], uni / ln2 / nbytes, rtol=1e-12)
    micro, macro = df.loc["_micro"], df.loc["_macro"]
    assert micro["loss"] == pytest.approx(nats.sum() / tokens.sum(), rel=1e-12)
    assert micro["perplexity"] == pytest.approx(math.exp(nats.sum() / tokens.sum()), rel=1e-12)
    assert micro["bpb"] == pytest.approx(nats.sum() / ln2 / nbytes.sum(), rel=1e-12)
    assert micro["unigram_loss"] == pytest.approx(uni.sum() / tokens.sum(), rel=1e-12)
    assert micro["unigram_bpb"] == pytest.approx(uni.sum() / ln2 / nbytes.sum(), rel=1e-12)
    assert (micro["tokens"], micro["bytes"], micro["rows"], micro["batches"]) == (290, 1230.0, 7, 4)
    assert macro["loss"] == pytest.approx(loss.mean(), rel=1e-12)
    assert macro["bpb"] == pytest.approx(bpb.mean(), rel=1e-12)
    assert macro["unigram_loss"] == pytest.approx((uni / tokens).mean(), rel=1e-12)
    assert macro["unigram_bpb"] == pytest.approx((uni / ln2 / nbytes).mean(), rel=1e-12)
