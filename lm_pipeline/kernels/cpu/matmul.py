"""Matmuls whose weight gradient XLA:CPU computes with its fast kernel, and their remat policy.

Autodiff writes a projection's weight gradient as ``einsum("mk,mn->kn", x, g)``, contracting
both operands over their leading axis; XLA:CPU hands that form to Eigen, which is much slower
on this project's shapes than the same product as a plain ``[K, M] @ [M, N]`` (taken by
YNNPACK). :func:`matmul` has the same forward values and a hand-written backward that
transposes an operand into its own buffer first (``docs/benchmarks.md``).

XLA folds a transpose it can see back into the dot's dimension numbers. For float32 operands an
optimisation barrier keeps the transposed copy; with bf16 operands XLA computes the product in
float32 anyway (the rounded values, at float32's speed). With ``native`` (the plan's ``native_transpose``: one
CPU device where the native library builds) the transpose is the library's opaque custom call
(``native/cpu_transpose.cc``), so the product stays a plain one in the operands' own dtype.

With ``blas`` (the plan's: float32 on one device of an Intel CPU) the float32 products, forward
and both gradients, go to oneMKL's sgemm through the native library instead (:func:`gemm`),
which reads a transposed operand in place: no transposed copy at all.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lm_pipeline.kernels.cpu.blocked_attention import ATTENTION_RESIDUALS

DENSE_OUT = "dense_out"
"""The name :func:`dense` gives its output, so that :func:`matmuls_and_attention_saveable` keeps it
(a custom VJP is not a ``dot_general``, which ``dots_saveable`` would recognise)."""


def _accumulation(*xs: jax.Array):
    """float32 results for bf16/f16 operands: XLA:CPU hands a bf16 x bf16 -> f32 product to
    YNNPACK's bf16 kernels (AVX512-BF16 / AMX where the CPU has them), while a bf16 result takes a
    slower path; the sum is also rounded once, at the end, instead of in bf16."""
    return jnp.float32 if any(x.dtype in (jnp.bfloat16, jnp.float16) for x in xs) else None


def _einsum(spec: str, a: jax.Array, b: jax.Array, dtype) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=_accumulation(a, b)).astype(dtype)


def round_to(x: jax.Array, operands) -> jax.Array:
    """``x`` as a matmul operand: rounded to ``operands`` (a dtype; ``trainer.mp``'s ``m=``), or
    itself when None. float32 to bfloat16 goes through :func:`bf16_round`."""
    if operands is None or x.dtype == operands:
        return x
    if x.dtype == jnp.float32 and jnp.dtype(operands) == jnp.bfloat16:
        return bf16_round(x)
    return x.astype(operands)


def bf16_round(x: jax.Array) -> jax.Array:
    """float32 ``x`` rounded to bfloat16 to nearest, ties to even: the bits of ``x.astype(bfloat16)``
    (NaNs included), written as integer operations that XLA:CPU fuses into the
    producer and vectorises; its own convert runs at about half that speed (``docs/benchmarks.md``)."""
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    rounded = (u + (jnp.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000  # from the bits: no float comparison that fast-math could fold away
    bits = jnp.where(nan, ((u >> 16) & 0x8000) | 0x7FC0, rounded).astype(jnp.uint16)  # a NaN: never rounded to inf
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def uses_blas(blas: bool, *xs: jax.Array) -> bool:
    """Whether a product of ``xs`` goes to :func:`gemm`: the plan asks for it (``blas``) and every
    operand is float32."""
    return blas and all(x.dtype == jnp.float32 for x in xs)


def blas_nn(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [..., K] @ w [K, N]`` by :func:`gemm`."""
    return gemm(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[1])


def blas_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [..., K] @ w [N, K]ᵀ`` by :func:`gemm`."""
    return gemm(x.reshape(-1, x.shape[-1]), w, trans_b=True).reshape(*x.shape[:-1], w.shape[0])


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def matmul(x: jax.Array, w: jax.Array, operands=None, native: bool = False, blas: bool = False) -> jax.Array:
    """``x [..., K] @ w [K, N] -> [..., N]``; the weight gradient goes through :func:`xt_g`.

    ``operands``: None, or the dtype both operands are rounded to in this product and in its two
    gradient products (which accumulate in float32); the result and the gradients keep the
    inputs' dtypes. ``native``: :func:`xt_g`'s. ``blas``: float32 products (this one and both
    gradient products) go to oneMKL's sgemm through :func:`gemm`, which reads the transposed
    operands in place."""
    xi, wi = round_to(x, operands), round_to(w, operands)
    if uses_blas(blas, xi, wi):
        return blas_nn(xi, wi)
    return _einsum("...k,kn->...n", xi, wi, jnp.result_type(x, w))


def _matmul_fwd(x, w, operands, native, blas):
    return matmul(x, w, operands, native, blas), (x, w)


def _matmul_bwd(operands, native, blas, res, g):
    x, w = res
    gl, xi, wi = round_to(g, operands), round_to(x, operands), round_to(w, operands)
    x2, g2 = xi.reshape(-1, x.shape[-1]), gl.reshape(-1, g.shape[-1])
    if uses_blas(blas, gl, xi, wi):
        return blas_nt(gl, wi).astype(x.dtype), gemm(x2, g2, trans_a=True).astype(w.dtype)
    dx = _einsum("...n,kn->...k", gl, wi, x.dtype)
    dw = xt_g(x2, g2, native)
    return dx, dw.astype(w.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def xt_g(x: jax.Array, g: jax.Array, native: bool = False) -> jax.Array:
    """The weight gradient ``x [M, K]ᵀ @ g [M, N] -> [K, N]`` as a plain product.

    ``native``: ``x`` is transposed by the native library's custom call (:func:`transpose`),
    which XLA cannot fold into the dot. Otherwise the smaller of the two operands is transposed
    by XLA into its own buffer first (an optimisation barrier, which keeps a float32 product
    from being folded back into Eigen's form); the smaller one because XLA:CPU's transpose is a
    slow single-threaded loop.
    """
    acc = _accumulation(x, g)
    if native:
        return jnp.matmul(transpose(x), g, preferred_element_type=acc)
    if x.shape[1] <= g.shape[1]:
        return jnp.matmul(jax.lax.optimization_barrier(x.T), g, preferred_element_type=acc)
    return jnp.matmul(jax.lax.optimization_barrier(g.T), x, preferred_element_type=acc).T


def transpose(x: jax.Array, isa: str | None = None) -> jax.Array:
    """``x [M, K]`` -> ``xᵀ [K, M]`` (any 2- or 4-byte dtype, bits unchanged) by the native
    library's custom call (:mod:`~lm_pipeline.kernels.cpu.native_attention` builds and registers
    it, for ``isa`` or by default the CPU's best level; raises
    :class:`~lm_pipeline.kernels.cpu.native_attention.NativeAttentionUnavailable` where it cannot
    be built). No gradient: it is only used inside backward rules."""
    from lm_pipeline.kernels.cpu import native_attention

    if x.ndim != 2 or x.dtype.itemsize not in (2, 4):
        raise ValueError(f"native transpose: a 2-D array of 2- or 4-byte elements, got {x.dtype}{list(x.shape)}")
    name = native_attention.transpose_target(native_attention.load(isa))
    return jax.ffi.ffi_call(name, jax.ShapeDtypeStruct(x.shape[::-1], x.dtype), vmap_method="sequential")(x)


_sgemm_set: set[str] = set()


def gemm(a: jax.Array, b: jax.Array, trans_a: bool = False, trans_b: bool = False, isa: str | None = None) -> jax.Array:
    """``op(a) @ op(b)`` of 2-D float32 arrays by the native library's product with oneMKL's
    sgemm (:mod:`~lm_pipeline.kernels.cpu.blas`): ``op(a)`` is ``a [M, K]`` or, with ``trans_a``,
    ``a [K, M]`` transposed; ``op(b)`` is ``b [K, N]`` or, with ``trans_b``, ``b [N, K]``
    transposed. Raises :class:`~lm_pipeline.kernels.cpu.blas.BlasUnavailable` or
    :class:`~lm_pipeline.kernels.cpu.native_attention.NativeAttentionUnavailable` where it cannot
    run. No gradient: :func:`matmul` and :func:`lm_logits` call it in their own rules."""
    from lm_pipeline.kernels.cpu import blas, native_attention

    if a.ndim != 2 or b.ndim != 2 or a.dtype != jnp.float32 or b.dtype != jnp.float32:
        raise ValueError(f"gemm: two 2-D float32 arrays, got {a.dtype}{list(a.shape)} and {b.dtype}{list(b.shape)}")
    m, k = a.shape[::-1] if trans_a else a.shape
    kb, n = b.shape[::-1] if trans_b else b.shape
    if k != kb:
        raise ValueError(f"gemm: op(a) is [{m}, {k}] and op(b) [{kb}, {n}]")
    level = native_attention.load(isa)
    if level not in _sgemm_set:
        native_attention.library(level).LmpSetSgemm(ctypes.c_void_p(blas.sgemm_address()))
        _sgemm_set.add(level)
    return jax.ffi.ffi_call(native_attention.gemm_target(level), jax.ShapeDtypeStruct((m, n), jnp.float32),
                            vmap_method="sequential")(a, b, trans_a=trans_a, trans_b=trans_b)


def dense(x: jax.Array, w: jax.Array, operands=None, native: bool = False, blas: bool = False) -> jax.Array:
    """A projection ``x [..., K] @ w [K, N]`` through :func:`matmul` (``operands``: its operand
    dtype; ``native``: :func:`xt_g`'s; ``blas``: :func:`matmul`'s), its output named
    :data:`DENSE_OUT` for the remat policy."""
    return checkpoint_name(matmul(x, w, operands, native, blas), DENSE_OUT)


@jax.custom_vjp
def add_bias(y: jax.Array, b: jax.Array) -> jax.Array:
    """``y [..., *b.shape] + b`` for a bf16/f16 ``y``, its bias gradient summed in float32.

    Autodiff writes the bias gradient as a reduction of the bf16 cotangent over the leading axes;
    XLA:CPU computes it as a float32 tree of 32-element windows (``reduce-window``, a slow
    single-threaded loop that took a fifth of a bf16 step) and rounds the sum to bf16. Here the
    cotangent is converted to float32 and reduced as a plain float32 sum, which XLA:CPU
    vectorises, and rounded once to the bias's dtype.
    """
    return y + b.astype(y.dtype)


def _add_bias_fwd(y, b):
    return add_bias(y, b), b


def _add_bias_bwd(b, g):
    axes = tuple(range(g.ndim - b.ndim))
    return g, g.astype(jnp.float32).sum(axes).astype(b.dtype)


add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


def lm_logits(x: jax.Array, w: jax.Array, operands=None, native: bool = False, blas: bool = False) -> jax.Array:
    """Logits ``x [B, T, D] @ w [V, D]ᵀ -> [B, T, V]``. The weight gradient is computed as
    ``(xᵀ g)ᵀ``: ``g``, the largest array of a small model's step, is read as it lies and only
    the ``[D, V]`` result is transposed. ``operands``: as :func:`matmul`'s. ``native``: the
    weight gradient is ``T(g) @ x`` straight into ``[V, D]`` (:func:`head_grad`). ``blas``:
    float32 products by :func:`gemm`, ``w`` and ``g`` read in place."""
    if native or blas:
        return _native_logits(x, w, operands, blas)
    return matmul(x, w.T, operands, native)


def head_grad(x: jax.Array, g: jax.Array) -> jax.Array:
    """An LM head's weight gradient ``g [M, V]ᵀ @ x [M, D] -> [V, D]`` with ``g`` transposed by
    the native library. Nothing transposes the product's result afterwards: XLA would fold that
    transpose into the dot, a form only Eigen takes, and Eigen has no bf16 x bf16 -> f32 product."""
    return jnp.matmul(transpose(g), x, preferred_element_type=_accumulation(x, g))


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _native_logits(x: jax.Array, w: jax.Array, operands=None, blas: bool = False) -> jax.Array:
    xi, wi = round_to(x, operands), round_to(w, operands)
    if uses_blas(blas, xi, wi):
        return blas_nt(xi, wi)
    return _einsum("...d,vd->...v", xi, wi, jnp.result_type(x, w))


def _native_logits_fwd(x, w, operands, blas):
    return _native_logits(x, w, operands, blas), (x, w)


def _native_logits_bwd(operands, blas, res, g):
    x, w = res
    gl, xi, wi = round_to(g, operands), round_to(x, operands), round_to(w, operands)
    x2, g2 = xi.reshape(-1, x.shape[-1]), gl.reshape(-1, g.shape[-1])
    if uses_blas(blas, gl, xi, wi):
        return blas_nn(gl, wi).astype(x.dtype), gemm(g2, x2, trans_a=True).astype(w.dtype)
    dx = _einsum("...v,vd->...d", gl, wi, x.dtype)
    dw = head_grad(x2, g2)
    return dx, dw.astype(w.dtype)


_native_logits.defvjp(_native_logits_fwd, _native_logits_bwd)


def matmuls_and_attention_saveable() -> Callable[..., bool]:
    """Remat policy: keep every matmul output, the projections' outputs (:data:`DENSE_OUT`) and
    the attention kernels' residuals (their output and log-sum-exp); recompute the elementwise
    work between them. Without the names, those forward products would run again in the
    backward pass."""
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_saveable,
        jax.checkpoint_policies.save_only_these_names(*ATTENTION_RESIDUALS, DENSE_OUT),
    )
