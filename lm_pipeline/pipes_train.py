"""Training as a child of a Dagster step, reporting through Pipes: ``python -m lm_pipeline.pipes_train``.

:func:`run_child` is the child side of every training a step launches outside its own process
(the parent side is ``assets.launch``): this module's ``main`` (its own process) and the Ray job's
driver (:mod:`lm_pipeline.cluster.ray_train`) both call it with the function that trains. The
parent passes, as Pipes extras:

* ``config``: the run config as YAML (the experiment, with the resources' non-semantic overrides);
* ``store_root``: the artifact store root;
* ``expected_fingerprint``: the ``train_ckpt`` fingerprint the orchestrator computed (the process
  refuses to train anything else);
* ``asset_key``: the training asset's key as a string (``<experiment>/train_ckpt`` or
  ``shared/train_ckpt``; default ``train_ckpt``);
* ``poll_seconds``: how often the run directory is watched for new checkpoints.

While training, the child reports back through Pipes:

* every complete checkpoint as it lands (a custom message ``{"type": "checkpoint", "step", "path",
  "kind", "run_fingerprint"}``; the asset turns it into an observation of ``train_ckpt``);
* metrics every ``trainer.log_every`` steps (a log line and a custom message ``{"type": "metrics"}``);
* at the end, the materialization of ``train_ckpt`` with its data version (= its fingerprint)
  and the final metrics.

The training resumes from the run's latest checkpoint, so a retried (or preempted) run continues
rather than starting over. Being a separate process, it can get tcmalloc via ``LD_PRELOAD`` and
its own ``JAX_PLATFORMS``.

Fault injection (tests) goes through :mod:`lm_pipeline.faultpoints`: the fault point
``train_ckpt.after_step`` is passed after every training step (:func:`train_run`, wherever it
runs), and waits for a complete checkpoint before it fires, so that a retry has one to resume
from; e.g. ``LM_PIPELINE_FAULTPOINT=train_ckpt.after_step:5`` with ``LM_PIPELINE_FAULTPOINT_ONCE=<file>``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lm_pipeline.faultpoints import armed, faultpoint
from lm_pipeline.steps import complete_checkpoints

log = logging.getLogger(__name__)

#: The fault point passed after each training step (see the module docstring).
FAULT_POINT = "train_ckpt.after_step"


class CheckpointWatcher:
    """Reports each complete checkpoint of a run directory once, in step order."""

    def __init__(self, run_dir: str, on_new: Callable[[dict[str, Any]], None] | None = None):
        self.run_dir = run_dir
        self.on_new = on_new
        self.seen: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> list[dict[str, Any]]:
        """Checkpoints completed since the last poll."""
        with self._lock:
            new = [c for c in complete_checkpoints(self.run_dir) if c["path"] not in self.seen]
            for c in new:
                self.seen.add(c["path"])
                if self.on_new is not None:
                    self.on_new(c)
            return new

    def start(self, interval: float = 1.0) -> CheckpointWatcher:
        def loop():
            while not self._stop.wait(interval):
                try:
                    self.poll()
                except Exception as e:  # a listing hiccup must not kill training
                    log.warning("checkpoint watcher: %s", e)

        self._thread = threading.Thread(target=loop, name="checkpoint-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        return self.poll()


def fault_hooks(run_dir: str) -> list:
    """A hook passing the fault point :data:`FAULT_POINT` after every step, when a test armed it
    (else none); before it fires it waits (up to 120 s) for a complete checkpoint of the run."""
    if not armed(FAULT_POINT):
        return []
    from lm_pipeline.train.trainer import Hook

    def wait_for_checkpoint() -> None:
        deadline = time.monotonic() + 120
        while not complete_checkpoints(run_dir) and time.monotonic() < deadline:
            time.sleep(0.1)  # the checkpoint is written in the background

    def fn(info):
        faultpoint(FAULT_POINT, prepare=wait_for_checkpoint)

    return [Hook(fn, every=1)]


def metrics_message(info) -> dict[str, Any] | None:
    """The Pipes message of a training step's metrics (``{"type": "metrics", "step", "metrics"}``;
    numbers only), or None when the step has none."""
    metrics = {k: float(v) for k, v in (info.metrics or {}).items() if isinstance(v, (int, float))}
    return {"type": "metrics", "step": int(info.step), "metrics": metrics} if metrics else None


def metrics_line(message: Mapping[str, Any]) -> str:
    """A metrics message as one log line: ``step N: train/loss=..., eval/...``."""
    shown = ", ".join(f"{k}={v:.4g}" for k, v in message["metrics"].items() if k.startswith(("train/", "eval/")))
    return f"step {message['step']}: {shown}"


def train_run(pipe, on_metrics: Callable[[dict[str, Any]], None] | None = None):
    """Train ``pipe``'s run (resuming from its latest checkpoint): ``on_metrics`` gets each metrics
    message (:func:`metrics_message`, every ``trainer.log_every`` steps); the fault hooks of
    :func:`fault_hooks` are passed. Returns the ``train_ckpt`` stage result."""
    from lm_pipeline.train.trainer import Hook

    hooks = []
    if on_metrics is not None:
        def report(info) -> None:
            message = metrics_message(info)
            if message is not None:
                on_metrics(message)

        hooks.append(Hook(report, every=pipe.cfg.trainer.log_every))
    return pipe.train_ckpt(hooks=[*hooks, *fault_hooks(pipe.run_dir())])


def stage_metadata(res) -> dict[str, Any]:
    """Pipes metadata (plain values) of a finished train_ckpt stage."""
    summary = res.manifest.get("summary", {})
    md: dict[str, Any] = {
        "path": {"raw_value": res.path, "type": "path"},
        "fingerprint": res.fingerprint,
        "cache_hit": res.hit,
    }
    for k, v in summary.items():
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, (int, float)):
            md[k] = v
    for k in ("final_checkpoint", "resumed_from"):
        if summary.get(k):
            md[k] = {"raw_value": summary[k], "type": "path"}
    md["num_checkpoints"] = len(res.manifest.get("checkpoints") or [])
    return md


@dataclass
class ChildRun:
    """The run a Pipes child trains: its pipeline (from the extras), and reports to the parent."""

    pipes: Any  # dagster_pipes.PipesContext
    pipe: Any  # lm_pipeline.steps.Pipeline
    fingerprint: str
    poll_seconds: float
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def extras(self) -> Mapping[str, Any]:
        return self.pipes.extras

    def report(self, message: Mapping[str, Any], line: str | None = None) -> None:
        """Send ``message`` to the parent (and log ``line``); safe from any thread."""
        with self._lock:  # the checkpoint watcher's thread and the training both report
            self.pipes.report_custom_message(dict(message))
            if line:
                self.pipes.log.info(line)

    def report_checkpoint(self, c: Mapping[str, Any]) -> None:
        self.report({"type": "checkpoint", "run_fingerprint": self.fingerprint, **c},
                    f"checkpoint step {c['step']} ({c['kind']}) complete: {c['path']}")

    def report_metrics(self, message: Mapping[str, Any]) -> None:
        self.report(message, metrics_line(message))


def line_safe_writer():
    """Dagster Pipes' default message writer, except that a message written to stdout/stderr is
    one ``write`` of its own line, a newline before it too. Other threads of the process write to
    the same stream (Ray forwards its workers' log lines to a job's driver, each as a ``write`` of
    the text and another of the newline); a message appended to a partial line of theirs is read
    as a log line, not a message, and was lost (a checkpoint never observed)."""
    import contextlib
    import json

    from dagster_pipes import PipesDefaultMessageWriter, PipesMessageWriterChannel

    class LineChannel(PipesMessageWriterChannel):
        def __init__(self, stream):
            self._stream = stream

        def write_message(self, message) -> None:
            self._stream.write("\n" + json.dumps(message) + "\n")
            self._stream.flush()

    class LineSafeWriter(PipesDefaultMessageWriter):
        @contextlib.contextmanager
        def open(self, params):
            stream = params.get(self.STDIO_KEY)
            if self.FILE_PATH_KEY not in params and stream in (self.STDOUT, self.STDERR):
                yield LineChannel(sys.stdout if stream == self.STDOUT else sys.stderr)
            else:
                with super().open(params) as channel:
                    yield channel

    return LineSafeWriter()


def run_child(train: Callable[[ChildRun], tuple[str, dict[str, Any]]], *,
              errors: tuple[type[BaseException], ...] = (), name: str = __name__) -> int:
    """The child side of a training launched through Dagster Pipes (the parent: ``assets.launch``).

    Reads the run from the Pipes extras (refusing a run whose fingerprint differs from the
    parent's), reports each complete checkpoint of the run as it lands, calls ``train`` (which
    returns the data version and the metadata of the run) and reports the materialization of the
    training asset. ``errors``: exceptions that end the child with status 1 and one line on stderr,
    ``<name>: <message>`` (the parent shows it), rather than a traceback. Returns the exit status."""
    import yaml
    from dagster_pipes import open_dagster_pipes

    from lm_pipeline.config import RunConfig
    from lm_pipeline.schema import from_dict
    from lm_pipeline.steps import Pipeline
    from lm_pipeline.store import open_store

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with open_dagster_pipes(message_writer=line_safe_writer()) as pipes:
        extras = pipes.extras
        cfg = from_dict(RunConfig, yaml.safe_load(extras["config"]))
        pipe = Pipeline(cfg, open_store(extras["store_root"]), progress=False)
        fp = pipe.address("train_ckpt").fingerprint
        expected = extras.get("expected_fingerprint")
        if expected and fp != expected:
            raise RuntimeError(f"train_ckpt fingerprint {fp} differs from the orchestrator's {expected}; "
                               "the data or the code changed under the run")
        run = ChildRun(pipes, pipe, fp, float(extras.get("poll_seconds", 1.0)))
        pipes.log.info(f"train_ckpt {fp}: run dir {pipe.run_dir()} (pid {os.getpid()}, "
                       f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}, JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r})")
        watcher = CheckpointWatcher(pipe.run_dir(), run.report_checkpoint).start(run.poll_seconds)
        try:
            data_version, metadata = train(run)
        except errors as e:
            pipes.log.error(str(e))
            print(f"{name}: {e}", file=sys.stderr, flush=True)
            return 1
        finally:
            watcher.stop()
        pipes.report_asset_materialization(asset_key=extras.get("asset_key") or "train_ckpt", metadata=metadata,
                                           data_version=data_version)
    return 0


def _train_here(run: ChildRun) -> tuple[str, dict[str, Any]]:
    res = train_run(run.pipe, run.report_metrics)
    return res.fingerprint, {**stage_metadata(res), "reported_by": f"pipes process {os.getpid()}"}


def main() -> int:
    return run_child(_train_here)


if __name__ == "__main__":
    raise SystemExit(main())
