"""Runs whose process is gone give their pool slots back.

A step in a pool (``lm_pipeline_training``, ``lm_pipeline_evaluation``; one slot each by default,
see ``assets/dagster.yaml``) holds a slot of it while it runs, and the run's process gives the slot
back when the step ends. A run whose process is killed (SIGKILL, the OOM killer, a lost terminal)
never does: the run stays STARTED and the slot stays taken, so every later step in that pool waits
("Step blocked by limit for pool ..."), forever. Dagster's run monitoring (a daemon) cannot see
that: it asks the run launcher whether a run's worker is alive, and neither the default run
launcher (``dagster dev``) nor ``dagster job execute`` (no launcher) can answer. So:

* every step of this code location records on its run which process runs it: the run worker's pid
  (Dagster's own ``RUN_START`` event), its start time (``/proc``, so a reused pid is not taken for
  it), the host and its pid namespace (two containers may share a host name), as the run tags
  ``lm_pipeline/pid``, ``lm_pipeline/pid_start``, ``lm_pipeline/host`` and ``lm_pipeline/pid_ns``
  (:func:`record_run_process`; only when that process is the step's own or one of its ancestors,
  i.e. surely on this host);
* :func:`reap` finds the runs that are in progress, or hold pool slots, whose recorded process is
  gone from this host, marks them failed and frees their slots and queued steps. A run of a live
  process, a run recorded on another host and a run with no record are left alone;
* :func:`pool_holders` says, one line a run, who holds each pool's slots.

``python -m assets materialize`` and ``python -m assets dev`` run :func:`check` before they
start Dagster; every step runs :func:`tend` (record, then reap) as it starts.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO, Any

import dagster as dg

HOST_TAG = "lm_pipeline/host"
PID_TAG = "lm_pipeline/pid"
PID_START_TAG = "lm_pipeline/pid_start"
PID_NS_TAG = "lm_pipeline/pid_ns"
ACTIVE = (dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING)


# --------------------------------------------------------------------------- processes

def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None when there
    is no such process (or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()  # the name may hold spaces and parentheses


def process_start(pid: int) -> str | None:
    """When the process ``pid`` started (clock ticks after boot, ``/proc``), None where unknown."""
    fields = _stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def pid_namespace() -> str | None:
    """This process's pid namespace (``pid:[4026531836]``), None where unknown."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_alive(pid: int, start: str | None = None) -> bool:
    """Whether the process ``pid`` runs (a zombie does not); with ``start``, whether it is the
    process that started then and not a later one that reuses its pid."""
    if pid <= 0:
        return False
    if os.path.isdir("/proc/self"):
        fields = _stat(pid)
        if fields is None or fields[0] in ("Z", "X"):
            return False
        return start is None or len(fields) <= 19 or fields[19] == start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _self_or_ancestor(pid: int) -> bool:
    """Whether ``pid`` is this process or one of its ancestors (so it runs on this host)."""
    current = os.getpid()
    if pid in (current, os.getppid()):
        return True
    for _ in range(64):
        fields = _stat(current)
        if fields is None or len(fields) < 2:
            return False
        current = int(fields[1])
        if current == pid:
            return True
        if current <= 1:
            return False
    return False


@dataclass(frozen=True)
class RunProcess:
    """The process that runs a run, as recorded in its tags."""

    host: str
    pid: int
    start: str | None = None
    pid_ns: str | None = None

    @classmethod
    def from_tags(cls, tags: dict[str, str] | Any) -> RunProcess | None:
        try:
            return cls(str(tags[HOST_TAG]), int(tags[PID_TAG]), tags.get(PID_START_TAG) or None,
                       tags.get(PID_NS_TAG) or None)
        except (KeyError, TypeError, ValueError):
            return None

    def tags(self) -> dict[str, str]:
        optional = {PID_START_TAG: self.start, PID_NS_TAG: self.pid_ns}
        return {HOST_TAG: self.host, PID_TAG: str(self.pid), **{k: v for k, v in optional.items() if v}}

    def gone(self, host: str) -> bool:
        """Whether this process is known to be gone: it ran here (on ``host``, in this process's
        pid namespace where both are known) and runs no more."""
        here = pid_namespace()
        if self.host != host or (self.pid_ns and here and self.pid_ns != here):
            return False
        return not process_alive(self.pid, self.start)

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host}"


def record_run_process(instance: dg.DagsterInstance, run: dg.DagsterRun) -> RunProcess | None:
    """Tag ``run`` with its worker process (see the module docstring) unless it has the tags; the
    process is the pid of the run's ``RUN_START`` event, recorded only when it is this process or
    an ancestor of it. Returns the run's process (None: not recorded)."""
    known = RunProcess.from_tags(run.tags)
    if known is not None:
        return known
    page = instance.get_records_for_run(run.run_id, of_type=dg.DagsterEventType.RUN_START, limit=1)
    event = page.records[0].event_log_entry.dagster_event if page.records else None
    pid = event.pid if event is not None else None
    if pid is None or not _self_or_ancestor(pid):
        return None
    proc = RunProcess(socket.gethostname(), pid, process_start(pid), pid_namespace())
    instance.add_run_tags(run.run_id, proc.tags())
    return proc


