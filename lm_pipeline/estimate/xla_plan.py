"""What XLA plans for the real train step: the figure :attr:`Estimate.total` is calibrated
against (``bench/estimate_check.py``, ``docs/benchmarks.md``). Unlike the estimate, this compiles."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from lm_pipeline.config import RunConfig


def peak_batch_size(cfg: RunConfig, plan: Any) -> int:
    """The batch size of ``cfg``'s schedule whose step peaks: the largest micro-batch (the
    activations), then the most rows (the batch arguments). A plain batch size is itself; for
    ``[{0: 8}, {100: 64}]`` with ``per_device_parallelism: -1`` it is 64, as :func:`estimate`
    counts (the schedule's largest size)."""
    from lm_pipeline.train.trainer import micro_batches

    sizes = cfg.trainer.batch_schedule.distinct_sizes
    return max(sizes, key=lambda size: (micro_batches(cfg.trainer, plan, size)[0], size))


def has_chat_sources(cfg: RunConfig) -> bool:
    """Whether ``cfg``'s data has a chat source: its batches then carry a loss mask (the train
    step's fourth argument), as the training run builds its step (``train.run``)."""
    return bool(getattr(cfg.data, "chat_sources", dict)())


def compiled_train_step(cfg: RunConfig, vocab_size: int, *, segments: bool = False,
                        loss_mask: bool | None = None) -> Any:
    """The real train step of ``cfg`` on one device, lowered and compiled for its peak batch
    (:func:`peak_batch_size`; a schedule's other sizes compile their own steps), not run.
    ``loss_mask``: whether batches carry a loss mask (default: the data has a chat source)."""
    from lm_pipeline.train.sharding import make_mesh
    from lm_pipeline.train.trainer import build_step_functions

    if loss_mask is None:
        loss_mask = has_chat_sources(cfg)
    plan = make_mesh(cfg.trainer, jax.devices()[:1])
    fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=vocab_size, num_train_steps=10,
                               plan=plan, has_segments=segments, has_loss_mask=loss_mask)
    rows = peak_batch_size(cfg, plan)
    tokens = jax.ShapeDtypeStruct((rows, cfg.model.seq_len), jnp.int32)  # the step's batch
    args = (tokens, tokens if segments else None, *((tokens,) if loss_mask else ()))
    with jax.set_mesh(plan.mesh):
        return fns.train_step_for(rows).lower(fns.abstract_state, *args).compile()


def compiled_step_bytes(cfg: RunConfig, vocab_size: int, *, segments: bool = False,
                        loss_mask: bool | None = None) -> int:
    """What XLA plans for the real train step of ``cfg`` on one device, without running it:
    ``argument + output - alias + temp`` bytes of the compiled step's memory analysis (the
    state is donated, so outputs alias arguments; ``temp`` packs every intermediate at its
    peak), for the schedule's peak batch (:func:`compiled_train_step`). The figure
    :attr:`Estimate.total` is calibrated against."""
    return planned_bytes(compiled_train_step(cfg, vocab_size, segments=segments, loss_mask=loss_mask))


def planned_bytes(compiled: Any) -> int | None:
    """Peak bytes of a compiled step from XLA's memory analysis (``argument + output - alias +
    temp``), or None where the backend gives no analysis."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
