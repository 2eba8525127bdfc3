"""Building blocks shared by the model families: norms, MLP, attention, rotary, layer scan.

Conventions:

* Activations are ``[batch, seq, ...]``; attention tensors are ``[B, T, heads, head_dim]``.
* Weights are stored ``[in, out]`` with the head axes kept separate (``q_proj: [D, N, H]``,
  ``o_proj: [N, H, D]``) so that ``heads`` can be sharded without reshapes.
* Each module lists the logical axes of its own array fields in ``AXES``; :func:`logical_axes`
  turns a whole model into the ``PartitionSpec`` tree of :meth:`LmModel.param_axes`, adding
  ``layers`` in front of everything under a ``blocks`` field (the stacked transformer blocks).
* Computation stays in the parameters' dtype; norms and the softmax run in float32 and cast
  back.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from lm_pipeline.models import native_attention
from lm_pipeline.models.blocked_attention import (
    ATTENTION_RESIDUALS,
    blocked_causal_attention,
    num_query_blocks,
)

F32 = jnp.float32
_log = logging.getLogger(__name__)

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": partial(jax.nn.gelu, approximate=False),  # HF "gelu": exact erf form
    "gelu_new": partial(jax.nn.gelu, approximate=True),  # HF "gelu_new": tanh approximation
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


def normal(key: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
    return std * jax.random.normal(key, shape, F32)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; the identity when ``rate == 0`` or ``key is None``."""
    if rate == 0.0 or key is None:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


# ----------------------------------------------------------------------------- norms


class LayerNorm(eqx.Module):
    weight: jax.Array  # [D]
    bias: jax.Array | None  # [D]
    eps: float = eqx.field(static=True)
    AXES: ClassVar[dict[str, tuple]] = {"weight": ("embed",), "bias": ("embed",)}

    def __init__(self, dim: int, eps: float, use_bias: bool = True):
        self.weight = jnp.ones((dim,), F32)
        self.bias = jnp.zeros((dim,), F32) if use_bias else None
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(F32)
        mean = xf.mean(-1, keepdims=True)
        var = jnp.square(xf - mean).mean(-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps) * self.weight.astype(F32)
        if self.bias is not None:
            y = y + self.bias.astype(F32)
        return y.astype(x.dtype)


class RmsNorm(eqx.Module):
    """Llama's RMSNorm (as HF: normalise in f32, cast back, then scale)."""

    weight: jax.Array  # [D]
    eps: float = eqx.field(static=True)
    AXES: ClassVar[dict[str, tuple]] = {"weight": ("embed",)}

    def __init__(self, dim: int, eps: float):
        self.weight = jnp.ones((dim,), F32)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(F32)
        y = xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + self.eps)
        return (self.weight * y.astype(x.dtype)).astype(x.dtype)


# ----------------------------------------------------------------------------- MLP


class Mlp(eqx.Module):
    """``down(act(x @ up))``, or the gated form ``down(act(x @ gate) * (x @ up))`` (SwiGLU)."""

    up_proj: jax.Array  # [D, M]
    up_bias: jax.Array | None  # [M]
    gate_proj: jax.Array | None  # [D, M]
    gate_bias: jax.Array | None  # [M]
    down_proj: jax.Array  # [M, D]
    down_bias: jax.Array | None  # [D]
    activation: str = eqx.field(static=True)
    AXES: ClassVar[dict[str, tuple]] = {
        "up_proj": ("embed", "mlp"),
        "up_bias": ("mlp",),
        "gate_proj": ("embed", "mlp"),
        "gate_bias": ("mlp",),
        "down_proj": ("mlp", "embed"),
        "down_bias": ("embed",),
    }

    def __init__(
        self, dim: int, hidden: int, *, activation: str, gated: bool, use_bias: bool,
        std: float, out_std: float, key: jax.Array,
    ):
        k_up, k_gate, k_down = jax.random.split(key, 3)
        self.up_proj = normal(k_up, (dim, hidden), std)
        self.gate_proj = normal(k_gate, (dim, hidden), std) if gated else None
        self.down_proj = normal(k_down, (hidden, dim), out_std)
        self.up_bias = jnp.zeros((hidden,), F32) if use_bias else None
        self.gate_bias = jnp.zeros((hidden,), F32) if use_bias and gated else None
        self.down_bias = jnp.zeros((dim,), F32) if use_bias else None
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        h = _linear(x, self.up_proj, self.up_bias)
        if self.gate_proj is not None:
            h = act(_linear(x, self.gate_proj, self.gate_bias)) * h
        else:
            h = act(h)
        return _linear(h, self.down_proj, self.down_bias)