# --------------------------------------------------------------------------- pools

def _pools(instance: dg.DagsterInstance) -> dict[str, dict[str, list[str]]]:
    """run id -> {"held": ["pool: step", ...], "queued": [...]}: the pool slots each run holds
    and its steps queued for one."""
    storage = instance.event_log_storage
    out: dict[str, dict[str, list[str]]] = defaultdict(lambda: {"held": [], "queued": []})
    if not storage.supports_global_concurrency_limits:
        return out
    for pool in sorted(storage.get_concurrency_keys()):
        info = storage.get_concurrency_info(pool)
        for slot in info.claimed_slots:
            out[slot.run_id]["held"].append(f"{pool}: {slot.step_key}")
        claimed = {(s.run_id, s.step_key) for s in info.claimed_slots}
        for step in info.pending_steps:
            if (step.run_id, step.step_key) not in claimed:
                out[step.run_id]["queued"].append(f"{pool}: {step.step_key}")
    return out


def _records(instance: dg.DagsterInstance, run_ids: Iterable[str]) -> list[dg.RunRecord]:
    """The records of the runs in progress and of the runs ``run_ids``, each once."""
    records = {r.dagster_run.run_id: r for r in instance.get_run_records(dg.RunsFilter(statuses=list(ACTIVE)))}
    rest = [rid for rid in run_ids if rid not in records]
    if rest:
        records.update({r.dagster_run.run_id: r for r in instance.get_run_records(dg.RunsFilter(run_ids=rest))})
    return list(records.values())


def reap(instance: dg.DagsterInstance, host: str | None = None) -> list[str]:
    """Fail the in-progress runs whose recorded process is gone from ``host`` (default: this host)
    and free the pool slots and queued steps of those runs (and of finished runs with a gone
    process that still hold some). Returns one line per run freed."""
    host = host or socket.gethostname()
    pools = _pools(instance)
    lines = []
    for rec in _records(instance, list(pools)):
        run = rec.dagster_run
        proc = RunProcess.from_tags(run.tags)
        if proc is None or not proc.gone(host):
            continue
        run = instance.get_run_by_id(run.run_id) or run  # its status now, not when listed
        active = run.status in ACTIVE
        slots = pools.get(run.run_id, {"held": [], "queued": []})
        if not active and not (slots["held"] or slots["queued"]):
            continue
        if active:
            instance.report_run_failed(run, f"The run's process ({proc}) is gone (killed or crashed): "
                                            "marked failed, its pool slots freed.")
        if slots["held"] or slots["queued"]:
            instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        if slots["held"]:
            what = f"its pool slots ({', '.join(slots['held'])}) freed"
        elif slots["queued"]:
            what = f"its steps queued for a pool slot ({', '.join(slots['queued'])}) dropped"
        else:
            what = "it held no pool slot"
        lines.append(f"run {run.run_id}: its process ({proc}) is gone; "
                     f"{'marked failed, ' if active else ''}{what}")
    return lines


def _when(timestamp: float | None) -> str:
    if not timestamp:
        return "start time unknown"
    return "started " + datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def pool_holders(instance: dg.DagsterInstance) -> list[str]:
    """One line per run holding pool slots: the pools and steps, the run, its process and start."""
    pools = {rid: s for rid, s in _pools(instance).items() if s["held"]}
    lines = []
    for rec in instance.get_run_records(dg.RunsFilter(run_ids=list(pools))) if pools else []:
        run = rec.dagster_run
        proc = RunProcess.from_tags(run.tags)
        lines.append(f"pool slot held: {'; '.join(pools[run.run_id]['held'])} by run {run.run_id} "
                     f"({run.status.value}, {proc or 'process not recorded'}, {_when(rec.start_time)}); "
                     "steps of other runs in that pool wait until it ends")
    return lines


# --------------------------------------------------------------------------- entry points

def tend(context: dg.OpExecutionContext | dg.AssetExecutionContext) -> None:
    """At the start of a step: record the run's process, free the slots of runs whose process is
    gone. Never fails the step (a problem is one warning line)."""
    try:
        record_run_process(context.instance, context.run)
        for line in reap(context.instance):
            context.log.warning(line)
    except Exception as e:  # bookkeeping: the step's own work goes on
        context.log.warning(f"could not check for runs whose process is gone: {type(e).__name__}: {e}")


def check(out: IO[str] | None = None) -> None:
    """Before a command starts Dagster on ``$DAGSTER_HOME``: free the runs whose process is gone
    (one line each), then name who holds each pool's slots (one line a run)."""
    out = out or sys.stderr
    try:
        with dg.DagsterInstance.get() as instance:
            lines = reap(instance) + pool_holders(instance)
    except Exception as e:  # the command itself will say what is wrong with the instance
        lines = [f"could not check the instance for runs whose process is gone: {type(e).__name__}: {e}"]
    for line in lines:
        print(line, file=out)
    with contextlib.suppress(Exception):
        out.flush()
