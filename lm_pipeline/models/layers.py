"""Building blocks shared by the model families: norms, MLP, attention, rotary, layer scan.

Conventions:

* Activations are ``[batch, seq, ...]``; attention tensors are ``[B, T, heads, head_dim]``.
* Weights are stored ``[in, out]`` with the head axes kept separate (``q_proj: [D, N, H]``,
  ``o_proj: [N, H, D]``) so that ``heads`` can be sharded without reshapes.
* Each module lists the logical axes of its own array fields in ``AXES``; :func:`~lm_pipeline.models.params.logical_axes`
  turns a whole model into the ``PartitionSpec`` tree of :meth:`LmModel.param_axes`, adding
  ``layers`` in front of everything under a ``blocks`` field (the stacked transformer blocks).
* Computation stays in the parameters' dtype; norms and the softmax run in float32 and cast
  back.
* How projections, attention and the layer loop compute is the caller's
  :class:`~lm_pipeline.compute.ComputePlan`, passed explicitly (``plan=``); nothing here asks
  which backend it runs on.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from lm_pipeline.compute import REFERENCE, ComputePlan
from lm_pipeline.models.params import logical_axes, named_params, replace_params  # noqa: F401 (re-exported)

F32 = jnp.float32

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
    """Llama's RMSNorm (as HF: normalise in f32, cast back, then scale). ``use_weight=False``: no
    scale (the weight is kept, unused, at ones, so the parameter tree and exports are unchanged)."""

    weight: jax.Array  # [D]
    eps: float = eqx.field(static=True)
    use_weight: bool = eqx.field(static=True)
    AXES: ClassVar[dict[str, tuple]] = {"weight": ("embed",)}

    def __init__(self, dim: int, eps: float, use_weight: bool = True):
        self.weight = jnp.ones((dim,), F32)
        self.eps = eps
        self.use_weight = use_weight

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(F32)
        y = (xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + self.eps)).astype(x.dtype)
        return (self.weight * y).astype(x.dtype) if self.use_weight else y


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

    def __call__(self, x: jax.Array, plan: ComputePlan = REFERENCE) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        h = _linear(x, self.up_proj, self.up_bias, plan)
        if self.gate_proj is not None:
            h = act(_linear(x, self.gate_proj, self.gate_bias, plan)) * h
        else:
            h = act(h)
        return _linear(h, self.down_proj, self.down_bias, plan)


def _linear(x: jax.Array, w: jax.Array, b: jax.Array | None, plan: ComputePlan) -> jax.Array:
    return plan.add_bias(plan.dense(x, w), b)


# ----------------------------------------------------------------------------- attention


class KVCache(eqx.Module):
    """Keys and values of all layers for incremental decoding: ``[layers, B, max_len, K, H]``
    stacked, or a :class:`PerLayer` of ``[B, max_len, K, H]`` arrays for a model whose blocks
    are unstacked (:func:`unstack_layers`)."""

    k: Any
    v: Any

    @classmethod
    def zeros(cls, layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype: Any,
              *, per_layer: bool = False):
        if per_layer:
            shape = (batch, max_len, kv_heads, head_dim)
            return cls(PerLayer(jnp.zeros(shape, dtype) for _ in range(layers)),
                       PerLayer(jnp.zeros(shape, dtype) for _ in range(layers)))
        shape = (layers, batch, max_len, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]  # layer 0's [B, max_len, K, H], stacked or not


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
        plan: ComputePlan = REFERENCE,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """x [B, T, D] -> ([B, T, D], updated kv).

        mask: see :func:`attention`. rope: (cos, sin) from :func:`rotary_cos_sin`.
        kv: one layer's cache ``([B, L, K, H], [B, L, K, H])``; the new keys/values are written at
        ``position`` and attention runs over the whole cache (``mask`` must hide the future).
        """
        q = _proj(x, self.q_proj, self.q_bias, plan)
        k = _proj(x, self.k_proj, self.k_bias, plan)
        v = _proj(x, self.v_proj, self.v_bias, plan)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if kv is not None:
            ck = jax.lax.dynamic_update_slice_in_dim(kv[0], k.astype(kv[0].dtype), position, axis=1)
            cv = jax.lax.dynamic_update_slice_in_dim(kv[1], v.astype(kv[1].dtype), position, axis=1)
            kv = (ck, cv)
            k, v = ck.astype(q.dtype), cv.astype(q.dtype)
        o = attention(
            q, k, v, mask, scale=scale, upcast=upcast, dropout_rate=dropout_rate, key=key, causal=kv is None, plan=plan
        )
        n, h, d = self.o_proj.shape
        y = plan.dense(o.reshape(*o.shape[:-2], n * h), self.o_proj.reshape(n * h, d))
        return plan.add_bias(y, self.o_bias), kv


def _proj(x: jax.Array, w: jax.Array, b: jax.Array | None, plan: ComputePlan) -> jax.Array:
    d, n, h = w.shape
    y = plan.dense(x, w.reshape(d, n * h)).reshape(*x.shape[:-1], n, h)
    return plan.add_bias(y, b)


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
    plan: ComputePlan = REFERENCE,
) -> jax.Array:
    """Scaled dot-product attention. q [B, T, N, H], k/v [B, S, K, H] -> [B, T, N, H].

    mask: None for plain causal attention (T == S), else a boolean array broadcastable to
    [B, 1, T, S], True where a query may attend. Every query row should allow at least one key
    (see :func:`segment_mask`). ``causal`` says that the mask (if any) is itself causal
    self-attention (T == S), as :func:`segment_mask` is.

    With attention dropout, the explicit :func:`softmax_attention`; causal self-attention as
    ``plan`` computes it (:meth:`~lm_pipeline.compute.ComputePlan.causal_attention`); anything
    else (the decode step's cache mask) ``jax.nn.dot_product_attention``. Same values either way.
    ``upcast`` runs the whole computation in float32.
    """
    dtype = q.dtype
    if upcast or (dtype == jnp.float16 and plan.f16_attention_in_f32):
        q, k, v = q.astype(F32), k.astype(F32), v.astype(F32)
    if dropout_rate > 0.0 and key is not None:
        out = softmax_attention(q, k, v, mask, scale=scale, dropout_rate=dropout_rate, key=key)
    elif (causal or mask is None) and q.shape[1] == k.shape[1]:
        out = plan.causal_attention(q, k, v, mask, scale)
    else:
        out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=mask is None, scale=scale)
    return out.astype(dtype)


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


def rotary_cos_sin(positions: jax.Array, head_dim: int, theta: float,
                   scaling: Any = None) -> tuple[jax.Array, jax.Array]:
    """positions int [..., T] -> (cos, sin) f32 [..., T, head_dim], HF Llama's rope: the default one,
    or scaled as ``scaling`` (a :class:`~lm_pipeline.models.config.RopeScaling`) says
    (:func:`~lm_pipeline.models.rope.rope_frequencies`)."""
    from lm_pipeline.models.rope import rope_frequencies

    if scaling is None:
        inv_freq, factor = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=F32) / head_dim)), 1.0
    else:
        inv_freq, factor = rope_frequencies(head_dim, theta, scaling)
    freqs = positions[..., None].astype(F32) * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if factor == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * factor, jnp.sin(emb) * factor


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, H]; cos/sin [B or 1, T, H]. HF's ``rotate_half`` convention (split halves)."""
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


# ----------------------------------------------------------------------------- layer scan


class PerLayer(tuple):
    """One entry per layer, where stacked arrays would have a leading ``layers`` axis: the blocks
    of an unstacked model, its per-layer cache buffers. A pytree node like a tuple."""


jax.tree_util.register_pytree_node(PerLayer, lambda t: (tuple(t), None), lambda _, children: PerLayer(children))


def layer_slice(tree: Any, i: int) -> Any:
    """Layer ``i`` of per-layer inputs: entry ``i`` of each :class:`PerLayer`, row ``i`` of each
    stacked array."""
    return jax.tree.map(lambda a: a[i], tree, is_leaf=lambda n: isinstance(n, PerLayer))


def unstack_layers(model: eqx.Module) -> eqx.Module:
    """``model`` with its stacked ``blocks`` split into a :class:`PerLayer` of per-layer blocks.

    Same values; :func:`scan_blocks` then applies the layers one by one over separate arrays. For
    a decode loop: inside ``lax.while_loop`` a scan would slice every layer's weights out of the
    stacked arrays at every step, roughly tripling the memory traffic of batch-1 decoding; split
    once before the loop, the weights are read in place.
    """
    params, static = eqx.partition(model.blocks, eqx.is_array)
    n = jax.tree.leaves(params)[0].shape[0]
    blocks = PerLayer(eqx.combine(jax.tree.map(lambda x, i=i: x[i], params), static) for i in range(n))
    return eqx.tree_at(lambda m: m.blocks, model, blocks)


def stack_blocks(make: Callable[[jax.Array], eqx.Module], num_layers: int, key: jax.Array) -> Any:
    """Build ``num_layers`` blocks with their arrays stacked on a leading ``layers`` axis."""
    return eqx.filter_vmap(make)(jax.random.split(key, num_layers))


def scan_blocks(
    apply: Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]],
    blocks: Any,
    x: jax.Array,
    xs: Any,
    *,
    checkpoint: bool,
    plan: ComputePlan = REFERENCE,
) -> tuple[jax.Array, Any]:
    """``x = apply(block_i, x, xs[i])`` for each stacked block, with ``jax.lax.scan``.

    ``blocks`` may be a :class:`PerLayer` of unstacked blocks (:func:`unstack_layers`): the layers
    are then applied one by one and the ``y`` come back as :class:`PerLayer` leaves.

    ``apply`` returns ``(x, y)``; the ``y`` are stacked. With ``checkpoint`` each layer is
    rematerialised in the backward pass, saving only the residual stream between layers
    (policy ``nothing_saveable``: activation memory O(layers x B x T x D)). Otherwise the plan's
    remat policy, if any, wraps each layer, and without one the plan says whether the stack is
    unrolled (same results; see :class:`~lm_pipeline.compute.ComputePlan`); a rematerialised stack
    is unrolled only when the plan says so (Levanter's ``scan_layers: false``).
    """
    policy = plan.remat_policy()
    if checkpoint:
        policy = jax.checkpoint_policies.nothing_saveable
    if isinstance(blocks, PerLayer):  # unstacked (see unstack_layers): one layer after another
        layer = apply if policy is None else jax.checkpoint(apply, policy=policy, prevent_cse=False)
        ys = []
        for i, block in enumerate(blocks):
            x, y = layer(block, x, layer_slice(xs, i))
            ys.append(y)
        return x, jax.tree.map(lambda *per: PerLayer(per), *ys)

    params, static = eqx.partition(blocks, eqx.is_array)
    leaves = jax.tree.leaves(params)
    num_layers = leaves[0].shape[0] if leaves else 0

    def body(h, inputs):
        p, extra = inputs
        return apply(eqx.combine(p, static), h, extra)

    if policy is not None:
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
        unroll = plan.unroll_rematerialized(num_layers)
    else:
        unroll = plan.unroll(num_layers)
    return jax.lax.scan(body, x, (params, xs), unroll=unroll)
