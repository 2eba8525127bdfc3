"""The contract every language model family fulfils.

A model config (a :class:`LmConfig` member, selected by ``type:``) builds an Equinox module.
The module maps token ids to logits over a whole batch; the trainer owns the loss, mixed
precision casts and sharding. Each parameter names its *logical* axes (``param_axes``), and the
trainer's axis mappings turn those into mesh shardings, so FSDP and tensor parallelism are a
mapping, not a code path.

Logical axis names: ``vocab``, ``embed``, ``mlp``, ``heads`` (query heads x head_dim, flattened
or not), ``kv_heads``, ``head_dim``, ``layers`` (stacked blocks); ``None`` for an axis that is
never sharded.
"""

from __future__ import annotations

from typing import Any, ClassVar

import equinox as eqx
import jax

from lm_pipeline.schema import Choice


class LmConfig(Choice):
    """Family of model configs; ``type: gpt2`` or ``type: llama``."""

    default_type: ClassVar[str] = "gpt2"
    # Members are frozen dataclasses with at least: type, seq_len.

    def build(self, vocab_size: int, *, key: jax.Array) -> LmModel:
        """A freshly initialised model with f32 parameters."""
        raise NotImplementedError

    def flops_per_token(self, vocab_size: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), attention included."""
        raise NotImplementedError

    def num_params(self, vocab_size: int) -> int:
        raise NotImplementedError


class LmModel(eqx.Module):
    """Base of all models. Subclasses implement ``__call__`` and ``param_axes``."""

    def __call__(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array | None = None,
        *,
        key: jax.Array | None = None,
        inference: bool = True,
    ) -> jax.Array:
        """tokens int32 [B, T] -> logits [B, T, vocab] in the parameters' dtype.

        segment_ids: see :class:`lm_pipeline.batch.LmBatch`; None = plain causal attention.
        key / inference: dropout randomness; dropout is active only when ``inference`` is False.
        """
        raise NotImplementedError

    def param_axes(self) -> Any:
        """A pytree with the structure of ``eqx.filter(self, eqx.is_array)`` whose leaves are
        ``jax.sharding.PartitionSpec`` of *logical* axis names, one entry per array dimension
        (e.g. ``P("layers", "embed", "mlp")``). PartitionSpec is a pytree leaf."""
        raise NotImplementedError
