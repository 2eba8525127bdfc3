"""Levanter's ``trainer.profiler``: the JAX profiler around a window of training steps.

``trainer.profiler: true`` traces steps ``profiler_start_step`` .. ``profiler_start_step +
profiler_num_steps - 1`` (0-based step indices, cut at the run's end) with
``jax.profiler.start_trace`` into ``<trainer.log_dir>/<run id>/profiler/``, as Levanter does; the
trace (``plugins/profile/<time>/*.xplane.pb`` and ``*.trace.json.gz``) opens in TensorBoard's
profile plugin or Perfetto. A run resumed inside the window traces the rest of it. Tracing
changes no result; the fields are not part of any fingerprint.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax

log = logging.getLogger(__name__)


class StepProfiler:
    """Starts the trace before the window's first step and stops it after its last (once the
    step's results exist, so the trace holds the step's device work)."""

    def __init__(self, trainer_cfg: Any, run_id: str, num_steps: int) -> None:
        self.on = bool(getattr(trainer_cfg, "profiler", False))
        self.first = int(getattr(trainer_cfg, "profiler_start_step", 5))
        self.end = min(num_steps, self.first + int(getattr(trainer_cfg, "profiler_num_steps", 100)))
        self.dir = os.path.join(trainer_cfg.log_dir, run_id, "profiler")
        self.active = False

    def before(self, step: int) -> None:
        """Called before running step ``step`` (0-based)."""
        if self.on and not self.active and self.first <= step < self.end:
            os.makedirs(self.dir, exist_ok=True)
            jax.profiler.start_trace(self.dir)
            self.active = True
            log.info("profiling steps %d..%d into %s", step, self.end - 1, self.dir)

    def after(self, done: int, state: Any) -> None:
        """Called after a step, ``done`` steps complete, with the step's new state."""
        if self.active and done >= self.end:
            jax.block_until_ready(state)
            self.stop()

    def stop(self) -> None:
        if self.active:
            self.active = False
            jax.profiler.stop_trace()
            log.info("profile written to %s", self.dir)
