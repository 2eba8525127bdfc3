"""oneMKL's sgemm behind the native library's float32 product (``kernels/cpu/native/cpu_gemm.cc``):
every transposition and a ragged row split against float64 NumPy for each instruction-set level
the CPU runs, the projections', LM head's and fused head loss's values and gradients through it
against float64 references, the compute plan's choice, and a training step against XLA's own
products."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm_pipeline import compute
from lm_pipeline.compute import BLAS_ENV, blas_choice, plan_for
from lm_pipeline.kernels.cpu import blas, fused_head_loss, matmul, native_attention

pytestmark = pytest.mark.skipif(
    not (native_attention.available() and blas.available()),
    reason="needs the native library (a C++ compiler) and oneMKL (pip's mkl, part of the dev extras on x86-64 Linux)",
)

ISAS = native_attention.runnable_isas() if native_attention.available() else []


def _close(got, ref, rtol=2e-6):
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape
    scale = max(np.abs(ref).max(), 1e-30)
    assert np.abs(got - ref).max() <= rtol * scale * max(1, np.sqrt(ref.size) / 16), np.abs(got - ref).max() / scale


@pytest.mark.parametrize("isa", ISAS)
def test_gemm_is_the_float64_product_for_every_transposition(isa):
    rng = np.random.default_rng(0)
    # a tiny product (one task); products split over the pool with a ragged last block of rows
    # (M not a multiple of 16); a long K; a single row; an empty K (zeros)
    for m, k, n in ((5, 3, 7), (1003, 96, 80), (77, 2048, 33), (1, 300, 129), (40, 0, 6)):
        for ta in (False, True):
            for tb in (False, True):
                a = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
                b = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
                ref = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
                got = jax.jit(lambda x, y, ta=ta, tb=tb: matmul.gemm(x, y, ta, tb, isa))(a, b)
                if k == 0:
                    assert np.asarray(got).shape == (m, n) and not np.asarray(got).any()
                else:
                    _close(got, ref)


def test_gemm_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="two 2-D float32 arrays"):
        matmul.gemm(jnp.zeros((2, 3), jnp.bfloat16), jnp.zeros((3, 4)))
    with pytest.raises(ValueError, match="two 2-D float32 arrays"):
        matmul.gemm(jnp.zeros((2, 3, 4)), jnp.zeros((4, 4)))
    with pytest.raises(ValueError, match=r"op\(a\) is \[2, 3\] and op\(b\) \[4, 5\]"):
        matmul.gemm(jnp.zeros((2, 3)), jnp.zeros((4, 5)))


def test_projection_and_its_gradients_through_blas_match_float64():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 50, 40)).astype(np.float32)
    w = rng.standard_normal((40, 72)).astype(np.float32)
    g = rng.standard_normal((3, 50, 72)).astype(np.float32)
    y, vjp = jax.vjp(lambda a, b: matmul.dense(a, b, None, True, True), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    x64, w64, g64 = (v.astype(np.float64) for v in (x, w, g))
    _close(y, x64 @ w64)
    _close(dx, g64 @ w64.T)
    _close(dw, x64.reshape(-1, 40).T @ g64.reshape(-1, 72))


def test_lm_logits_and_their_gradients_through_blas_match_float64():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 24, 32)).astype(np.float32)
    w = rng.standard_normal((200, 32)).astype(np.float32)  # [V, D]
    g = rng.standard_normal((2, 24, 200)).astype(np.float32)
    y, vjp = jax.vjp(lambda a, b: matmul.lm_logits(a, b, None, False, True), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    x64, w64, g64 = (v.astype(np.float64) for v in (x, w, g))
    _close(y, x64 @ w64.T)
    _close(dx, g64 @ w64)
    _close(dw, g64.reshape(-1, 200).T @ x64.reshape(-1, 32))
    assert dw.shape == w.shape


@pytest.mark.parametrize("native", [False, True])
def test_fused_head_loss_through_blas_matches_float64(native):
    rng = np.random.default_rng(3)
    b, t, d, v = 2, 40, 24, 96
    h = rng.standard_normal((b, t, d)).astype(np.float32)
    head = (rng.standard_normal((v, d)) * 0.3).astype(np.float32)
    tgt = rng.integers(0, v, (b, t)).astype(np.int32)
    mask = (rng.random((b, t)) > 0.2).astype(np.float32)

    def loss(hh, ww):  # chunks of 16 rows: three chunks, the last one ragged
        return fused_head_loss.fused_head_xent_sum(hh, ww, jnp.asarray(tgt), jnp.asarray(mask), chunk_rows=16,
                                                   native=native, blas=True)

    val, (dh, dw) = jax.value_and_grad(loss, argnums=(0, 1))(jnp.asarray(h), jnp.asarray(head))
    h64, w64 = h.astype(np.float64), head.astype(np.float64)
    logits = h64 @ w64.T
    mx = logits.max(-1, keepdims=True)
    lse = mx[..., 0] + np.log(np.exp(logits - mx).sum(-1))
    picked = np.take_along_axis(logits, tgt[..., None], -1)[..., 0]
    np.testing.assert_allclose(float(val), float(((lse - picked) * mask).sum()), rtol=1e-5)
    dl = (np.exp(logits - lse[..., None]) - np.eye(v)[tgt]) * mask[..., None]
    _close(dh, dl @ w64, rtol=1e-5)
    _close(dw, dl.reshape(-1, v).T @ h64.reshape(-1, d), rtol=1e-5)


def test_blas_choice_reads_and_validates_the_variable():
    assert blas_choice({}) == "auto"
    assert blas_choice({BLAS_ENV: " MKL "}) == "mkl"
    with pytest.raises(ValueError, match=r"\$LM_PIPELINE_BLAS must be one of auto, mkl, xla; got 'openblas'"):
        blas_choice({BLAS_ENV: "openblas"})


def test_the_plan_takes_blas_for_float32_on_one_intel_cpu_device(monkeypatch):
    monkeypatch.delenv(BLAS_ENV, raising=False)
    monkeypatch.setattr("lm_pipeline.hostinfo.cpu_vendor", lambda: "GenuineIntel")
    assert plan_for("cpu", jnp.float32).blas
    assert not plan_for("cpu", jnp.bfloat16).blas  # bf16 products stay with XLA (AMX / AVX512-BF16)
    assert not plan_for("cpu", jnp.float32, num_devices=2).blas  # the partitioner cannot shard the call
    assert not plan_for("gpu", jnp.float32).blas
    monkeypatch.setattr("lm_pipeline.hostinfo.cpu_vendor", lambda: "AuthenticAMD")
    assert not plan_for("cpu", jnp.float32).blas  # auto: Intel only
    monkeypatch.setenv(BLAS_ENV, "mkl")
    assert plan_for("cpu", jnp.float32).blas
    monkeypatch.setenv(BLAS_ENV, "xla")
    monkeypatch.setattr("lm_pipeline.hostinfo.cpu_vendor", lambda: "GenuineIntel")
    assert not plan_for("cpu", jnp.float32).blas


def test_forcing_mkl_where_it_does_not_load_is_an_error(monkeypatch):
    monkeypatch.setenv(BLAS_ENV, "mkl")
    monkeypatch.setattr(blas, "available", lambda: False)
    with pytest.raises(ValueError, match=r"\$LM_PIPELINE_BLAS=mkl: oneMKL or the native CPU library does not load"):
        compute._blas_gemm()


@pytest.mark.parametrize("model", [
    {"model.type": "gpt2"},
    pytest.param({"model.type": "llama", "model.intermediate_dim": 96, "model.num_kv_heads": 2},  # SwiGLU, GQA, untied head
                 marks=pytest.mark.slow),
], ids=["gpt2", "llama"])
def test_training_steps_through_blas_match_xlas_products(model, monkeypatch):
    from lm_pipeline.batch import LmBatch
    from lm_pipeline.config import load_config
    from lm_pipeline.train.sharding import make_mesh
    from lm_pipeline.train.trainer import build_step_functions, put_batch

    rng = np.random.default_rng(4)
    batches = [LmBatch(rng.integers(0, 96, (4, 32), dtype=np.int32))] * 4  # one batch, learnt
    cfg = load_config(None, {**model, "model.seq_len": 32, "model.hidden_dim": 48, "model.num_layers": 2,
                             "model.num_heads": 4, "trainer.train_batch_size": 4, "trainer.mp": "f32",
                             "optimizer.learning_rate": 3e-3, "optimizer.warmup": 0})
    runs = {}
    for choice in ("xla", "mkl"):
        monkeypatch.setenv(BLAS_ENV, choice)
        plan = make_mesh(cfg.trainer, jax.devices()[:1])
        fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=96, num_train_steps=10,
                                   plan=plan, has_segments=False)
        assert fns.compute.blas == (choice == "mkl")
        state = fns.init(jax.random.key_data(jax.random.key(0)))
        losses = []
        for batch in batches:
            tokens, seg = put_batch(batch, plan)
            state, metrics = fns.train_step(state, tokens, seg)
            losses.append(float(metrics["train/loss"]))
        runs[choice] = (losses, jax.tree.leaves(eqx.filter(state.model, eqx.is_array)))
    np.testing.assert_allclose(runs["mkl"][0], runs["xla"][0], rtol=2e-5)
    assert runs["mkl"][0][-1] < runs["mkl"][0][0] - 0.05  # it trains
    for a, b in zip(runs["mkl"][1], runs["xla"][1], strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-4, atol=1e-5)