def _linear(x: jax.Array, w: jax.Array, b: jax.Array | None) -> jax.Array:
    y = dense(x, w)
    return y if b is None else y + b


DENSE_OUT = "dense_out"


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [..., K] @ w [K, N] -> [..., N]``, the projections of attention and the MLP.

    On the CPU backend through :func:`_matmul` (same values, a different weight-gradient
    layout) with its output named :data:`DENSE_OUT` for the remat policy; elsewhere a plain
    einsum.
    """
    if jax.default_backend() != "cpu":
        return jnp.einsum("...k,kn->...n", x, w)
    return checkpoint_name(_matmul(x, w), DENSE_OUT)


@jax.custom_vjp
def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` whose weight gradient ``xᵀ g`` goes through :func:`_xt_g` (on the CPU backend:
    an explicitly transposed operand). The CPU projections and, on every backend, the LM head.

    Autodiff's ``dW = einsum("mk,mn->kn", x, g)`` contracts both operands over their leading
    axis; XLA:CPU gives that form to Eigen (88–133 GFLOP/s on this project's shapes, against
    140–180 for the same matmul as ``[K, M] @ [M, N]``, which YNNPACK takes). :func:`_xt_g`
    transposes an operand into its own buffer first: an MLP's forward + backward measured 1.3x
    faster (``docs/benchmarks.md``).
    """
    return jnp.einsum("...k,kn->...n", x, w)


def _matmul_fwd(x, w):
    return _matmul(x, w), (x, w)


def _matmul_bwd(res, g):
    x, w = res
    dx = jnp.einsum("...n,kn->...k", g, w)
    dw = _xt_g(x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1]))
    return dx.astype(x.dtype), dw.astype(w.dtype)


def _xt_g(x: jax.Array, g: jax.Array) -> jax.Array:
    """The weight gradient ``x [M, K]ᵀ @ g [M, N] -> [K, N]``.

    On the CPU backend the smaller of the two operands is transposed into its own buffer first
    (an optimisation barrier keeps XLA from folding the transpose back into the dot), so the
    product is a plain ``[K, M] @ [M, N]`` (or ``([N, M] @ [M, K])ᵀ``) that YNNPACK computes;
    the smaller one because XLA:CPU's transpose is a slow single-threaded loop. Elsewhere the
    einsum as autodiff writes it.
    """
    if jax.default_backend() != "cpu":
        return jnp.einsum("mk,mn->kn", x, g)
    if x.shape[1] <= g.shape[1]:
        return jax.lax.optimization_barrier(x.T) @ g
    return (jax.lax.optimization_barrier(g.T) @ x).T


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


# ----------------------------------------------------------------------------- LM head


VOCAB_PAD_MULTIPLE = 128
"""On accelerators the LM head computes with its vocabulary padded to a multiple of this (zero
rows, logits sliced back): cuBLAS picks slow kernels for odd widths such as GPT-2's 50257."""


def lm_logits(x: jax.Array, w: jax.Array) -> jax.Array:
    """Logits ``x [B, T, D] @ w[V, D]^T -> [B, T, V]`` (``einsum("btd,vd->btv")``).

    Same values as the einsum; only the backward pass is written by hand. Autodiff computes
    ``dW = g^T x`` with the contraction over ``g``'s leading (batch x time) axes, and XLA:CPU then
    writes a transposed copy of ``g``, the largest array of a small model's step, before the dot.
    ``dW = (x^T g)^T`` reads ``g`` as it lies and transposes only the ``[D, V]`` result
    (``bench/train_throughput.py``: about 1.1x on a 4-layer, width-128, 8k-vocab GPT-2 step).
    That product goes through :func:`_xt_g`, which on the CPU backend materialises ``x^T`` so
    that YNNPACK rather than Eigen computes it (1.05x on the 6-layer, width-384 step).

    Off the CPU, a vocabulary that is not a multiple of :data:`VOCAB_PAD_MULTIPLE` is padded
    with zero rows for the product and the logits sliced back (XLA fuses both into their
    neighbours); same values.
    """
    on_cpu = jax.default_backend() == "cpu"
    return _padded_lm_logits(x, w, 0 if on_cpu or VOCAB_PAD_MULTIPLE <= 1 else -w.shape[0] % VOCAB_PAD_MULTIPLE)


