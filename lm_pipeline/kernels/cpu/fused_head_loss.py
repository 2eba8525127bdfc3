"""The LM head and next-token cross-entropy fused, in chunks of positions.

``hidden [B, T, D]`` and ``head [V, D]`` (what :meth:`~lm_pipeline.models.base.LmModel.features`
returns) give the loss sum without the ``[B, T, V]`` logits ever existing whole. Each chunk of
about :data:`HEAD_CHUNK_ROWS` token rows computes its logits, its share of the loss and, when
differentiated, its gradients at once: the cotangent ``softmax - onehot`` is used while it is
still in cache, and the pass keeps only ``d hidden`` ``[B, T, D]`` and ``d head`` ``[V, D]`` for
the backward pass (the loss is the last thing computed, so its gradients are those times the
incoming scalar cotangent). The weight gradient is accumulated over chunks in f32. Chunks split
positions, not the batch, so a batch sharded over devices stays sharded.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from lm_pipeline.kernels.cpu.matmul import blas_nn, blas_nt, gemm, head_grad, round_to, uses_blas, xt_g

HEAD_CHUNK_ROWS = 512
"""Token rows (batch x positions) per chunk: a chunk's ``[rows, vocab]`` logits, probabilities
and cotangent stay small enough to be reused from cache."""


def head_chunks(batch: int, seq_len: int, rows: int | None = None) -> tuple[tuple[int, int], ...]:
    """The ``[start, end)`` position ranges a sequence is split into: about ``rows`` (default
    :data:`HEAD_CHUNK_ROWS`) token rows (``batch x positions``) each."""
    if rows is not None and rows < 1:
        raise ValueError(f"the head's chunk must be at least 1 row, got {rows}")
    n = max(1, min(seq_len, round(batch * seq_len / (rows or HEAD_CHUNK_ROWS))))
    size = -(-seq_len // n)
    return tuple((s, min(seq_len, s + size)) for s in range(0, seq_len, size))


def fused_head_xent_sum(hidden: jax.Array, head: jax.Array, targets: jax.Array, mask: jax.Array, *,
                        chunk_rows: int | None = None, operands=None, native: bool = False,
                        blas: bool = False) -> jax.Array:
    """``sum(mask * cross_entropy(hidden @ headᵀ, targets))`` in f32 nats.

    ``targets`` int ``[B, T]`` and ``mask`` f32 ``[B, T]`` get no gradient; ``hidden`` and
    ``head`` get exact gradients up to float rounding. ``chunk_rows``: token rows per chunk
    (None: :data:`HEAD_CHUNK_ROWS`; Levanter's ``cross_entropy_block_size``). ``operands``: None,
    or the dtype the head's products round their operands to (``trainer.mp``'s ``m=``; float32
    accumulation, float32 softmax). ``native``: the weight gradient's transpose by the native
    library (:func:`~lm_pipeline.kernels.cpu.matmul.xt_g`). ``blas``: float32 products by oneMKL's
    sgemm (:func:`~lm_pipeline.kernels.cpu.matmul.gemm`), the head and the logits' gradient read
    in place.
    """
    f32_operands = operands is None or jnp.dtype(operands) == jnp.float32
    blas = blas and f32_operands and uses_blas(True, hidden, head)  # decided here: the rules below rely on it
    return _fused_head_xent(hidden, head, targets, mask, head_chunks(*targets.shape, rows=chunk_rows), operands,
                            native, blas)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _fused_head_xent(hidden, head, targets, mask, bounds, operands=None, native=False, blas=False):
    return _head_xent_chunks(hidden, head, targets, mask, bounds, operands, blas=blas, grads=False)[0]


def _head_xent_chunks(hidden, head, targets, mask, bounds, operands=None, native=False, blas=False, *, grads: bool):
    f32 = jnp.float32
    total = jnp.zeros((), f32)
    d_hidden, d_head_t = [], None
    head_in = round_to(head, operands)
    for t0, t1 in bounds:
        h = hidden[:, t0:t1]
        if t0 > 0:  # chunks in order, one at a time: the next starts when this one's results exist
            h, total, d_head_t, d_hidden = jax.lax.optimization_barrier((h, total, d_head_t, d_hidden))
        tgt, m = targets[:, t0:t1], mask[:, t0:t1]
        # f32 logits from compute-dtype operands (bf16 x bf16 -> f32: YNNPACK's bf16 kernels)
        hl = round_to(h, operands)
        lf = blas_nt(hl, head_in) if blas else jnp.einsum("btd,vd->btv", hl, head_in, preferred_element_type=f32)
        mx = jnp.max(lf, axis=-1)
        mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
        e = jnp.exp(lf - mx[..., None])
        z = jnp.sum(e, axis=-1)
        picked = jnp.take_along_axis(lf, tgt[..., None], axis=-1)[..., 0]
        total = total + jnp.sum((mx + jnp.log(z) - picked) * m)
        if grads:
            onehot = jnp.arange(head.shape[0], dtype=tgt.dtype) == tgt[..., None]
            dl = ((e / z[..., None] - onehot.astype(f32)) * m[..., None]).astype(hl.dtype)
            h2, dl2 = hl.reshape(-1, h.shape[-1]), dl.reshape(-1, dl.shape[-1])
            if blas:  # dlᵀ h read in place, [V, D]
                d_hidden.append(blas_nn(dl, head_in).astype(h.dtype))
                part = gemm(dl2, h2, trans_a=True)
            else:
                d_hidden.append(jnp.einsum("btv,vd->btd", dl, head_in, preferred_element_type=f32).astype(h.dtype))
                # [V, D] straight from the native transpose, else [D, V] (transposed once, at the end)
                part = (head_grad(h2, dl2) if native else xt_g(h2, dl2)).astype(f32)
            d_head_t = part if d_head_t is None else d_head_t + part  # [V, D] when native or blas, else [D, V]
    if not grads:
        return total, None
    return total, (jnp.concatenate(d_hidden, axis=1), d_head_t)


def _fused_head_xent_fwd(hidden, head, targets, mask, bounds, operands, native, blas):
    total, (d_hidden, d_head_t) = _head_xent_chunks(hidden, head, targets, mask, bounds, operands, native, blas,
                                                    grads=True)
    return total, (d_hidden, d_head_t, jnp.zeros((), head.dtype))


def _fused_head_xent_bwd(bounds, operands, native, blas, res, g):
    d_hidden, d_head_t, head_dtype = res
    d_head = d_head_t if native or blas else d_head_t.T
    return (g * d_hidden).astype(d_hidden.dtype), (g * d_head).astype(head_dtype.dtype), None, None


_fused_head_xent.defvjp(_fused_head_xent_fwd, _fused_head_xent_bwd)
