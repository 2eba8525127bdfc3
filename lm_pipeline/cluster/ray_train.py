"""One training run as N processes of one ``jax.distributed`` job on a Ray cluster.

Two layers, neither needing Dagster:

* :func:`run_on_ray` (call it from any Ray driver): reserves a placement group of N bundles
  (spread over nodes when possible), starts one :class:`TrainProcess` actor per bundle, takes
  process 0's node address and a free port as the ``jax.distributed`` coordinator and runs the
  same training entry in every process with ``trainer.distributed`` set (``process_id`` 0..N-1).
  Every process reads only its slice of each global batch; process 0 writes the metrics log and
  the manifest, all processes write their shards of each checkpoint. When any process dies or
  fails, the others are killed and :class:`TrainProcessFailed` names it: the run resumes from
  its latest complete checkpoint when started again.
* :func:`main` (``python -m lm_pipeline.cluster.ray_train``): the entrypoint of the Ray *job*
  that the Dagster training resource submits in ``ray`` mode. It is a Dagster Pipes child
  (:func:`lm_pipeline.pipes_train.run_child`, as the Pipes process is): it reads the run config,
  store root, expected fingerprint and the Ray layout from the Pipes extras, relays process 0's
  metrics and every complete checkpoint (watched in the store) as Pipes messages on its stdout
  -- the job's log, which ``dagster-ray``'s ``PipesRayJobMessageReader`` tails -- and reports the
  materialization at the end. The processes' own log lines reach the job log too (Ray forwards
  them to the driver).

Ray is imported lazily (:func:`lm_pipeline.cluster.require_ray`).
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from lm_pipeline.cluster import ClusterError, require_ray

if TYPE_CHECKING:
    from lm_pipeline.pipes_train import ChildRun

log = logging.getLogger(__name__)

#: ``python -m`` target of the Ray job (the Pipes process).
ENTRYPOINT_MODULE = "lm_pipeline.cluster.ray_train"
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class TrainProcessFailed(RuntimeError):
    """A process of the run died or raised; the others were stopped (one line)."""


@dataclass(frozen=True)
class RayTrainSpec:
    """How a run is laid out on the cluster: N processes, what each reserves, where they go."""

    num_processes: int = 2
    cpus_per_process: float = 1.0
    gpus_per_process: float = 0.0
    resources_per_process: dict[str, float] = field(default_factory=dict)  # e.g. {"TPU": 4}
    placement_strategy: str = "SPREAD"  # Ray placement group strategy (SPREAD: one node each if possible)
    start_timeout_s: float = 600.0  # how long to wait for the cluster to grant the bundles

    def validate(self) -> RayTrainSpec:
        if int(self.num_processes) != self.num_processes or self.num_processes < 1:
            raise ClusterError(f"num_processes must be a positive integer, got {self.num_processes!r}")
        for name in ("cpus_per_process", "gpus_per_process"):
            if getattr(self, name) < 0:
                raise ClusterError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.placement_strategy not in STRATEGIES:
            raise ClusterError(f"placement_strategy must be one of {', '.join(STRATEGIES)}, got {self.placement_strategy!r}")
        return self

    def bundle(self) -> dict[str, float]:
        b = {"CPU": float(self.cpus_per_process), **{k: float(v) for k, v in self.resources_per_process.items()}}
        if self.gpus_per_process:
            b["GPU"] = float(self.gpus_per_process)
        return {k: v for k, v in b.items() if v}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RayTrainSpec:
        return cls(**dict(d)).validate()


def _first_line(e: BaseException) -> str:
    cause = getattr(e, "cause", None) or e  # RayTaskError carries the worker's exception
    lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
    return f"{type(cause).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TrainProcess:
    """One process of the run (a Ray actor; ``max_concurrency=2`` so :meth:`drain` answers
    while :meth:`train` runs)."""

    def __init__(self, process_id: int, num_processes: int):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.process_id, self.num_processes = process_id, num_processes
        self._messages: collections.deque = collections.deque()

    def describe(self) -> dict[str, Any]:
        import ray

        return {"process_id": self.process_id, "pid": os.getpid(), "ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(), "hostname": socket.gethostname()}

    def coordinator_address(self) -> str:
        import ray

        ip = ray.util.get_node_ip_address()
        return f"{ip}:{_free_port(ip)}"

    def drain(self) -> list[dict[str, Any]]:
        out = []
        while self._messages:
            out.append(self._messages.popleft())
        return out

    def train(self, config_yaml: str, store_root: str, coordinator: str, expected_fingerprint: str | None) -> dict[str, Any]:
        import yaml

        from lm_pipeline.config import RunConfig, apply_overrides
        from lm_pipeline.pipes_train import stage_metadata, train_run
        from lm_pipeline.schema import from_dict
        from lm_pipeline.steps import Pipeline
        from lm_pipeline.store import open_store

        pid, n = self.process_id, self.num_processes
        raw = apply_overrides(yaml.safe_load(config_yaml), [
            ("trainer.distributed.coordinator_address", coordinator), ("trainer.distributed.num_processes", n),
            ("trainer.distributed.process_id", pid), ("trainer.distributed.initialize", n > 1)])
        cfg = from_dict(RunConfig, raw)
        store = open_store(store_root)
        pipe = Pipeline(cfg, store, progress=False)  # process 0 locks and commits (the stage is distributed)
        fp = pipe.address("train_ckpt").fingerprint
        if expected_fingerprint and fp != expected_fingerprint:
            raise RuntimeError(f"train_ckpt fingerprint {fp} differs from the orchestrator's {expected_fingerprint}; "
                               "the data or the code changed under the run")
        log.info("train_ckpt %s: process %d of %d (pid %d), coordinator %s", fp, pid, n, os.getpid(), coordinator)
        res = train_run(pipe, self._messages.append if pid == 0 else None)  # process 0's metrics are relayed
        return {"process_id": pid, "fingerprint": res.fingerprint, "metadata": stage_metadata(res) if pid == 0 else None}


def run_on_ray(config_yaml: str, store_root: str, spec: RayTrainSpec, *, expected_fingerprint: str | None = None,
               on_event: Callable[[dict[str, Any]], None] | None = None, poll_seconds: float = 1.0) -> dict[str, Any]:
    """Train the run of ``config_yaml`` as ``spec.num_processes`` processes on the connected Ray
    cluster; process 0's result (``fingerprint``, ``metadata``). ``on_event`` gets
    ``{"type": "processes", ...}`` once and process 0's ``{"type": "metrics", ...}`` as they come."""
    ray = require_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    spec.validate()
    emit = on_event or (lambda event: None)
    n = spec.num_processes
    pg = placement_group([spec.bundle()] * n, strategy=spec.placement_strategy)
    actors: list = []
    try:
        ready, _ = ray.wait([pg.ready()], timeout=spec.start_timeout_s)
        if not ready:
            raise ClusterError(f"the Ray cluster did not grant {n} x {spec.bundle()} ({spec.placement_strategy}) within "
                               f"{spec.start_timeout_s:.0f} s: {ray.available_resources()} available")
        actor_cls = ray.remote(TrainProcess)
        for i in range(n):
            actors.append(actor_cls.options(
                num_cpus=spec.cpus_per_process, num_gpus=spec.gpus_per_process,
                resources=dict(spec.resources_per_process) or None, max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            ).remote(i, n))
        procs = ray.get([a.describe.remote() for a in actors])
        emit({"type": "processes", "processes": procs})
        coordinator = ray.get(actors[0].coordinator_address.remote()) if n > 1 else None
        refs = {a.train.remote(config_yaml, store_root, coordinator, expected_fingerprint): i for i, a in enumerate(actors)}

        def relay() -> None:
            try:
                for m in ray.get(actors[0].drain.remote(), timeout=max(5.0, poll_seconds)):
                    emit(m)
            except Exception:  # process 0 is gone or busy: the wait below tells which
                pass

        pending, results, failures = list(refs), {}, {}

        def collect(done) -> None:
            for ref in done:
                try:
                    results[refs[ref]] = ray.get(ref)
                except Exception as e:
                    failures[refs[ref]] = e

        while pending and not failures:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_seconds)
            collect(done)
            relay()
        if failures:
            # A process that dies takes its peers' collectives down with it, and a peer's error
            # may arrive first: wait a little for the death to be reported, and name it.
            deadline = time.monotonic() + 10.0
            while pending and not any(isinstance(e, ray.exceptions.RayActorError) for e in failures.values()) \
                    and time.monotonic() < deadline:
                done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
                collect(done)
            dead = sorted(i for i, e in failures.items() if isinstance(e, ray.exceptions.RayActorError))
            i = dead[0] if dead else min(failures)
            p, also = procs[i], sorted(set(failures) - {i})
            raise TrainProcessFailed(
                f"training process {i} of {n} (pid {p['pid']} on {p['ip']}) failed: {_first_line(failures[i])}"
                + (f" (process {', '.join(map(str, also))} failed too)" if also else "")
                + "; the other processes were stopped")
        relay()
        return {**results[0], "processes": procs}
    finally:
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        remove_placement_group(pg)