def _padded_lm_logits(x: jax.Array, w: jax.Array, pad: int) -> jax.Array:
    """:func:`lm_logits` computed with ``pad`` zero rows appended to ``w`` (sliced off again)."""
    wp = w if pad == 0 else jnp.pad(w, ((0, pad), (0, 0)))
    logits = _matmul(x, wp.T)  # dW = (xᵀ g)ᵀ: autodiff transposes only the [D, V] result
    return logits if pad == 0 else logits[..., : w.shape[0]]


# ----------------------------------------------------------------------------- attention


class KVCache(eqx.Module):
    """Keys and values of all layers for incremental decoding: ``[layers, B, max_len, K, H]``."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype: Any):
        shape = (layers, batch, max_len, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


class Attention(eqx.Module):
    """Multi-head self attention with grouped k/v heads (``kv_heads`` divides ``heads``)."""

    q_proj: jax.Array  # [D, N, H]
    k_proj: jax.Array  # [D, K, H]
    v_proj: jax.Array  # [D, K, H]
    o_proj: jax.Array  # [N, H, D]
    q_bias: jax.Array | None  # [N, H]
    k_bias: jax.Array | None  # [K, H]
    v_bias: jax.Array | None  # [K, H]
    o_bias: jax.Array | None  # [D]
    AXES: ClassVar[dict[str, tuple]] = {
        "q_proj": ("embed", "heads", "head_dim"),
        "k_proj": ("embed", "kv_heads", "head_dim"),
        "v_proj": ("embed", "kv_heads", "head_dim"),
        "o_proj": ("heads", "head_dim", "embed"),
        "q_bias": ("heads", "head_dim"),
        "k_bias": ("kv_heads", "head_dim"),
        "v_bias": ("kv_heads", "head_dim"),
        "o_bias": ("embed",),
    }

    def __init__(
        self, dim: int, heads: int, kv_heads: int, head_dim: int, *, use_bias: bool,
        std: float, out_std: float, key: jax.Array,
    ):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.q_proj = normal(kq, (dim, heads, head_dim), std)
        self.k_proj = normal(kk, (dim, kv_heads, head_dim), std)
        self.v_proj = normal(kv, (dim, kv_heads, head_dim), std)
        self.o_proj = normal(ko, (heads, head_dim, dim), out_std)
        self.q_bias = jnp.zeros((heads, head_dim), F32) if use_bias else None
        self.k_bias = jnp.zeros((kv_heads, head_dim), F32) if use_bias else None
        self.v_bias = jnp.zeros((kv_heads, head_dim), F32) if use_bias else None
        self.o_bias = jnp.zeros((dim,), F32) if use_bias else None

    def __call__(
        self,
        x: jax.Array,
        mask: jax.Array | None,
        *,
        scale: float | jax.Array,
        upcast: bool = False,
        rope: tuple[jax.Array, jax.Array] | None = None,
        kv: tuple[jax.Array, jax.Array] | None = None,
        position: jax.Array | int = 0,
        dropout_rate: float = 0.0,
        key: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """x [B, T, D] -> ([B, T, D], updated kv).

        mask: see :func:`attention`. rope: (cos, sin) from :func:`rotary_cos_sin`.
        kv: one layer's cache ``([B, L, K, H], [B, L, K, H])``; the new keys/values are written at
        ``position`` and attention runs over the whole cache (``mask`` must hide the future).
        """
        q = _proj(x, self.q_proj, self.q_bias)
        k = _proj(x, self.k_proj, self.k_bias)
        v = _proj(x, self.v_proj, self.v_bias)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if kv is not None:
            ck = jax.lax.dynamic_update_slice_in_dim(kv[0], k.astype(kv[0].dtype), position, axis=1)
            cv = jax.lax.dynamic_update_slice_in_dim(kv[1], v.astype(kv[1].dtype), position, axis=1)
            kv = (ck, cv)
            k, v = ck.astype(q.dtype), cv.astype(q.dtype)
        o = attention(
            q, k, v, mask, scale=scale, upcast=upcast, dropout_rate=dropout_rate, key=key, causal=kv is None
        )
        n, h, d = self.o_proj.shape
        y = dense(o.reshape(*o.shape[:-2], n * h), self.o_proj.reshape(n * h, d))
        if self.o_bias is not None:
            y = y + self.o_bias
        return y, kv


def _proj(x: jax.Array, w: jax.Array, b: jax.Array | None) -> jax.Array:
    d, n, h = w.shape
    y = dense(x, w.reshape(d, n * h)).reshape(*x.shape[:-1], n, h)
    return y if b is None else y + b


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    *,
    scale: float | jax.Array,
    upcast: bool = False,
    dropout_rate: float = 0.0,
    key: jax.Array | None = None,
    causal: bool = False,
) -> jax.Array:
    """Scaled dot-product attention. q [B, T, N, H], k/v [B, S, K, H] -> [B, T, N, H].

    mask: None for plain causal attention (T == S), else a boolean array broadcastable to
    [B, 1, T, S], True where a query may attend. Every query row should allow at least one key
    (see :func:`segment_mask`). ``causal`` says that the mask (if any) is itself causal
    self-attention (T == S), as :func:`segment_mask` is.

    Implementations, same values: with attention dropout, an explicit softmax path that drops
    probabilities; plain causal self-attention in float32 on a single CPU device, the native
    kernel of :mod:`lm_pipeline.models.native_attention` where it builds; other causal
    self-attention on the CPU backend,
    :func:`lm_pipeline.models.blocked_attention.blocked_causal_attention` (skips the masked
    upper triangle, flash-style backward pass); plain causal self-attention on a GPU in
    bf16/f16, cuDNN's fused flash attention (see :func:`attention_implementation`); otherwise
    ``jax.nn.dot_product_attention``'s XLA path. ``upcast`` runs the whole computation in
    float32.
    """
    dtype = q.dtype
    # XLA:CPU has no f16 x f16 -> f32 dot, which attention's logits need: compute it in f32 there.
    if upcast or (dtype == jnp.float16 and jax.default_backend() == "cpu"):
        q, k, v = q.astype(F32), k.astype(F32), v.astype(F32)
    if dropout_rate > 0.0 and key is not None:
        out = softmax_attention(q, k, v, mask, scale=scale, dropout_rate=dropout_rate, key=key)
    elif mask is None and _use_native(q, k, v):
        out = native_attention.native_causal_attention(q, k, v, scale)
    elif _use_blocked(q, k, mask, causal):
        out = blocked_causal_attention(q, k, v, mask, scale)
    elif mask is None and _use_cudnn(q, k, jax.default_backend()):
        out = _cudnn_causal_attention(q, k, v, scale)
    else:
        out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=mask is None, scale=scale)
    return out.astype(dtype)


ATTENTION_ENV = "LM_PIPELINE_ATTENTION"
_ATTENTION_CHOICES = ("auto", "xla", "cudnn", "native")
_attention_choice: contextvars.ContextVar[str | None] = contextvars.ContextVar("attention_choice", default=None)


@contextlib.contextmanager
def attention_implementation(choice: str) -> Iterator[None]:
    """While tracing inside this context, plain causal attention uses ``choice``: ``auto`` (the
    default: on a GPU cuDNN's fused flash attention where it applies, on a single CPU device
    in float32 the native kernel of :mod:`lm_pipeline.models.native_attention` where it
    builds, else XLA), ``xla`` (XLA's path: ``jax.nn.dot_product_attention`` on a GPU, the
    blocked attention on the CPU), ``cudnn`` or ``native`` (that kernel, failing loudly where
    it does not apply). Same values either way; only speed and memory differ. Without a
    context, ``$LM_PIPELINE_ATTENTION`` gives the choice (``auto`` when unset)."""
    if choice not in _ATTENTION_CHOICES:
        raise ValueError(f"attention implementation must be one of {_ATTENTION_CHOICES}, got {choice!r}")
    token = _attention_choice.set(choice)
    try:
        yield
    finally:
        _attention_choice.reset(token)


def _attention_choice_now() -> str:
    choice = _attention_choice.get()
    if choice is None:
        choice = os.environ.get(ATTENTION_ENV, "").strip().lower() or "auto"
        if choice not in _ATTENTION_CHOICES:
            raise ValueError(f"${ATTENTION_ENV} must be one of {_ATTENTION_CHOICES}, got {choice!r}")
    return choice


def _use_cudnn(q: jax.Array, k: jax.Array, backend: str) -> bool:
    """cuDNN's flash attention takes causal self-attention on a GPU in bf16/f16 with a head size
    that is a multiple of 8 up to 128 (what cuDNN 9's fused kernels cover on Ampere and Hopper)."""
    choice = _attention_choice_now()
    if choice == "xla" or backend != "gpu":
        return False
    if choice == "cudnn":
        return True
    head = q.shape[-1]
    return (
        q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[1] == k.shape[1]
        and head % 8 == 0 and head <= 128
    )


def _cudnn_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float | jax.Array) -> jax.Array:
    """Causal attention through cuDNN; under ``auto``, XLA's path where this JAX/cuDNN refuses."""
    try:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale, implementation="cudnn")
    except (NotImplementedError, RuntimeError, ValueError) as err:
        if _attention_choice_now() == "cudnn":
            raise
        _log.warning("cuDNN attention unavailable (%s); using XLA's attention", err)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale)


