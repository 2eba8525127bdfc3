"""The contract every language model family fulfils.

A model config (a :class:`LmConfig` member in :mod:`lm_pipeline.models.config`, selected by
``type:``) builds an Equinox module, an :class:`LmModel`.
The module maps token ids to logits over a whole batch; the trainer owns the loss, mixed
precision casts and sharding. Each parameter names its *logical* axes (``param_axes``), and the
trainer's axis mappings turn those into mesh shardings, so FSDP and tensor parallelism are a
mapping, not a code path.

Logical axis names: ``vocab``, ``embed``, ``mlp``, ``heads`` (query heads x head_dim, flattened
or not), ``kv_heads``, ``head_dim``, ``layers`` (stacked blocks); ``None`` for an axis that is
never sharded.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax

from lm_pipeline.compute import REFERENCE, ComputePlan


class LmModel(eqx.Module):
    """Base of all models. Subclasses implement ``features`` and ``param_axes``."""

    def __call__(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array | None = None,
        *,
        key: jax.Array | None = None,
        inference: bool = True,
        plan: ComputePlan = REFERENCE,
    ) -> jax.Array:
        """tokens int32 [B, T] -> logits [B, T, vocab] in the parameters' dtype.

        segment_ids: see :class:`lm_pipeline.batch.LmBatch`; None = plain causal attention.
        key / inference: dropout randomness; dropout is active only when ``inference`` is False.
        plan: how to compute (:mod:`lm_pipeline.compute`); same values whichever.
        """
        return plan.lm_logits(*self.features(tokens, segment_ids, key=key, inference=inference, plan=plan))

    def features(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array | None = None,
        *,
        key: jax.Array | None = None,
        inference: bool = True,
        plan: ComputePlan = REFERENCE,
    ) -> tuple[jax.Array, jax.Array]:
        """What the LM head multiplies: the final (normed) hidden states ``[B, T, D]`` and the
        head's weight ``[vocab, D]``; ``__call__`` is ``plan.lm_logits`` of the two. A plan
        with the fused head loss takes these directly
        (:func:`lm_pipeline.train.loss.model_loss_sums`), so the ``[B, T, vocab]`` logits never
        exist whole."""
        raise NotImplementedError

    def output_head(self, hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The last trunk layer's output ``[B, T, D]`` -> (final-normed hidden states, head weight
        ``[vocab, D]``): the last step of :meth:`features` and :meth:`decode`."""
        raise NotImplementedError

    def param_axes(self) -> Any:
        """A pytree with the structure of ``eqx.filter(self, eqx.is_array)`` whose leaves are
        ``jax.sharding.PartitionSpec`` of *logical* axis names, one entry per array dimension
        (e.g. ``P("layers", "embed", "mlp")``). PartitionSpec is a pytree leaf."""
        raise NotImplementedError

    # Incremental decoding (optional for a family; used by text generation).

    def init_cache(self, batch: int, max_len: int | None = None, dtype: Any = None) -> Any:
        """An empty key/value cache (a pytree of arrays) for ``batch`` rows of up to ``max_len``
        tokens (default: the config's seq_len); ``dtype`` defaults to the parameters' dtype."""
        raise NotImplementedError

    def decode(
        self, tokens: jax.Array, cache: Any, position: jax.Array | int, *, plan: ComputePlan = REFERENCE
    ) -> tuple[jax.Array, Any]:
        """tokens int32 [B, S] at positions ``position .. position + S - 1`` (the same for all rows)
        -> (logits [B, S, vocab], updated cache). Attends to the cache up to each token's position
        (plain causal, no segment ids, no dropout). Static shapes: jit-able with a traced
        ``position``, for the prefill (S = prompt length) and single-token steps (S = 1)."""
        raise NotImplementedError
