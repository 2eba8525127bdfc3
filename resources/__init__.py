"""Dagster resources of the pipeline: where artifacts live, how training runs, JAX runtime, trackers.

Nothing here changes what an artifact *is*: every setting is non-semantic (storage location,
process layout, device platform and mesh, trackers), so it never enters a fingerprint. Settings
that reach the training config are applied as overrides of non-semantic fields only, and the
pipeline checks that the run's fingerprint is unchanged by them.

* :class:`ArtifactStoreResource` -- the content-addressed store root (local folder or fsspec URL).
* :class:`TrainingLauncherResource` -- ``pipes`` (default: training runs as its own process,
  ``python -m lm_pipeline.pipes_train``, through Dagster Pipes; the process may preload tcmalloc)
  or ``in_process`` (tests, notebooks).
* :class:`JaxRuntimeResource` -- ``JAX_PLATFORMS``, the mesh's model axis, ``jax.distributed``.
* :class:`TrackingResource` -- Weights & Biases (used directly, not through dagster-wandb) and
  TensorBoard, besides the always-on JSONL metrics log.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import dagster as dg

__all__ = [
    "ArtifactStoreResource",
    "JaxRuntimeResource",
    "TrackingResource",
    "TrainingLauncherResource",
    "TRAIN_MODE_ENV",
    "apply_runtime_overrides",
]

#: Environment variable choosing the default training mode: ``pipes`` or ``in_process``.
TRAIN_MODE_ENV = "LM_PIPELINE_TRAIN_MODE"

class ArtifactStoreResource(dg.ConfigurableResource):
    """Root of the content-addressed artifact store: ``<root>/<stage>/<fingerprint>/``."""

    root: str

    def store(self):
        from lm_pipeline.store import ArtifactStore

        return ArtifactStore(self.root)


class JaxRuntimeResource(dg.ConfigurableResource):
    """Where and how JAX runs the training process (none of it changes the weights' address)."""

    platforms: str | None = None  # JAX_PLATFORMS for the training process: 'cpu', 'cuda', 'tpu'; None = JAX picks
    model_axis_size: int | None = None  # devices per tensor-parallel group (the mesh's model axis)
    coordinator_address: str | None = None  # jax.distributed: host:port of process 0
    num_processes: int | None = None  # jax.distributed: processes in the job
    process_id: int | None = None  # jax.distributed: this process's id

    def env(self) -> dict[str, str]:
        return {"JAX_PLATFORMS": self.platforms} if self.platforms else {}

    def overrides(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.model_axis_size is not None:
            out["trainer.model_axis_size"] = self.model_axis_size
        for name in ("coordinator_address", "num_processes", "process_id"):
            value = getattr(self, name)
            if value is not None:
                out[f"trainer.distributed.{name}"] = value
        return out


class TrackingResource(dg.ConfigurableResource):
    """Experiment trackers besides the always-on JSONL log (empty: keep the experiment's own)."""

    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_mode: str | None = None  # 'online', 'offline' or 'disabled'; None = $WANDB_MODE or online
    wandb_group: str | None = None
    tensorboard: bool = False

    def overrides(self) -> dict[str, Any]:
        trackers: list[dict[str, Any]] = []
        if self.wandb_project or self.wandb_entity or self.wandb_mode:
            wandb = {"type": "wandb", "project": self.wandb_project, "entity": self.wandb_entity,
                     "mode": self.wandb_mode, "group": self.wandb_group}
            trackers.append({k: v for k, v in wandb.items() if v is not None})
        if self.tensorboard:
            trackers.append({"type": "tensorboard"})
        return {"trainer.tracker": trackers} if trackers else {}


class TrainingLauncherResource(dg.ConfigurableResource):
    """How ``train_ckpt`` runs: its own process through Dagster Pipes, or in the step's process."""

    mode: str = "pipes"  # 'pipes' | 'in_process'
    python_executable: str = sys.executable
    module: str = "lm_pipeline.pipes_train"
    preload_tcmalloc: bool = True  # LD_PRELOAD a tcmalloc found on the machine (pipes mode only)
    tcmalloc_path: str | None = None  # explicit library; None = lm_pipeline.launch.find_tcmalloc
    extra_env: dict[str, str] = {}
    poll_seconds: float = 0.5  # how often checkpoints and metrics are forwarded to Dagster

    @classmethod
    def from_env(cls) -> TrainingLauncherResource:
        mode = os.environ.get(TRAIN_MODE_ENV, "pipes").strip() or "pipes"
        return cls(mode=mode)

    def validate_mode(self) -> str:
        if self.mode not in ("pipes", "in_process"):
            raise dg.Failure(f"training mode must be 'pipes' or 'in_process', got {self.mode!r} (${TRAIN_MODE_ENV})")
        return self.mode

    def command(self) -> list[str]:
        return [self.python_executable, "-m", self.module]

    def child_env(self) -> dict[str, str]:
        env = dict(self.extra_env)
        if self.preload_tcmalloc:
            from lm_pipeline.launch import find_tcmalloc

            lib = self.tcmalloc_path or find_tcmalloc()
            if lib and os.path.isfile(lib):
                preload = os.environ.get("LD_PRELOAD", "")
                env["LD_PRELOAD"] = f"{lib}:{preload}" if preload else lib
        return env


def apply_runtime_overrides(cfg, *resources) -> Any:
    """``cfg`` with the resources' non-semantic overrides applied (semantic changes are refused)."""
    from lm_pipeline.config import RunConfig, apply_overrides
    from lm_pipeline.fingerprint import semantic_view
    from lm_pipeline.schema import from_dict, to_dict

    pairs: dict[str, Any] = {}
    for res in resources:
        if res is not None:
            pairs.update(res.overrides())
    if not pairs:
        return cfg
    new = from_dict(RunConfig, apply_overrides(to_dict(cfg), list(pairs.items())))
    if semantic_view(new) != semantic_view(cfg):
        raise dg.Failure(f"runtime overrides {sorted(pairs)} would change semantic config fields")
    return new
