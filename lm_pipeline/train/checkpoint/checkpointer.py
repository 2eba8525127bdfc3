"""The :class:`Checkpointer`: saves the train state by the keep policy, asynchronously, on every process.

``save`` returns once the arrays are in host memory; the write, the marker and the cleanup finish
in a background thread (``wait()`` joins it and re-raises its errors). In a multi-process run every
process calls ``save``/``wait``; Orbax writes each process's shards, process 0 writes the extra
files and, after every process reported its part written, the marker (:mod:`.commit`). On an
object store each process stages into its own local directory and uploads its own part (:mod:`.remote`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from lm_pipeline import atomic, fs
from lm_pipeline.faultpoints import faultpoint
from lm_pipeline.train.checkpoint.commit import TIMEOUT_S, MultiProcessCommit, log_on_primary
from lm_pipeline.train.checkpoint.discovery import latest_checkpoint, read_metadata
from lm_pipeline.train.checkpoint.flatten import new_pytree_handler, per_process_options, prepare_state
from lm_pipeline.train.checkpoint.integrity import file_digests
from lm_pipeline.train.checkpoint.marker import (
    BEST_DIR,
    MARKER,
    STATE_DIR,
    Kind,
    new_marker,
    read_marker,
    stamp_complete,
    step_dir_name,
    write_marker,
)
from lm_pipeline.train.checkpoint.policy import CheckpointerConfig
from lm_pipeline.train.checkpoint.remote import staging_dir, upload_state
from lm_pipeline.train.checkpoint.restore import load
from lm_pipeline.train.checkpoint.retention import materialize_best, prune

logger = logging.getLogger(__name__)

__all__ = ["Checkpointer", "ExtraFile"]

ExtraFile = str | bytes | os.PathLike


def _check_extra_files(extra_files: Mapping[str, ExtraFile] | None) -> dict[str, ExtraFile]:
    """Validated extra files: normalized relative names inside the step dir -> content or source."""
    out: dict[str, ExtraFile] = {}
    for name, value in (extra_files or {}).items():
        parts = name.replace("\\", "/").strip("/").split("/")
        if not name or os.path.isabs(name) or fs.scheme(name) or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"extra file name {name!r} must be a relative path inside the checkpoint dir")
        if parts[0] == MARKER or parts[0] == STATE_DIR or parts[0].startswith(STATE_DIR + "."):
            raise ValueError(f"extra file name {name!r} is reserved")
        if isinstance(value, os.PathLike):
            if not os.path.exists(value):
                raise FileNotFoundError(f"extra file {name!r}: source {os.fspath(value)!r} does not exist")
        elif not isinstance(value, (str, bytes)):
            raise TypeError(
                f"extra file {name!r}: expected str/bytes content or a pathlib.Path source, got {type(value).__name__}"
            )
        out["/".join(parts)] = value
    return out


def _write_extra_files(path: str, extras: Mapping[str, ExtraFile]) -> None:
    for name, value in extras.items():
        target = fs.join(path, *name.split("/"))
        if isinstance(value, os.PathLike):
            fs.put(value, target)
        else:
            atomic.atomic_write_bytes(target, value.encode() if isinstance(value, str) else value)


@dataclasses.dataclass
class _Save:
    """One save whose arrays are being written; finished by :meth:`Checkpointer._finish`."""

    step: int
    kind: Kind
    path: str
    marker: dict
    has_arrays: bool
    update_best: bool
    sync_key: str
    t0: float  # time.perf_counter() at the start of save()
    blocking_s: float = 0.0  # how long save() blocked training
    staging: str | None = None  # object stores: the local dir Orbax writes, uploaded when complete
    thread: threading.Thread | None = None
    error: BaseException | None = None


class Checkpointer:
    """Saves train-state checkpoints by the keep policy; loads them back.

    Args:
        config: the policy and location.
        base_path_override: write here instead of ``config.base_path`` (e.g. a run-specific dir).
        clock: wall clock in seconds for ``save_interval`` (injectable for tests).
        async_save: return from ``save`` once the arrays are copied to host memory; the write,
            the marker and the cleanup of older checkpoints finish in the background (``wait()``).

    All processes of a multi-process run must call ``maybe_save``/``save``/``wait`` together with
    the same arguments; Orbax coordinates the array writes, and process 0 writes the extra files
    and the marker once every process finished its part.
    """

    def __init__(
        self,
        config: CheckpointerConfig,
        base_path_override: str | os.PathLike | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        async_save: bool = True,
    ):
        config.validate()
        self.config = config
        base = base_path_override if base_path_override is not None else config.base_path
        if base is None:
            raise ValueError("Checkpointer needs a directory: set checkpointer.base_path or pass base_path_override")
        self.base_path = fs.norm(base)
        # Object store, several processes: each stages into its own local dir (no shared
        # filesystem needed, the processes may be on different hosts), see .remote. A choice of
        # Orbax's save mode, not a path operation fs could do for it: the one such branch here.
        self._per_process = not fs.is_local(self.base_path) and jax.process_count() > 1
        self._clock = clock
        self._interval = config.save_interval_seconds
        self._async = async_save
        self._last_save_time = clock()
        self._orbax: Any = None
        self._pending: _Save | None = None
        self._counter = 0
        self._best_loss: float | None = None
        self._best_loaded = False
        self._commit = MultiProcessCommit()

    # ---------------------------------------------------------------- policy

    def maybe_save(
        self,
        step: int,
        state: Any,
        *,
        force: bool = False,
        extra_files: Mapping[str, ExtraFile] | None = None,
        metadata: Mapping[str, Any] | None = None,
        eval_loss: float | None = None,
        before_save: Callable[[], None] | None = None,
    ) -> str | None:
        """Save if the policy asks for it at ``step``; returns the checkpoint dir or None.

        Call after step ``step`` has been applied. Permanent: ``force`` or the keep rules;
        temporary: ``save_interval`` elapsed since the last save, or (``keep_best``) an
        ``eval_loss`` lower than any before. ``before_save`` runs first when a save is due (the
        trainer uploads its metrics log there, so the checkpoint never gets ahead of it).
        """
        step = int(step)
        kind: Kind | None = None
        if force or self.config.is_permanent_step(step):
            kind = "permanent"
        elif self._clock() - self._last_save_time >= self._interval or self._improves_best(eval_loss):
            kind = "temporary"
        if kind is None:
            return None
        if before_save is not None:
            before_save()
        return self.save(step, state, kind, extra_files=extra_files, metadata=metadata, eval_loss=eval_loss)

    def _improves_best(self, eval_loss: float | None) -> bool:
        if not self.config.keep_best or eval_loss is None or not math.isfinite(float(eval_loss)):
            return False
        if not self._best_loaded:
            marker = read_marker(fs.join(self.base_path, BEST_DIR))
            loss = marker.get("eval_loss") if marker else None
            self._best_loss = float(loss) if isinstance(loss, (int, float)) else None
            self._best_loaded = True
        return self._best_loss is None or float(eval_loss) < self._best_loss

    # ---------------------------------------------------------------- save

    def save(
        self,
        step: int,
        state: Any,
        kind: Kind = "permanent",
        *,
        extra_files: Mapping[str, ExtraFile] | None = None,
        metadata: Mapping[str, Any] | None = None,
        eval_loss: float | None = None,
    ) -> str:
        """Write a checkpoint of ``state`` at ``step`` now; returns its dir ``<base>/step-<N>``.

        ``extra_files`` maps names inside the step dir to content (str/bytes) or to a local
        file/directory to copy (``pathlib.Path``). ``metadata`` (JSON-able) goes into the marker.
        If a complete checkpoint of this step exists, it is kept (a temporary one is promoted to
        permanent if asked) and no arrays are written.
        """
        if kind not in ("permanent", "temporary"):
            raise ValueError(f"kind must be 'permanent' or 'temporary', got {kind!r}")
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        extras = _check_extra_files(extra_files)
        user_meta = dict(metadata or {})
        json.dumps(user_meta, allow_nan=False)  # fail now, not in the background
        self.wait()
        t0 = time.perf_counter()
        self._last_save_time = self._clock()
        self._counter += 1
        loss = None if eval_loss is None else float(eval_loss)
        update_best = self._improves_best(loss)
        if update_best:
            self._best_loss = loss
        path = fs.join(self.base_path, step_dir_name(step))

        existing = read_marker(path)
        if existing is not None:
            self._keep_existing(step, path, existing, kind, loss, update_best)
            return path
        flat, arrays = prepare_state(state)
        self._prepare_dir(path, step, extras)
        faultpoint("checkpoint.before_arrays")  # the step dir and its extra files exist
        staging = None
        if flat:
            staging = self._start_array_write(path, flat)
        blocking_s = time.perf_counter() - t0
        marker = new_marker(step, kind, eval_loss=loss, arrays=arrays, extra_files=list(extras), metadata=user_meta)
        if self._per_process:
            marker["state"]["format"] = "orbax-pytree-zarr3"  # one chunk file per shard, no OCDBT (.remote)
        job = _Save(step=step, kind=kind, path=path, marker=marker, has_arrays=bool(flat), update_best=update_best,
                    sync_key=f"lm_pipeline_checkpoint_{step}_{self._counter}", t0=t0, blocking_s=blocking_s,
                    staging=staging)
        if self._async:
            self._finish_in_background(job)
        else:
            self._finish(job)
        return path

    def _keep_existing(self, step: int, path: str, marker: dict, kind: Kind, loss: float | None,
                       update_best: bool) -> None:
        """Every process: process 0 updates the complete checkpoint at ``path``; all then sync."""
        import orbax.checkpoint as ocp

        if jax.process_index() == 0:
            self._reuse_existing(path, marker, kind, loss, update_best)
        ocp.multihost.sync_global_processes(f"lm_pipeline_checkpoint_reuse_{step}_{self._counter}")

    def _prepare_dir(self, path: str, step: int, extras: Mapping[str, ExtraFile]) -> None:
        """Every process: process 0 makes a fresh step dir holding the extra files; all then sync."""
        import orbax.checkpoint as ocp

        # every process, before the barrier: no array is written yet (a local checkpoint has none)
        shutil.rmtree(staging_dir(path, self._counter, jax.process_index()), ignore_errors=True)
        if jax.process_index() == 0:
            if fs.exists(path):
                logger.warning("checkpoint: removing incomplete %s before saving step %d", path, step)
                fs.rmtree(path)
            fs.makedirs(path)
            _write_extra_files(path, extras)
        ocp.multihost.sync_global_processes(f"lm_pipeline_checkpoint_prepare_{step}_{self._counter}")

    def _start_array_write(self, path: str, flat: dict[str, Any]) -> str | None:
        """Copy this process's shards to host memory and start writing them (Orbax, async).

        On an object store Orbax writes into a local staging dir (returned; one per process),
        which each process uploads its part of when complete (:mod:`.remote`); the marker is
        written after every part."""
        import orbax.checkpoint as ocp

        if self._orbax is None:
            if self._per_process:
                self._orbax = ocp.AsyncCheckpointer(new_pytree_handler(per_process=True), timeout_secs=TIMEOUT_S,
                                                    multiprocessing_options=per_process_options())
            else:
                self._orbax = ocp.AsyncCheckpointer(new_pytree_handler(), timeout_secs=TIMEOUT_S)
        # Orbax writes a local directory: the step dir itself, or a staging dir (emptied) uploaded when complete
        local = fs.as_local(path)
        staging = None if local is not None else staging_dir(path, self._counter, jax.process_index())
        target = os.path.join(local or staging, STATE_DIR)
        self._orbax.save(target, args=ocp.args.PyTreeSave(flat))
        return staging

    def _finish_in_background(self, job: _Save) -> None:
        def run() -> None:
            try:
                self._finish(job)
            except BaseException as e:  # surfaced by wait()
                job.error = e
                logger.exception("checkpoint: saving step %d to %s failed", job.step, job.path)

        job.thread = threading.Thread(target=run, name=f"checkpoint-step-{job.step}", daemon=False)
        self._pending = job
        job.thread.start()

    def _finish(self, job: _Save) -> None:
        """Every process: wait for its array write, then commit (process 0 writes the marker)."""
        local_error: BaseException | None = None
        uploaded: dict[str, dict] = {}
        try:
            if job.has_arrays:
                self._orbax.wait_until_finished()
                if job.staging is not None:  # object store: the arrays are complete locally; upload them
                    uploaded = upload_state(job.staging, STATE_DIR, fs.join(job.path, STATE_DIR), jax.process_index())
        except BaseException as e:
            local_error = e
        removed: list[str] = []
        try:
            if jax.process_index() != 0:
                self._commit.follow(job.sync_key, job.path, local_error, uploaded)
            else:
                removed = self._commit.lead(job.sync_key, job.path, local_error,
                                            lambda reported: self._complete(job, uploaded, reported))
        finally:
            if job.staging is not None:
                shutil.rmtree(job.staging, ignore_errors=True)
        log_on_primary(
            logger,
            "checkpoint: saved step %d (%s) to %s in %.2fs (training blocked %.2fs)%s",
            job.step, job.kind, job.path, time.perf_counter() - job.t0, job.blocking_s,
            f"; removed {', '.join(removed)}" if removed else "",
        )

    def _complete(self, job: _Save, uploaded: dict[str, dict] | None = None,
                  reported: dict[int, dict[str, dict]] | None = None) -> list[str]:
        """Process 0, every part written: the marker, then ``best/``, then pruning (what was removed).

        ``uploaded``: the files process 0 uploaded; ``reported``: process -> the files it uploaded
        (relative path -> size, sha256). Every one must be on the store with its size."""
        known = dict(uploaded or {})
        for part in (reported or {}).values():
            known.update(part)
        files = file_digests(job.path, job.staging, known)  # what resuming checks before trusting it
        missing = [f"{rel} (process {p})" for p, part in sorted((reported or {}).items()) for rel, want in
                   sorted(part.items()) if files.get(rel, {}).get("size") != want["size"]]
        if missing:
            raise RuntimeError(f"checkpoint {job.path}: uploaded parts missing or of another size on the store: "
                               f"{', '.join(missing[:5])}")
        job.marker["files"] = files
        stamp_complete(job.marker)
        faultpoint("checkpoint.before_marker")  # arrays written, marker not yet
        self._write_marker(job.path, job.marker)
        faultpoint("checkpoint.after_marker")  # the checkpoint is complete and found from now on
        if job.update_best:
            materialize_best(self.base_path, job.path, job.marker)
        return prune(self.base_path, job.step, job.path, self.config.keep_last)

    def wait(self) -> None:
        """Block until the last save is complete (marker written, old checkpoints cleaned up)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.thread is not None:
            pending.thread.join()
        if pending.error is not None:
            raise RuntimeError(f"checkpoint save of step {pending.step} to {pending.path} failed") from pending.error

    def close(self) -> None:
        """Wait for the last save and release Orbax's resources."""
        try:
            self.wait()
        finally:
            if self._orbax is not None:
                self._orbax.close()
                self._orbax = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------- load / discovery

    def latest_checkpoint(self, path: str | os.PathLike | None = None) -> str | None:
        """See :func:`~.discovery.latest_checkpoint`; defaults to this checkpointer's base path."""
        return latest_checkpoint(self.base_path if path is None else path)

    def load(self, path: str | os.PathLike, abstract_state: Any, **kwargs: Any) -> Any:
        """See :func:`~.restore.load`. Waits for an in-flight save first."""
        self.wait()
        return load(path, abstract_state, **kwargs)

    def read_metadata(self, path: str | os.PathLike) -> dict:
        """See :func:`~.discovery.read_metadata`."""
        return read_metadata(path)

    # ---------------------------------------------------------------- process 0

    def _write_marker(self, path: str, marker: dict) -> None:
        # A method, so that tests can hold or fail one checkpointer's commit point.
        write_marker(path, marker)

    def _reuse_existing(self, path: str, marker: dict, kind: Kind, loss: float | None, update_best: bool) -> None:
        changed = []
        if kind == "permanent" and marker.get("kind") != "permanent":
            marker["kind"] = "permanent"
            changed.append("promoted to permanent")
        if loss is not None and marker.get("eval_loss") is None:
            marker["eval_loss"] = loss
            changed.append("eval_loss recorded")
        if changed:
            self._write_marker(path, marker)
        if update_best:
            materialize_best(self.base_path, path, marker)
            changed.append("copied to best/")
        removed = prune(self.base_path, marker["step"], path, self.config.keep_last)
        if removed:
            changed.append(f"removed {', '.join(removed)}")
        log_on_primary(logger, "checkpoint: step %d already complete at %s%s", marker["step"], path,
                       f" ({', '.join(changed)})" if changed else "")