def _train_on_cluster(run: ChildRun) -> tuple[str, dict[str, Any]]:
    """The Ray job's training (a :func:`lm_pipeline.pipes_train.run_child` ``train``): :func:`run_on_ray`
    on the job's cluster, process 0's metrics and the processes' placement relayed through Pipes."""
    spec = RayTrainSpec.from_dict(run.extras["ray"])

    def on_event(m: dict[str, Any]) -> None:
        if m.get("type") == "metrics":
            run.report_metrics(m)
        elif m.get("type") == "processes":
            where = "; ".join(f"process {p['process_id']}: pid {p['pid']} on {p['ip']} (node {p['node_id'][:8]})"
                              for p in m["processes"])
            run.report(m, f"train_ckpt {run.fingerprint}: {len(m['processes'])} processes: {where}")
        else:
            run.report(m)

    ray = require_ray()
    ray.init(log_to_driver=True)  # inside a Ray job: the job's cluster
    result = run_on_ray(run.extras["config"], run.extras["store_root"], spec, expected_fingerprint=run.fingerprint,
                        on_event=on_event, poll_seconds=run.poll_seconds)
    md = dict(result["metadata"] or {})
    md["num_processes"] = spec.num_processes
    md["ray_processes"] = {"raw_value": result["processes"], "type": "json"}
    md["reported_by"] = f"ray job driver {os.getpid()} ({spec.num_processes} processes)"
    return result["fingerprint"], md


def main() -> int:
    """The Ray job's entrypoint: a Dagster Pipes child driving :func:`run_on_ray`."""
    from lm_pipeline.pipes_train import run_child

    # Pipes messages are lines on stdout, interleaved with the processes' forwarded logs: whole lines.
    sys.stdout.reconfigure(line_buffering=True)
    return run_child(_train_on_cluster, errors=(TrainProcessFailed, ClusterError), name=ENTRYPOINT_MODULE)


if __name__ == "__main__":
    raise SystemExit(main())