def _use_native(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
    """Plain causal self-attention in float32 on a process with one CPU device takes the native
    kernel (``auto``: where it builds). Several devices keep XLA's path, which the SPMD
    partitioner shards; the kernel is one opaque custom call."""
    choice = _attention_choice_now()
    if choice in ("xla", "cudnn") or jax.default_backend() != "cpu":
        return False
    applies = (
        q.dtype == F32 and k.dtype == F32 and v.dtype == F32 and q.ndim == 4
        and q.shape[1] == k.shape[1] and jax.device_count() == 1
    )
    if choice == "native":
        if not applies:
            raise ValueError(
                f"{ATTENTION_ENV}=native: the native kernel takes float32 causal self-attention on a single "
                f"CPU device; got q {q.dtype}{tuple(q.shape)}, k {tuple(k.shape)} on {jax.device_count()} devices"
            )
        native_attention.load()  # raises NativeAttentionUnavailable with the reason
        return True
    return applies and native_attention.available()


def _use_blocked(q: jax.Array, k: jax.Array, mask: jax.Array | None, causal: bool) -> bool:
    """Causal self-attention on the CPU backend takes the blocked path, except a single query
    block in a low-precision dtype (nothing to skip; its f32 backward measured 0.95x of XLA's
    bf16 one on the tiny shape of ``bench/train_throughput.py``, while in f32 it measured 1.06x)."""
    if not (causal or mask is None) or q.shape[1] != k.shape[1] or jax.default_backend() != "cpu":
        return False
    return q.dtype == F32 or num_query_blocks(q.shape[1]) > 1


def softmax_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    *,
    scale: float | jax.Array,
    dropout_rate: float = 0.0,
    key: jax.Array | None = None,
) -> jax.Array:
    """The explicit path of :func:`attention` (same arguments), with dropout on the probabilities.

    Query head ``n`` uses k/v head ``n // (N // K)``, as ``jax.nn.dot_product_attention`` and
    HF's ``repeat_kv`` do.
    """
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=F32) * scale
    if mask is None:
        mask = jnp.tril(jnp.ones((t, s), bool))
    else:
        mask = mask[:, :, None]  # [B, 1, 1, T, S]
    logits = jnp.where(mask, logits, -0.7 * jnp.finfo(F32).max)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = dropout(probs, dropout_rate, key).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
    return out.reshape(b, t, n, h)


