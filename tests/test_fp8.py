"""fp8 matmuls (``lm_pipeline.fp8``) against a NumPy transcription with ml_dtypes' fp8 types.

The reference quantizes each tensor under its own scale (amax / the format's max), rounds it to
e4m3 (operands) or e5m2 (the output gradient) with ml_dtypes, and multiplies in float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lm_pipeline.fp8 import fp8_dense


def np_qdq(x: np.ndarray, fp8) -> np.ndarray:
    x = x.astype(np.float32)
    fmax = np.float32(float(ml_dtypes.finfo(fp8).max))
    amax = np.float32(np.abs(x).max())
    scale = amax / fmax if amax > 0 else np.float32(1)
    q = np.clip(x / scale, -fmax, fmax).astype(fp8)
    return q.astype(np.float64) * np.float64(scale)


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    # Spread magnitudes over several binades so that rounding to 3 mantissa bits matters.
    x = (rng.standard_normal((3, 5, 24)) * np.exp(rng.uniform(-2, 2, (3, 5, 24)))).astype(np.float32)
    w = (rng.standard_normal((24, 16)) * 0.2).astype(np.float32)
    g = (rng.standard_normal((3, 5, 16)) * np.exp(rng.uniform(-3, 3, (3, 5, 16)))).astype(np.float32)
    return x, w, g


def test_forward_multiplies_the_e4m3_values_of_both_operands():
    x, w, _ = _inputs()
    ref = np.einsum("bti,io->bto", np_qdq(x, ml_dtypes.float8_e4m3fn), np_qdq(w, ml_dtypes.float8_e4m3fn))
    got = np.asarray(jax.jit(fp8_dense)(jnp.asarray(x), jnp.asarray(w)))
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=1e-6)
    # ...which is not the float32 product: the quantization really happens.
    exact = np.einsum("bti,io->bto", x.astype(np.float64), w.astype(np.float64))
    assert np.abs(got - exact).max() > 100 * np.abs(got - ref).max()


def test_gradients_are_products_of_the_e5m2_output_gradient_and_the_e4m3_operands():
    x, w, g = _inputs(1)
    xq, wq = np_qdq(x, ml_dtypes.float8_e4m3fn), np_qdq(w, ml_dtypes.float8_e4m3fn)
    gq = np_qdq(g, ml_dtypes.float8_e5m2)
    _, vjp = jax.vjp(fp8_dense, jnp.asarray(x), jnp.asarray(w))
    dx, dw = (np.asarray(a) for a in vjp(jnp.asarray(g)))
    np.testing.assert_allclose(dx, np.einsum("bto,io->bti", gq, wq), rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(dw, np.einsum("bti,bto->io", xq, gq), rtol=2e-6, atol=1e-5)
    # e5m2 (2 mantissa bits), not e4m3, for the gradient: the two roundings differ on these values.
    gq4 = np_qdq(g, ml_dtypes.float8_e4m3fn)
    assert np.abs(dx - np.einsum("bto,io->bti", gq4, wq)).max() > 10 * np.abs(dx - np.einsum("bto,io->bti", gq, wq)).max()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_keeps_the_compute_dtype_and_handles_zeros(dtype):
    x = jnp.zeros((2, 8), dtype)
    w = jnp.ones((8, 4), dtype)
    y, vjp = jax.vjp(fp8_dense, x, w)
    dx, dw = vjp(jnp.ones_like(y))
    assert y.dtype == dx.dtype == dw.dtype == dtype
    assert not np.any(np.asarray(y, np.float32)) and np.all(np.isfinite(np.asarray(dx, np.float32)))
    np.testing.assert_array_equal(np.asarray(dw, np.float32), 0.0)


def test_a_tiny_gradient_gives_finite_gradients():
    # amax / 57344 underflows float32 for an amax below ~6.7e-34: the scale must not become 0.
    x = jnp.asarray(np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8))
    w = jnp.asarray(np.linspace(-0.5, 0.5, 24, dtype=np.float32).reshape(8, 3))
    g = jnp.zeros((4, 3), jnp.float32).at[0, 0].set(1e-36)
    _, vjp = jax.vjp(fp8_dense, x, w)
    dx, dw = vjp(g)
    assert np.all(np.isfinite(np.asarray(dx))) and np.all(np.isfinite(np.asarray(dw)))
    assert np.count_nonzero(np.asarray(dx)) <= 8  # only the one row the gradient touches


def test_values_beyond_the_range_are_clipped_not_inf():
    # One huge entry sets the scale; the rest underflow to zero or small values, none is inf/nan.
    x = jnp.asarray(np.r_[1e30, np.linspace(-1, 1, 15)].astype(np.float32)[None])
    y = fp8_dense(x, jnp.eye(16, dtype=jnp.float32))
    assert np.all(np.isfinite(np.asarray(y)))
    np.testing.assert_allclose(float(y[0, 0]), 1e30, rtol=0.07)


def test_training_with_fp8_projections_learns_close_to_float32():
    """``trainer.quantization.fp8`` makes the step's plan multiply fp8 values; the run still learns
    a periodic sequence, and its losses follow float32's without equalling them. (The config admits
    fp8 only on a GPU with fp8 matmuls; the step itself computes the same values anywhere.)"""
    import dataclasses

    from lm_pipeline.batch import ArrayDataset, StepBatchSource
    from lm_pipeline.config import load_config
    from lm_pipeline.train.quantization import QuantizationConfig
    from lm_pipeline.train.sharding import make_mesh
    from lm_pipeline.train.trainer import build_step_functions, put_batch

    cfg = load_config(None, {"model.type": "gpt2", "model.hidden_dim": 32, "model.num_heads": 2,
                             "model.num_layers": 2, "model.seq_len": 32, "trainer.mp": "f32",
                             "trainer.train_batch_size": 8, "optimizer.learning_rate": 1e-2, "optimizer.warmup": 0})
    plan = make_mesh(cfg.trainer, jax.devices()[:1])
    tokens = np.tile(np.random.default_rng(0).integers(0, 64, 97), 64 * 32 // 97 + 2)[: 64 * 32]  # a repeated "text"
    src = StepBatchSource(ArrayDataset(tokens, 32), 8, seed=0)

    def losses(trainer_cfg):
        fns = build_step_functions(cfg.model, cfg.optimizer, trainer_cfg, vocab_size=64, num_train_steps=40,
                                   plan=plan, has_segments=False)
        state = fns.init(jax.random.key_data(jax.random.key(0)))
        out = []
        for step in range(40):
            state, m = fns.train_step(state, *put_batch(src.batch(step), plan))
            out.append(float(m["train/loss"]))
        return fns.compute, np.array(out)

    plain_plan, plain = losses(cfg.trainer)
    fp8_plan, fp8 = losses(dataclasses.replace(cfg.trainer, quantization=QuantizationConfig(fp8=True)))
    assert fp8_plan.fp8 and not plain_plan.fp8
    assert np.all(np.isfinite(fp8)) and fp8[-5:].mean() < 0.5 * fp8[:5].mean()
    assert 0 < abs(fp8[0] - plain[0]) < 0.02 * plain[0]  # the same model, quantized
    assert abs(fp8[-5:].mean() - plain[-5:].mean()) < 0.15 * plain[-5:].mean()
