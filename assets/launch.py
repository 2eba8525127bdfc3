"""Launching a training run from its asset, its checkpoints streamed back as they land.

:func:`train` runs a ``train_ckpt`` one of three ways, as the ``training`` resource says:

* ``in_process``: on a thread of the step's process (tests, notebooks);
* ``pipes``: its own process, ``python -m lm_pipeline.pipes_train``, through Dagster Pipes;
* ``ray``: one Ray job (``python -m lm_pipeline.cluster.ray_train`` on the cluster) running the
  run as ``ray_num_processes`` processes of one ``jax.distributed`` job. The Pipes context goes in
  the job's environment; messages come back in the job's log, tailed by dagster-ray's
  ``PipesRayJobMessageReader`` (as its ``PipesRayJobClient`` does; here the step also polls, to
  report each checkpoint as it lands).

Each way is a :class:`Launch`, driven by the one loop of :func:`train`: started, polled until it
is done (each new complete checkpoint becomes an observation of the training asset, which
``new_checkpoint_sensor`` turns into an evaluation), stopped when the step is interrupted, then
asked for its result. A failed child fails the step with a retryable failure; the retry resumes
from the run's latest checkpoint. Both Pipes children run :func:`lm_pipeline.pipes_train.run_child`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Generator, Mapping
from typing import Any

import dagster as dg

from assets.checkpoints import checkpoint_observation
from resources import ArtifactStoreResource, JaxRuntimeResource, TrainingLauncherResource

#: What a failed launch's step failure ends with (the step is retried).
RETRY_NOTE = "a retry resumes from the latest checkpoint"


def tail_whole_lines(path: str, should_stop) -> Generator[str, None, None]:
    """The lines appended to the file at ``path`` as they are written, each whole: a line the
    writer has not finished (no newline yet) is held back until it is. Ends once ``should_stop()``
    is true and the file has nothing more (a last line without a newline is then given as it is)."""
    pending = ""
    with open(path, encoding="utf-8") as f:
        while True:
            chunk = f.readline()
            if chunk:
                pending += chunk
                if pending.endswith("\n"):
                    yield pending
                    pending = ""
                continue
            if should_stop():
                if pending.strip():
                    yield pending
                return
            time.sleep(0.01)


class WholeLineFileMessageReader(dg.PipesFileMessageReader):
    """Pipes' file message reader, reading whole lines only. Dagster's own tail hands a line that
    the child is still writing to ``json.loads``; the error ends its reader thread and every later
    message is lost (a finished training run then reported no materialization and was retried)."""

    def _reader_thread(self, handler, is_resource_complete) -> None:
        try:
            for line in tail_whole_lines(self._path, is_resource_complete.is_set):
                handler.handle_message(json.loads(line))
        except:  # noqa: E722 - as Dagster's reader: report, then end the thread
            handler.report_pipes_framework_exception(f"{self.__class__.__name__} reader thread", sys.exc_info())
            raise


class WholeLineTempFileMessageReader(dg.PipesTempFileMessageReader):
    """:class:`WholeLineFileMessageReader` on a temporary file, as ``dg.PipesTempFileMessageReader``."""

    @contextlib.contextmanager
    def read_messages(self, handler):
        with tempfile.TemporaryDirectory() as tempdir, WholeLineFileMessageReader(
                os.path.join(tempdir, "messages"), include_stdio_in_messages=self._include_stdio_in_messages,
        ).read_messages(handler) as params:
            yield params


class Launch:
    """One way of running a training (see :func:`train`, which drives it)."""

    def session(self) -> contextlib.AbstractContextManager:
        """What must stay open while the training runs (closed before the last checkpoints are read)."""
        return contextlib.nullcontext()

    def start(self) -> None:
        raise NotImplementedError

    def done(self) -> bool:
        """Whether the training has ended (well or not)."""
        raise NotImplementedError

    def checkpoints(self) -> list[Mapping[str, Any]]:
        """The complete checkpoints reported since the last call (``step``, ``path``, ``kind``)."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop the training: the step was interrupted."""

    def result(self) -> tuple[Any, dict[str, Any]]:
        """(the ``train_ckpt`` stage result, metadata the training reported) once done; a failed
        training raises a retryable :class:`dagster.Failure`."""
        raise NotImplementedError


def train(context, asset: dg.AssetKey, pipe, *, store: ArtifactStoreResource, training: TrainingLauncherResource,
          jax_runtime: JaxRuntimeResource) -> Generator[dg.AssetObservation, None, tuple[Any, dict[str, Any]]]:
    """Train ``pipe``'s run (its config carries the runtime overrides) the way ``training.mode``
    says, yielding an observation of ``asset`` for each complete checkpoint as it lands, polled
    every ``training.poll_seconds``. Returns (the stage result, the training's own metadata)."""
    fp = pipe.address("train_ckpt").fingerprint
    kinds = {"in_process": InProcess, "pipes": PipesSubprocess, "ray": RayJob}
    launch = kinds[training.mode](context, asset, pipe, store, training, jax_runtime)

    def observations() -> list[dg.AssetObservation]:
        return [checkpoint_observation(asset, c, str(c.get("run_fingerprint") or fp)) for c in launch.checkpoints()]

    with launch.session():
        launch.start()
        try:
            while True:
                done = launch.done()
                yield from observations()
                if done:
                    break
                time.sleep(training.poll_seconds)
        except BaseException:  # interrupted or terminated: stop the training too
            launch.stop()
            raise
    yield from observations()
    return launch.result()


