"""The guard of every checkpoint save: a train state whose parameters are not finite is never
written (``trainer`` runs without ``optimizer.skip_bad_steps`` stop instead)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from lm_pipeline.train.checkpoint import Checkpointer
from lm_pipeline.train.optim import all_finite

params_finite_jit = jax.jit(all_finite)


def params_finite(params: Any) -> bool:
    """Whether every floating parameter is finite: read in place with NumPy where the arrays are
    whole on this host's CPU (no program to compile: 0.2 s of a small run's end), else one jitted
    reduction on their devices."""
    leaves = jax.tree.leaves(params)
    if all(getattr(x, "is_fully_addressable", False) and {d.platform for d in x.devices()} == {"cpu"}
           for x in leaves):
        return all(bool(np.isfinite(np.asarray(x)).all()) for x in leaves if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact))
    return bool(params_finite_jit(params))


class FiniteStateCheckpointer(Checkpointer):
    """Refuses to save a train state whose parameters are not finite.

    Without ``optimizer.skip_bad_steps`` a NaN/Inf loss or gradient poisons the parameters; the
    loss check at logging steps may not have run yet when a save comes due, so every save
    checks the parameters themselves (one reduction over them) and stops the run instead.
    """

    def save(self, step, state, *args, **kwargs):
        if not params_finite(state.model):
            raise FloatingPointError(
                f"non-finite parameters after step {step} (a NaN/Inf loss or gradient); not saving a checkpoint. "
                "Resume from the last checkpoint with a lower optimizer.learning_rate (or a higher "
                "optimizer.warmup), check the data, or set optimizer.skip_bad_steps: true to skip such steps"
            )
        return super().save(step, state, *args, **kwargs)
