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


def test_values_beyond_the_range_are_clipped_not_inf():
    # One huge entry sets the scale; the rest underflow to zero or small values, none is inf/nan.
    x = jnp.asarray(np.r_[1e30, np.linspace(-1, 1, 15)].astype(np.float32)[None])
    y = fp8_dense(x, jnp.eye(16, dtype=jnp.float32))
    assert np.all(np.isfinite(np.asarray(y)))
    np.testing.assert_allclose(float(y[0, 0]), 1e30, rtol=0.07)
