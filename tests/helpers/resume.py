"""Interrupting a training run and checking its resumption, for the resume tests of one source and
of a mixture alike."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import pytest

from lm_pipeline.faultpoints import FaultInjected, reset_counts
from lm_pipeline.train.checkpoint import latest_checkpoint, load


def params(state: Any) -> list[np.ndarray]:
    """The model's arrays of a train state, as NumPy."""
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array))]


def crash_after_step(monkeypatch: pytest.MonkeyPatch, step: int, run: Callable[[], Any], run_dir: str) -> str:
    """Run ``run()`` with a crash armed right after training step ``step`` (as a killed process
    would stop, the step's checkpoint not yet written); return the run's latest complete checkpoint."""
    monkeypatch.setenv("LM_PIPELINE_FAULTPOINT", f"train.after_step:{step}:raise")
    reset_counts()  # the same arming may have fired earlier in this process
    with pytest.raises(FaultInjected):
        run()
    monkeypatch.delenv("LM_PIPELINE_FAULTPOINT")
    return latest_checkpoint(run_dir)


def assert_resumed_to(clean_state: Any, resumed_state: Any, run_dir: str, resumed_from: str) -> None:
    """The resumed run's parameters equal the uninterrupted run's bitwise, and differ from those of
    the checkpoint it resumed from (the steps after it learned: the equality is not vacuous)."""
    a, b = params(clean_state), params(resumed_state)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    start = load(str(Path(run_dir) / resumed_from), jax.eval_shape(lambda: resumed_state))
    assert any(not np.array_equal(x, y) for x, y in zip(params(start), b, strict=True))