def segment_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, T] segment ids -> bool [B, 1, T, T]: causal & same segment & not padding.

    Padding queries (id 0) attend to themselves only, so their rows stay finite with any
    attention implementation; no real token ever attends to padding.
    """
    t = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    real = (segment_ids != 0)[:, :, None]
    return ((causal & same & real) | jnp.eye(t, dtype=bool))[:, None]


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """[B, T] -> int32 [B, T]: position of each token within its (contiguous) segment."""
    b, t = segment_ids.shape
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    starts = jnp.concatenate(
        [jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


def decode_mask(position: jax.Array | int, length: int, max_len: int) -> jax.Array:
    """bool [1, 1, length, max_len]: query ``position + i`` sees cache slots ``<= position + i``."""
    q_pos = position + jnp.arange(length)
    return (jnp.arange(max_len)[None, :] <= q_pos[:, None])[None, None]


# ----------------------------------------------------------------------------- rotary


def rotary_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """positions int [..., T] -> (cos, sin) f32 [..., T, head_dim], HF Llama's default rope."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=F32) / head_dim))
    freqs = positions[..., None].astype(F32) * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, H]; cos/sin [B or 1, T, H]. HF's ``rotate_half`` convention (split halves)."""
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


# ----------------------------------------------------------------------------- layer scan


