"""fp8 matmuls for training (Levanter's ``trainer.quantization: {fp8: true}``).

A dense layer's ``x @ w`` computes on fp8 values: both operands are quantized to ``float8_e4m3fn``
in the forward pass, and the output's gradient to ``float8_e5m2`` (wider range, fewer mantissa
bits) in the backward pass; the weight and input gradients are products of those fp8 values. Each
tensor has one scale, taken from its own absolute maximum in the same step ("current scaling", as
Transformer Engine's current-scaling recipe; Levanter keeps a history of maxima instead, "delayed
scaling", so its numbers differ slightly).

Written as quantize-dequantize (``convert(q) * scale`` feeding the dot): on a GPU with fp8
matmuls (compute capability 8.9 or newer) XLA's GEMM rewriter turns that pattern into one fp8
cuBLASLt matmul with the scales applied in its epilogue; anywhere else the same graph computes
the same values in float32, which is how the tests check it against a NumPy transcription. The
config refuses fp8 on devices without fp8 matmuls (:mod:`lm_pipeline.train.quantization`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FORWARD = jnp.float8_e4m3fn
BACKWARD = jnp.float8_e5m2


def dequant_scale(x: jax.Array, dtype) -> jax.Array:
    """The per-tensor scale ``amax(|x|) / max(dtype)`` in float32: 1 for an all-zero tensor, and
    never below float32's smallest normal number (a tiny ``amax`` would otherwise flush the scale
    to 0, and ``0 / 0`` make the zeros NaN)."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    fmax = jnp.float32(jnp.finfo(dtype).max)
    scale = jnp.maximum(amax / fmax, jnp.finfo(jnp.float32).tiny)
    return jax.lax.stop_gradient(jnp.where(amax > 0, scale, jnp.float32(1.0)))


def quantize_dequantize(x: jax.Array, dtype) -> jax.Array:
    """``x`` rounded to ``dtype`` (fp8) under its own scale, back in float32: what an fp8 matmul
    multiplies. Values are clipped to the format's range before rounding (never inf)."""
    scale = dequant_scale(x, dtype)
    fmax = jnp.float32(jnp.finfo(dtype).max)
    q = jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax).astype(dtype)
    return q.astype(jnp.float32) * scale


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum("...i,io->...o", a, b, preferred_element_type=jnp.float32)


@jax.custom_vjp
def fp8_dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` (``x``: ``[..., d_in]``, ``w``: ``[d_in, d_out]``) on e4m3 operands; gradients on
    the e5m2 output gradient. Returns ``x``'s dtype."""
    return _dot(quantize_dequantize(x, FORWARD), quantize_dequantize(w, FORWARD)).astype(x.dtype)


def _fwd(x, w):
    xq, wq = quantize_dequantize(x, FORWARD), quantize_dequantize(w, FORWARD)
    # Empty arrays carry the operands' dtypes (a residual must be an array).
    return _dot(xq, wq).astype(x.dtype), (xq, wq, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _bwd(res, g):
    xq, wq, x_like, w_like = res
    gq = quantize_dequantize(g, BACKWARD)
    dx = jnp.einsum("...o,io->...i", gq, wq, preferred_element_type=jnp.float32)
    dw = jnp.einsum("...i,...o->io", xq, gq, preferred_element_type=jnp.float32)
    return dx.astype(x_like.dtype), dw.astype(w_like.dtype)


fp8_dense.defvjp(_fwd, _bwd)
