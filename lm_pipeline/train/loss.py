"""The training objective: next-token cross-entropy of a model on a (packed) batch.

Position t predicts token t+1 of the same row; with segment ids, only within a document and
never into padding. A loss mask (a chat source's, 1 on the assistant's tokens) keeps only the
positions whose *predicted* token is masked in: position t counts when ``loss_mask[t + 1]`` is 1.
Sums are returned (not means) so that gradient accumulation and several processes can add them
before dividing by the token count (the masked-in targets).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lm_pipeline.compute import REFERENCE, ComputePlan
from lm_pipeline.models.base import LmModel


def next_token_targets(tokens: jax.Array, segment_ids: jax.Array | None,
                       loss_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(targets int ``[B, T]``, f32 mask ``[B, T]``): position t predicts token t+1 of its document.

    The last position's target is a placeholder (masked): computing over all T positions and
    masking costs less than slicing the ``[B, T, V]`` logits to ``T - 1``. ``loss_mask`` (``[B,
    T]``, 1 = train on this token, or None = every token): position t is kept only where the
    token it predicts, ``t + 1``, is masked in.
    """
    b, t = tokens.shape
    targets = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    has_next = jnp.arange(t) < t - 1
    if segment_ids is None:
        mask = jnp.broadcast_to(has_next, (b, t)).astype(jnp.float32)
    else:
        nxt = jnp.concatenate([segment_ids[:, 1:], segment_ids[:, :1]], axis=1)
        mask = (has_next & (nxt == segment_ids) & (nxt != 0)).astype(jnp.float32)
    if loss_mask is not None:
        mask = mask * (jnp.concatenate([loss_mask[:, 1:], loss_mask[:, :1]], axis=1) != 0).astype(jnp.float32)
    return targets, mask


def next_token_loss_sums(logits: jax.Array, tokens: jax.Array, segment_ids: jax.Array | None,
                         loss_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(sum of next-token cross-entropy in nats, number of predicted tokens), in f32."""
    targets, mask = next_token_targets(tokens, segment_ids, loss_mask)
    return xent_sum(logits, targets, mask), jnp.sum(mask)


def model_loss_sums(
    model: LmModel, tokens: jax.Array, segment_ids: jax.Array | None, *, key: jax.Array | None,
    inference: bool, plan: ComputePlan = REFERENCE, loss_mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(loss sum, predicted tokens) of ``model`` on a batch, computed as ``plan`` says: from the
    model's logits, or (``plan.loss == "cpu_fused_head"``) from its final features with the head
    and cross-entropy fused, so the ``[B, T, V]`` logits never exist whole. ``loss_mask``: see
    :func:`next_token_targets`."""
    targets, mask = next_token_targets(tokens, segment_ids, loss_mask)
    if plan.loss == "cpu_fused_head":
        hidden, head = model.features(tokens, segment_ids, key=key, inference=inference, plan=plan)
        return plan.head_xent_sum(hidden, head, targets, mask), jnp.sum(mask)
    logits = model(tokens, segment_ids, key=key, inference=inference, plan=plan)
    return xent_sum(logits, targets, mask), jnp.sum(mask)


def training_loss_sums(
    model: LmModel, tokens: jax.Array, segment_ids: jax.Array | None, *, key: jax.Array | None,
    inference: bool, plan: ComputePlan = REFERENCE, z_loss_weight: float = 0.0,
    loss_mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(objective sum, cross-entropy sum, predicted tokens): the objective is the cross-entropy
    plus ``z_loss_weight * logsumexp(logits)**2`` per predicted token (PaLM's z-loss; Levanter's
    ``z_loss_weight``). Without a z-loss it is :func:`model_loss_sums` as the plan computes it;
    with one, from the model's logits (the fused head keeps no log-partition)."""
    if not z_loss_weight:
        s, n = model_loss_sums(model, tokens, segment_ids, key=key, inference=inference, plan=plan,
                               loss_mask=loss_mask)
        return s, s, n
    targets, mask = next_token_targets(tokens, segment_ids, loss_mask)
    logits = model(tokens, segment_ids, key=key, inference=inference, plan=plan)
    s = xent_sum(logits, targets, mask)
    return s + z_loss_weight * z_loss_sum(logits, mask), s, jnp.sum(mask)


def z_loss_sum(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """``sum(mask * logsumexp(logits)**2)`` in f32."""
    return jnp.sum(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)) * mask)


@jax.custom_vjp
def xent_sum(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """``sum(mask * (logsumexp(logits) - logits[targets]))`` in f32, with a hand-written VJP.

    The gradient wrt the logits is ``(softmax(logits) - onehot(targets)) * mask``, one fused pass
    over the ``[B, T, V]`` array, instead of autodiff's exp / multiply / scatter-add passes.
    ``targets`` and ``mask`` get no gradient.
    """
    return _xent_fwd(logits, targets, mask)[0]


def _xent_fwd(logits, targets, mask):
    lf = logits.astype(jnp.float32)
    m = jnp.max(lf, axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    logz = m + jnp.log(jnp.sum(jnp.exp(lf - m[..., None]), axis=-1))
    picked = jnp.take_along_axis(lf, targets[..., None], axis=-1)[..., 0]
    return jnp.sum((logz - picked) * mask), (logits, targets, mask, logz)


def _xent_bwd(res, g):
    logits, targets, mask, logz = res
    probs = jnp.exp(logits.astype(jnp.float32) - logz[..., None])
    onehot = jnp.arange(logits.shape[-1], dtype=targets.dtype) == targets[..., None]
    dlogits = (probs - onehot.astype(jnp.float32)) * (g * mask)[..., None]
    return dlogits.astype(logits.dtype), None, None


xent_sum.defvjp(_xent_fwd, _xent_bwd)