def stack_blocks(make: Callable[[jax.Array], eqx.Module], num_layers: int, key: jax.Array) -> Any:
    """Build ``num_layers`` blocks with their arrays stacked on a leading ``layers`` axis."""
    return eqx.filter_vmap(make)(jax.random.split(key, num_layers))


_LAYER_REMAT_POLICY: contextvars.ContextVar[Callable[..., bool] | None] = contextvars.ContextVar(
    "layer_remat_policy", default=None
)


def matmuls_and_attention_saveable() -> Callable[..., bool]:
    """Remat policy: keep every matmul output, the CPU projections' outputs (:data:`DENSE_OUT`:
    a custom VJP, not a ``dot_general``) and the blocked attention's own residuals (its output
    and log-sum-exp, :data:`~lm_pipeline.models.blocked_attention.ATTENTION_RESIDUALS`);
    recompute the elementwise work between them. Without the names, those forward matmuls
    would run again in the backward pass."""
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_saveable,
        jax.checkpoint_policies.save_only_these_names(*ATTENTION_RESIDUALS, DENSE_OUT),
    )


@contextlib.contextmanager
def layer_remat_policy(policy: Callable[..., bool] | None) -> Iterator[None]:
    """While tracing inside this context, :func:`scan_blocks` calls without ``checkpoint`` wrap
    each layer in ``jax.checkpoint(policy=policy)`` (e.g. ``jax.checkpoint_policies.dots_saveable``:
    keep matmul outputs, recompute the elementwise work between them in the backward pass).

    Values are unchanged; only what is stored for the backward pass. A caller that knows the
    backend (the trainer) sets it; a model called directly never rematerialises unless its
    config asks for gradient checkpointing.
    """
    token = _LAYER_REMAT_POLICY.set(policy)
    try:
        yield
    finally:
        _LAYER_REMAT_POLICY.reset(token)


def scan_blocks(
    apply: Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]],
    blocks: Any,
    x: jax.Array,
    xs: Any,
    *,
    checkpoint: bool,
) -> tuple[jax.Array, Any]:
    """``x = apply(block_i, x, xs[i])`` for each stacked block, with ``jax.lax.scan``.

    ``apply`` returns ``(x, y)``; the ``y`` are stacked. With ``checkpoint`` each layer is
    rematerialised in the backward pass, saving only the residual stream between layers
    (policy ``nothing_saveable``: activation memory O(layers x B x T x D)).

    Without ``checkpoint``, on the CPU backend, stacks of at most :data:`UNROLL_MAX_LAYERS`
    layers computing in a low-precision dtype (bf16) are unrolled (same results): XLA:CPU
    computes bf16 elementwise ops in f32, so in a scan every residual saved for the backward
    pass goes through an f32 -> bf16 convert into its stacked buffer and back; unrolled, those
    converts fuse into their consumers (1.2x on the 4- and 6-layer bf16 GPT-2 steps of
    ``bench/train_throughput.py``, see ``docs/benchmarks.md``). In f32 unrolling measured no
    better than the scan (the trainer saves only matmul outputs there instead, through
    :func:`layer_remat_policy`, which takes precedence over unrolling).
    On other backends (GPU, TPU), stacks of at most :data:`ACCELERATOR_UNROLL_MAX_LAYERS`
    layers are unrolled when not checkpointed. With checkpointing the scan stays: only the block
    inputs are stacked then, and unrolling (with ``prevent_cse``) measured the same step time on
    an H100 with a 3-6x longer compile.
    """
    params, static = eqx.partition(blocks, eqx.is_array)
    leaves = jax.tree.leaves(params)
    num_layers = leaves[0].shape[0] if leaves else 0

    def body(h, inputs):
        p, extra = inputs
        return apply(eqx.combine(p, static), h, extra)

    unroll: bool | int = 1
    policy = _LAYER_REMAT_POLICY.get()
    if checkpoint:
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)
    elif policy is not None:
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    else:
        unroll = _unroll_plain_stack(jax.default_backend(), x.dtype, num_layers)
    return jax.lax.scan(body, x, (params, xs), unroll=unroll)


