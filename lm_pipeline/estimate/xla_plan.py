"""What XLA plans for the real train step: the figure :attr:`Estimate.total` is calibrated
against (``bench/estimate_check.py``, ``docs/benchmarks.md``). Unlike the estimate, this compiles."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from lm_pipeline.config import RunConfig


def compiled_step_bytes(cfg: RunConfig, vocab_size: int, *, segments: bool = False) -> int:
    """What XLA plans for the real train step of ``cfg`` on one device, without running it:
    ``argument + output - alias + temp`` bytes of the compiled step's memory analysis (the
    state is donated, so outputs alias arguments; ``temp`` packs every intermediate at its
    peak). The figure :attr:`Estimate.total` is calibrated against."""
    from lm_pipeline.train.sharding import make_mesh
    from lm_pipeline.train.trainer import build_step_functions

    plan = make_mesh(cfg.trainer, jax.devices()[:1])
    fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=vocab_size, num_train_steps=10,
                               plan=plan, has_segments=segments)
    tokens = jax.ShapeDtypeStruct((fns.batch_rows, cfg.model.seq_len), jnp.int32)  # train_step's batch
    with jax.set_mesh(plan.mesh):
        compiled = fns.train_step.lower(fns.abstract_state, tokens, tokens if segments else None).compile()
    return planned_bytes(compiled)


def planned_bytes(compiled: Any) -> int | None:
    """Peak bytes of a compiled step from XLA's memory analysis (``argument + output - alias +
    temp``), or None where the backend gives no analysis."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