class InProcess(Launch):
    """The training on a thread of this process; checkpoints found by watching the run directory."""

    def __init__(self, context, asset, pipe, store, training, jax_runtime):
        from lm_pipeline.pipes_train import CheckpointWatcher

        self.context, self.pipe = context, pipe
        self.watcher = CheckpointWatcher(pipe.run_dir())
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="train")

    def session(self) -> concurrent.futures.ThreadPoolExecutor:
        return self.pool  # a thread cannot be stopped: leaving waits for it

    def start(self) -> None:
        from lm_pipeline.pipes_train import metrics_line, train_run

        self.future = self.pool.submit(train_run, self.pipe, lambda m: self.context.log.info(metrics_line(m)))

    def done(self) -> bool:
        return self.future.done()

    def checkpoints(self) -> list[Mapping[str, Any]]:
        return self.watcher.poll()

    def result(self) -> tuple[Any, dict[str, Any]]:
        return self.future.result(), {}


class PipesLaunch(Launch):
    """A training in a Pipes child (:func:`lm_pipeline.pipes_train.run_child`): the extras it
    reads, the session, its checkpoint messages and the materialization it reports."""

    def __init__(self, context, asset: dg.AssetKey, pipe, store: ArtifactStoreResource,
                 training: TrainingLauncherResource, jax_runtime: JaxRuntimeResource):
        from lm_pipeline.config import dump_config

        self.context, self.pipe, self.training, self.jax_runtime = context, pipe, training, jax_runtime
        self.fingerprint = pipe.address("train_ckpt").fingerprint
        self.extras: dict[str, Any] = {
            "config": dump_config(pipe.cfg), "store_root": store.root, "expected_fingerprint": self.fingerprint,
            "asset_key": asset.to_user_string(), "poll_seconds": training.poll_seconds,
            "attempt": context.retry_number}
        self.seen = 0  # custom messages already read

    def injector_and_reader(self) -> tuple[dg.PipesContextInjector, dg.PipesMessageReader]:
        raise NotImplementedError

    def failure(self) -> str | None:
        """Why the child failed, in one line; None when it succeeded."""
        raise NotImplementedError

    def session(self) -> contextlib.ExitStack:
        self.t0 = time.perf_counter()
        stack = contextlib.ExitStack()
        injector, reader = self.injector_and_reader()
        with warnings.catch_warnings():  # Pipes' message handler uses a preview API internally
            warnings.filterwarnings("ignore", message=r".*expected_writer_count")
            self.pipes = stack.enter_context(dg.open_pipes_session(
                context=self.context, context_injector=injector, message_reader=reader, extras=self.extras))
        return stack

    def checkpoints(self) -> list[Mapping[str, Any]]:
        msgs = self.pipes.get_custom_messages()
        new = [m for m in msgs[self.seen:] if isinstance(m, Mapping) and m.get("type") == "checkpoint"]
        self.seen = len(msgs)
        return new

    def result(self) -> tuple[Any, dict[str, Any]]:
        why = self.failure()
        if why is not None:
            raise dg.Failure(f"{why}; {RETRY_NOTE}", allow_retries=True)
        fp = self.fingerprint
        reported = [r for r in self.pipes.get_reported_results() if isinstance(r, dg.MaterializeResult)]
        if not reported:
            raise dg.Failure("the training process reported no materialization of train_ckpt")
        got = reported[-1].data_version.value if reported[-1].data_version else None
        if got != fp:
            raise dg.Failure(f"the training process reported data version {got}, expected {fp}")
        res = self.pipe.cached("train_ckpt")
        if res is None:
            raise dg.Failure(f"train_ckpt {fp}: the process finished but the artifact has no manifest")
        child = dict(reported[-1].metadata)
        res.hit = bool(child["cache_hit"].value) if "cache_hit" in child else False
        res.seconds = time.perf_counter() - self.t0  # the orchestrator's wall time, process start included
        return res, child  # what the process reported (metrics, checkpoints) joins the materialization


class PipesSubprocess(PipesLaunch):
    """``python -m lm_pipeline.pipes_train`` (the resource's command) as a child process."""

    def injector_and_reader(self):
        return dg.PipesTempFileContextInjector(), WholeLineTempFileMessageReader()

    def start(self) -> None:
        command = self.training.command()
        env = {**os.environ, **self.training.child_env(), **self.jax_runtime.env(), **self.pipes.get_bootstrap_env_vars()}
        self.context.log.info(f"train_ckpt {self.fingerprint}: launching {' '.join(command)} through Pipes"
                              + (f" (LD_PRELOAD={env['LD_PRELOAD']})" if env.get("LD_PRELOAD") else ""))
        self.proc = subprocess.Popen(command, env=env, cwd=os.getcwd())
        self.rc: int | None = None

    def done(self) -> bool:
        self.rc = self.proc.poll()
        return self.rc is not None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def failure(self) -> str | None:
        return None if self.rc == 0 else f"training process exited with code {self.rc}"