def _unroll_plain_stack(backend: str, dtype: Any, num_layers: int) -> bool:
    """Whether :func:`scan_blocks` unrolls a stack that is neither checkpointed nor under a policy."""
    if backend == "cpu":
        return dtype != jnp.float32 and num_layers <= UNROLL_MAX_LAYERS
    return num_layers <= ACCELERATOR_UNROLL_MAX_LAYERS


UNROLL_MAX_LAYERS = 8
ACCELERATOR_UNROLL_MAX_LAYERS = 48
"""Without checkpointing, a GPU/TPU stack of at most this many layers is unrolled: a scan
slices each layer's parameters out of the stacked arrays and writes each saved activation and
each gradient into stacked buffers, copies that took 20% of a GPT-2 124M step and 30% of a
350M Llama step on an H100 (``bench/gpu_mfu.py``, ``docs/benchmarks.md``)."""


# ----------------------------------------------------------------------------- parameter trees


def _is_param(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _names(path: tuple) -> list[str]:
    names = []
    for entry in path:
        if not isinstance(entry, jax.tree_util.GetAttrKey):
            raise TypeError(f"unexpected pytree path entry {entry!r}: models hold modules and arrays only")
        names.append(entry.name)
    return names


def named_params(model: eqx.Module) -> dict[str, Any]:
    """``{"blocks.attn.q_proj": array, ...}``: every array of ``model`` by its dotted field path."""
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(model, _is_param))[0]
    return {".".join(_names(path)): leaf for path, leaf in leaves}


def replace_params(model: eqx.Module, named: dict[str, Any]) -> eqx.Module:
    """``model`` (or an ``eqx.filter_eval_shape`` skeleton) with every array taken from ``named``."""
    unused = set(named)

    def take(path, leaf):
        if not _is_param(leaf):
            return leaf
        name = ".".join(_names(path))
        if name not in named:
            raise KeyError(f"no value for parameter {name!r}")
        value = jnp.asarray(named[name], dtype=leaf.dtype)
        if value.shape != leaf.shape:
            raise ValueError(f"parameter {name!r}: shape {value.shape}, expected {leaf.shape}")
        unused.discard(name)
        return value

    out = jax.tree_util.tree_map_with_path(take, model)
    if unused:
        raise KeyError(f"values for unknown parameters: {sorted(unused)}")
    return out


def logical_axes(model: eqx.Module) -> Any:
    """The ``PartitionSpec`` tree of ``model``'s arrays, from each owning module's ``AXES``.

    Arrays under a field named ``blocks`` (stacked blocks) get ``layers`` as first axis.
    """

    def spec(path, leaf):
        names = _names(path)
        owner = model
        for name in names[:-1]:
            owner = getattr(owner, name)
        axes = tuple(type(owner).AXES[names[-1]])
        if "blocks" in names[:-1]:
            axes = ("layers", *axes)
        if len(axes) != leaf.ndim:
            raise ValueError(f"{'.'.join(names)}: axes {axes} do not match shape {leaf.shape}")
        return P(*axes)

    return jax.tree_util.tree_map_with_path(spec, eqx.filter(model, _is_param))
