"""Causal self-attention in query blocks, with a hand-written (flash-style) backward pass.

``jax.nn.dot_product_attention`` on the CPU backend is XLA's plain composition: it computes
the whole ``T x S`` score map (the masked upper triangle included), a softmax whose backward
autodiff writes as several passes over that map, and transposes of q/k/v/o around each
matmul (a large share of a small model's CPU step: ``docs/benchmarks.md``). This function
computes the same values with less work:

* **Causal block skipping.** Queries are split into ``n`` blocks; block ``i`` multiplies only
  against the keys it can see (``0 .. end of block i``), so the score work is
  ``(n + 1) / (2n)`` of the full map (62.5% at 4 blocks) and only the diagonal blocks need a
  mask.
* **One layout.** q, k, v are transposed once to ``[B, K, G, T, H]`` / ``[B, K, S, H]`` (K k/v
  heads, G query heads per k/v head) and every matmul reads them as they lie.
* **Flash-attention backward** (Dao et al. 2022): the forward pass keeps only q, k, v, the
  output and the per-row log-sum-exp; the backward pass recomputes each block's
  probabilities with one ``exp`` and gets ``dS = P * (dP - rowsum(dO * O))`` in one pass.

Values and gradients equal ``jax.nn.dot_product_attention``'s up to float rounding
(``tests/test_blocked_attention.py``). Chosen by :class:`lm_pipeline.compute.ComputePlan`
(attention ``cpu_blocked``, and ``cpu_native`` where the native kernel does not apply) for causal
self-attention without dropout on CPU meshes; accelerators keep ``jax.nn.dot_product_attention``.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

F32 = jnp.float32
ATTENTION_RESIDUALS = ("attention_out", "attention_lse")
_NEG = -0.7 * float(jnp.finfo(F32).max)

MIN_BLOCK = 64  # query rows per block: smaller blocks cost more per-op overhead than they save
MAX_BLOCKS = 8


def num_query_blocks(t: int, block: int | None = None) -> int:
    """How many query blocks a length-``t`` sequence is split into (1 = no splitting): blocks of
    ``block`` rows when given (Levanter's ``flash_attention_block_size``), else at least
    :data:`MIN_BLOCK` rows and at most :data:`MAX_BLOCKS` blocks."""
    return len(query_blocks(t, block))


def query_blocks(t: int, block: int | None = None) -> tuple[tuple[int, int], ...]:
    """The ``[start, end)`` query rows of each block (see :func:`num_query_blocks`)."""
    if block is not None and block < 1:
        raise ValueError(f"the attention block must be at least 1 row, got {block}")
    size = block if block else -(-t // max(1, min(MAX_BLOCKS, t // MIN_BLOCK)))
    return tuple((s, min(t, s + size)) for s in range(0, t, size))


def blocked_causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, scale: float | jax.Array,
    *, block: int | None = None,
) -> jax.Array:
    """Causal attention. q ``[B, T, N, H]``, k/v ``[B, T, K, H]`` (K divides N) -> ``[B, T, N, H]``.

    ``mask``: None, or a boolean array broadcastable to ``[B, 1, T, T]`` combined (and) with the
    causal mask, e.g. :func:`lm_pipeline.models.layers.segment_mask`; every query row must
    keep at least one key. Scores, softmax and accumulation run in float32; the output has
    q's dtype. ``scale`` may be a traced scalar (it gets no gradient). ``block``: query rows per
    block (None: :func:`query_blocks`' own rule).
    """
    t, kh = q.shape[1], k.shape[2]
    if k.shape[1] != t:
        raise ValueError(f"blocked_causal_attention is self-attention: {t} queries, {k.shape[1]} keys")
    blocks = query_blocks(t, block)
    m = None if mask is None else jnp.broadcast_to(mask, (mask.shape[0], 1, t, t))
    scale = jnp.asarray(scale, F32)
    return _attend(q, k, v, m, scale, blocks, kh)


def _q_layout(x, kh):
    """[B, T, N, H] -> [B, K, G, T, H] (query head n = k * G + g, as in GQA)."""
    b, t, n, h = x.shape
    return x.reshape(b, t, kh, n // kh, h).transpose(0, 2, 3, 1, 4)


def _kv_layout(x):
    """[B, S, K, H] -> [B, K, S, H]."""
    return x.transpose(0, 2, 1, 3)


def _split_heads(q, k, v, kh):
    return _q_layout(q, kh), _kv_layout(k), _kv_layout(v)


def _block_mask(mask, r0, r1, c1):
    rows = jnp.arange(r0, r1)[:, None]
    causal = jnp.arange(c1)[None, :] <= rows  # [t, s]
    if mask is None:
        return causal
    return causal & mask[:, 0, r0:r1, :c1][:, None, None]  # [B, 1, 1, t, s]


def _scores(qb, kt, scale, mask, r0, r1, c1):
    s = jnp.einsum("bkgth,bksh->bkgts", qb, kt[:, :, :c1], preferred_element_type=F32) * scale
    return jnp.where(_block_mask(mask, r0, r1, c1), s, _NEG)


def _forward(q, k, v, mask, scale, blocks, kh):
    qt, kt, vt = _split_heads(q, k, v, kh)
    outs, lses = [], []
    for r0, r1 in blocks:
        s = _scores(qt[:, :, :, r0:r1], kt, scale, mask, r0, r1, r1)
        mx = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - mx)
        denom = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("bkgts,bksh->bkgth", p.astype(v.dtype), vt[:, :, :r1], preferred_element_type=F32) / denom
        outs.append(o)
        lses.append((mx + jnp.log(denom))[..., 0])
    o = jnp.concatenate(outs, axis=3)  # [B, K, G, T, H] f32
    lse = jnp.concatenate(lses, axis=3)  # [B, K, G, T]
    return o, lse


def _merge_heads(o, dtype):
    b, kh, g, t, h = o.shape
    return o.transpose(0, 3, 1, 2, 4).reshape(b, t, kh * g, h).astype(dtype)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attend(q, k, v, mask, scale, blocks, kh):
    o, _ = _forward(q, k, v, mask, scale, blocks, kh)
    return _merge_heads(o, q.dtype)


def _attend_fwd(q, k, v, mask, scale, blocks, kh):
    o, lse = _forward(q, k, v, mask, scale, blocks, kh)
    # Named so that a remat policy can keep them (layers.matmuls_and_attention_saveable).
    out = checkpoint_name(_merge_heads(o, q.dtype), ATTENTION_RESIDUALS[0])
    lse = checkpoint_name(lse, ATTENTION_RESIDUALS[1])
    return out, (q, k, v, mask, scale, out, lse)


def _attend_bwd(blocks, kh, res, g):
    q, k, v, mask, scale, out, lse = res
    qt, kt, vt = _split_heads(q, k, v, kh)
    qt32, kt32, vt32 = qt.astype(F32), kt.astype(F32), vt.astype(F32)  # for the gradient matmuls
    dot_ = _q_layout(g, kh).astype(F32)  # dO
    ot = _q_layout(out, kh).astype(F32)
    delta = jnp.sum(dot_ * ot, axis=-1)  # [B, K, G, T]
    dk = jnp.zeros(kt.shape, F32)
    dv = jnp.zeros(vt.shape, F32)
    dqs = []
    for r0, r1 in blocks:
        qb = qt[:, :, :, r0:r1]
        s = _scores(qb, kt, scale, mask, r0, r1, r1)
        p = jnp.exp(s - lse[:, :, :, r0:r1, None])  # [B, K, G, t, s]; 0 where masked
        dob = dot_[:, :, :, r0:r1]
        dv = dv.at[:, :, :r1].add(jnp.einsum("bkgts,bkgth->bksh", p, dob))
        dp = jnp.einsum("bkgth,bksh->bkgts", dob, vt32[:, :, :r1])
        ds = p * (dp - delta[:, :, :, r0:r1, None]) * scale
        dqs.append(jnp.einsum("bkgts,bksh->bkgth", ds, kt32[:, :, :r1]))
        dk = dk.at[:, :, :r1].add(jnp.einsum("bkgts,bkgth->bksh", ds, qt32[:, :, :, r0:r1]))
    dq = _merge_heads(jnp.concatenate(dqs, axis=3), q.dtype)
    dk = dk.transpose(0, 2, 1, 3).astype(k.dtype)
    dv = dv.transpose(0, 2, 1, 3).astype(v.dtype)
    dmask = None if mask is None else jnp.zeros(mask.shape, jax.dtypes.float0)
    return dq, dk, dv, dmask, jnp.zeros_like(scale)


_attend.defvjp(_attend_fwd, _attend_bwd)