class RayJob(PipesLaunch):
    """One Ray job on the resource's cluster; a job of an earlier attempt still running is stopped first."""

    def __init__(self, context, asset, pipe, store, training, jax_runtime):
        super().__init__(context, asset, pipe, store, training, jax_runtime)
        self.spec = training.ray_spec()
        self.client = training.ray_job_client()  # unreachable: one line, before anything runs
        _stop_earlier_jobs(context, self.client, self.fingerprint)
        self.extras["ray"] = self.spec.to_dict()
        self.job_id = (f"lm-pipeline-train-{self.fingerprint}-{context.run_id[:8]}-{context.retry_number}-"
                       f"{os.urandom(3).hex()}")

    def injector_and_reader(self):
        from dagster_ray.core.pipes import PipesRayJobMessageReader

        return dg.PipesEnvContextInjector(), PipesRayJobMessageReader()

    def start(self) -> None:
        from dagster_ray.core.pipes import (
            PIPES_LAUNCHED_EXTRAS_RAY_ADDRESS_KEY,
            PIPES_LAUNCHED_EXTRAS_RAY_JOB_ID_KEY,
        )

        context, client, fp, job_id = self.context, self.client, self.fingerprint, self.job_id
        env = {**self.jax_runtime.env(), "PYTHONUNBUFFERED": "1", **self.pipes.get_bootstrap_env_vars()}
        client.submit_job(entrypoint=self.training.ray_entrypoint(), submission_id=job_id, entrypoint_num_cpus=0,
                          runtime_env=self.training.ray_job_runtime_env(env),
                          metadata={"dagster_run_id": context.run_id, "dagster_asset": self.extras["asset_key"],
                                    "train_ckpt": fp, "attempt": str(context.retry_number)})
        self.pipes.report_launched({"extras": {PIPES_LAUNCHED_EXTRAS_RAY_JOB_ID_KEY: job_id,
                                               PIPES_LAUNCHED_EXTRAS_RAY_ADDRESS_KEY: client.get_address()}})
        context.log.info(f"train_ckpt {fp}: Ray job {job_id} submitted to {client.get_address()} "
                         f"({self.spec.num_processes} processes x {self.spec.bundle()}, {self.spec.placement_strategy})")

    def done(self) -> bool:
        self.status = self.client.get_job_status(self.job_id)
        return self.status.is_terminal()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.client.stop_job(self.job_id)

    def failure(self) -> str | None:
        from ray.job_submission import JobStatus

        if self.status == JobStatus.SUCCEEDED:
            return None
        return f"Ray job {self.job_id} {self.status.value}: {_ray_job_reason(self.client, self.job_id)}"

    def result(self) -> tuple[Any, dict[str, Any]]:
        res, child = super().result()
        child["ray_job_id"] = dg.MetadataValue.text(self.job_id)
        return res, child


def _stop_earlier_jobs(context, client, fp: str, timeout: float = 120.0) -> None:
    """Stop any job of this run still on the cluster (an attempt whose Dagster process died
    without stopping it): two jobs must never write one run's checkpoints."""
    try:
        stale = [j for j in client.list_jobs()
                 if (j.metadata or {}).get("train_ckpt") == fp and not j.status.is_terminal()]
    except Exception as e:  # listing is a precaution; the submission below reports real trouble
        context.log.warning(f"could not list the cluster's jobs: {e}")
        return
    for job in stale:
        context.log.warning(f"stopping Ray job {job.submission_id}: an earlier attempt at train_ckpt {fp}, still running")
        client.stop_job(job.submission_id)
    deadline = time.monotonic() + timeout
    for job in stale:
        while not client.get_job_status(job.submission_id).is_terminal():
            if time.monotonic() > deadline:
                raise dg.Failure(f"Ray job {job.submission_id} (an earlier attempt at train_ckpt {fp}) did not stop "
                                 f"within {timeout:.0f} s", allow_retries=True)
            time.sleep(1.0)


def _ray_job_reason(client, job_id: str) -> str:
    """Why a Ray job failed, in one line: the driver's own last word, else Ray's message."""
    from lm_pipeline.cluster.ray_train import ENTRYPOINT_MODULE

    try:
        lines = client.get_job_logs(job_id).splitlines()
        said = [ln.split(": ", 1)[1] for ln in lines if ln.startswith(f"{ENTRYPOINT_MODULE}: ")]
        if said:
            return said[-1]
        message = (client.get_job_info(job_id).message or "").strip().splitlines()
        return message[-1] if message else "no message"
    except Exception as e:  # the reason is a courtesy; the failure stands
        return f"(reason unavailable: {e})"
