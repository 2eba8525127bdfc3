"""Dagster resources of the pipeline: where artifacts live, how training runs, JAX runtime, trackers.

Nothing here changes what an artifact *is*: every setting is non-semantic (storage location,
process layout, device platform and mesh, trackers), so it never enters a fingerprint. Settings
that reach the training config are applied as overrides of non-semantic fields only, and the
pipeline checks that the run's fingerprint is unchanged by them.

* :class:`ArtifactStoreResource` -- the content-addressed store root (local folder or fsspec URL).
* :class:`TrainingLauncherResource` -- ``pipes`` (default: training runs as its own process,
  ``python -m lm_pipeline.pipes_train``, through Dagster Pipes; the process may preload tcmalloc),
  ``in_process`` (tests, notebooks) or ``ray`` (one Ray job on a cluster running N processes of
  one ``jax.distributed`` run, Pipes messages read from the job's log: docs/cluster.md).
* :class:`TokenizingResource` -- where ``token_cache``'s shard groups are tokenized: ``local``
  (default: one Dagster op per group) or ``ray`` (one Ray task per group on a cluster).
* :class:`JaxRuntimeResource` -- ``JAX_PLATFORMS``, the mesh's model axis, ``jax.distributed``.
* :class:`TrackingResource` -- Weights & Biases (used directly, not through dagster-wandb) and
  TensorBoard, besides the always-on JSONL metrics log.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import dagster as dg

__all__ = [
    "ArtifactStoreResource",
    "JaxRuntimeResource",
    "TokenizingResource",
    "TrackingResource",
    "TrainingLauncherResource",
    "RAY_ADDRESS_ENV",
    "TRAIN_MODE_ENV",
    "apply_runtime_overrides",
]

#: Environment variable choosing the default training mode: ``pipes``, ``in_process`` or ``ray``.
TRAIN_MODE_ENV = "LM_PIPELINE_TRAIN_MODE"
#: Environment variable with the Ray cluster's job API address for ``ray`` mode (else ``$RAY_ADDRESS``).
RAY_ADDRESS_ENV = "LM_PIPELINE_RAY_ADDRESS"
TRAIN_MODES = ("pipes", "in_process", "ray")
#: Environment variable: when set, ``token_cache`` tokenizes on this Ray cluster (what ``ray.init`` takes).
TOKENIZE_RAY_ADDRESS_ENV = "LM_PIPELINE_TOKENIZE_RAY_ADDRESS"
TOKENIZE_MODES = ("local", "ray")
_RAY_ADDRESS_RE = re.compile(r"^(https?://)?[A-Za-z0-9_.\-]+:\d{1,5}/?$|^(https?://)[A-Za-z0-9_.\-]+/?$")

class ArtifactStoreResource(dg.ConfigurableResource):
    """Root of the content-addressed artifact store: ``<root>/<stage>/<fingerprint>/``."""

    root: str

    def store(self):
        from lm_pipeline.store import open_store

        return open_store(self.root)


class TokenizingResource(dg.ConfigurableResource):
    """Where ``token_cache``'s shard groups are tokenized: ``local`` (one Dagster op per group, the
    default) or ``ray`` (one Ray task per group, :mod:`lm_pipeline.cluster.ray_cache`; the store
    and the data must be reachable from every node). The artifact is the same either way."""

    mode: str = "local"  # 'local' | 'ray'
    ray_address: str | None = None  # what ray.init takes: auto, <head>:6379 (on a node), ray://<head>:10001; None = $RAY_ADDRESS
    ray_cpus_per_task: float = 1.0
    ray_resources_per_task: dict[str, float] = {}
    ray_max_retries: int = 3  # how often Ray re-runs a task whose worker died
    ray_runtime_env: dict[str, Any] = {}  # the tasks' Ray runtime_env (env_vars, ...)

    @classmethod
    def from_env(cls) -> TokenizingResource:
        addr = os.environ.get(TOKENIZE_RAY_ADDRESS_ENV, "").strip()
        return cls(mode="ray", ray_address=addr) if addr else cls()

    def validate(self) -> str:
        """The mode, checked; in ``ray`` mode also the address's form and the package (one line,
        before any work)."""
        if self.mode not in TOKENIZE_MODES:
            raise dg.Failure(f"tokenizing mode must be one of {', '.join(TOKENIZE_MODES)}, got {self.mode!r}",
                             allow_retries=False)
        if self.mode == "ray":
            from lm_pipeline.cluster import ClusterError, require_ray
            from lm_pipeline.cluster.ray_cache import check_ray_address

            try:
                if not (self.ray_address or os.environ.get("RAY_ADDRESS")):
                    raise ClusterError(f"no cluster address; set ray_address (auto, <head>:6379 or ray://<head>:10001), "
                                       f"${TOKENIZE_RAY_ADDRESS_ENV} or $RAY_ADDRESS")
                check_ray_address(self.ray_address)
                require_ray("tokenizing on Ray")
            except ClusterError as e:
                raise dg.Failure(f"tokenizing resource (mode 'ray'): {e}", allow_retries=False) from None
        return self.mode

    def build_on_ray(self, pipe, log=None):
        """``pipe``'s token cache built with one Ray task per shard group (a hit returns at once)."""
        from lm_pipeline.cluster import ClusterError
        from lm_pipeline.cluster.ray_cache import build_token_cache_on_ray

        def on_part(out: dict[str, Any]) -> None:
            if log is not None:
                part = out["part"]
                log(f"group {part['group']}: {part.get('num_docs')} docs, {part.get('num_tokens')} tokens "
                    f"in {part.get('seconds', 0.0):.1f}s on {out['ip']} (pid {out['pid']})")

        try:
            return build_token_cache_on_ray(pipe, address=self.ray_address, num_cpus=self.ray_cpus_per_task,
                                            resources=self.ray_resources_per_task, max_retries=self.ray_max_retries,
                                            runtime_env=self.ray_runtime_env or None, on_part=on_part)
        except ClusterError as e:
            raise dg.Failure(f"tokenizing on Ray: {e}") from None


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
    """How ``train_ckpt`` runs: its own process through Dagster Pipes (default), in the step's
    process, or as N processes of one ``jax.distributed`` run on a Ray cluster (``ray``)."""

    mode: str = "pipes"  # 'pipes' | 'in_process' | 'ray'
    python_executable: str = sys.executable
    module: str = "lm_pipeline.pipes_train"
    preload_tcmalloc: bool = True  # LD_PRELOAD a tcmalloc found on the machine (pipes mode only)
    tcmalloc_path: str | None = None  # explicit library; None = lm_pipeline.launch.find_tcmalloc
    extra_env: dict[str, str] = {}
    poll_seconds: float = 0.5  # how often checkpoints and metrics are forwarded to Dagster
    # -- ray mode (docs/cluster.md) --
    ray_address: str | None = None  # the cluster's job API (dashboard), http://<head>:8265; None = $LM_PIPELINE_RAY_ADDRESS or $RAY_ADDRESS
    ray_num_processes: int = 2  # processes of the jax.distributed run (one Ray actor each)
    ray_cpus_per_process: float = 1.0
    ray_gpus_per_process: float = 0.0
    ray_resources_per_process: dict[str, float] = {}  # e.g. {"TPU": 4}
    ray_placement_strategy: str = "SPREAD"  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
    ray_runtime_env: dict[str, Any] = {}  # the job's Ray runtime_env (env_vars, pip, working_dir, ...)
    ray_python: str = "python"  # the interpreter on the cluster's head node that runs the job's driver
    ray_start_timeout_s: float = 600.0  # how long the job waits for the cluster to grant the processes

    @classmethod
    def from_env(cls) -> TrainingLauncherResource:
        mode = os.environ.get(TRAIN_MODE_ENV, "pipes").strip() or "pipes"
        return cls(mode=mode, ray_address=os.environ.get(RAY_ADDRESS_ENV) or None)

    def validate_mode(self) -> str:
        """The mode, checked; in ``ray`` mode also the packages and the settings (one line each,
        before anything is computed)."""
        if self.mode not in TRAIN_MODES:
            raise dg.Failure(f"training mode must be one of {', '.join(TRAIN_MODES)}, got {self.mode!r} (${TRAIN_MODE_ENV})",
                             allow_retries=False)
        if self.mode == "ray":
            self.ray_spec()
            self.resolved_ray_address()
        return self.mode

    def ray_spec(self):
        """The run's layout on the cluster (:class:`lm_pipeline.cluster.ray_train.RayTrainSpec`)."""
        from lm_pipeline.cluster import ClusterError, require_ray
        from lm_pipeline.cluster.ray_train import RayTrainSpec

        try:
            require_ray()
            try:
                import dagster_ray  # noqa: F401  (its Pipes message reader tails the job's log)
            except ImportError as e:
                from lm_pipeline.cluster import INSTALL_HINT

                raise ClusterError(f"training on Ray needs the 'dagster-ray' package ({e}); {INSTALL_HINT}") from None
            return RayTrainSpec(num_processes=self.ray_num_processes, cpus_per_process=self.ray_cpus_per_process,
                                gpus_per_process=self.ray_gpus_per_process,
                                resources_per_process=dict(self.ray_resources_per_process),
                                placement_strategy=self.ray_placement_strategy,
                                start_timeout_s=self.ray_start_timeout_s).validate()
        except ClusterError as e:
            raise dg.Failure(f"training resource (mode 'ray'): {e}", allow_retries=False) from None

    def resolved_ray_address(self) -> str:
        """The job API address: ``ray_address``, else ``$LM_PIPELINE_RAY_ADDRESS`` or ``$RAY_ADDRESS``."""
        addr = self.ray_address or os.environ.get(RAY_ADDRESS_ENV) or os.environ.get("RAY_ADDRESS")
        if not addr:
            raise dg.Failure("training resource (mode 'ray'): no cluster address; set ray_address (the job API, "
                             f"http://<head>:8265) or ${RAY_ADDRESS_ENV}", allow_retries=False)
        if not _RAY_ADDRESS_RE.match(addr.strip()):
            raise dg.Failure(f"training resource (mode 'ray'): ray_address {addr!r} is not a Ray job API address "
                             "(http://<head>:8265 or <head>:8265)", allow_retries=False)
        return addr.strip()

    def ray_job_client(self):
        """A ``ray.job_submission.JobSubmissionClient`` for the cluster, or a one-line failure."""
        addr = self.resolved_ray_address()
        from ray.job_submission import JobSubmissionClient

        try:
            # A Ray dashboard address, not a storage path: a bare host:port is Ray's HTTP one.
            return JobSubmissionClient(addr if "://" in addr else f"http://{addr}")
        except Exception as e:
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            raise dg.Failure(f"cannot reach the Ray cluster's job API at {addr}: {type(e).__name__}: "
                             f"{lines[0] if lines else ''}", allow_retries=False) from None

    def ray_entrypoint(self) -> str:
        from lm_pipeline.cluster.ray_train import ENTRYPOINT_MODULE

        return f"{self.ray_python} -m {ENTRYPOINT_MODULE}"

    def ray_job_runtime_env(self, env: dict[str, str]) -> dict[str, Any]:
        """``ray_runtime_env`` with ``extra_env`` and ``env`` (Pipes bootstrap, JAX platform) in its
        ``env_vars``; every process of the job inherits them."""
        runtime_env = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.ray_runtime_env.items()}
        runtime_env["env_vars"] = {**self.extra_env, **dict(runtime_env.get("env_vars") or {}), **env}
        return runtime_env

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
