"""Runs whose process is gone give their pool slots back (assets/dead_runs.py), on a real Dagster
instance in a temporary directory (SQLite, the instance template's pools): only a run recorded
on this host whose process is gone (or whose pid now belongs to a later process) is failed and
freed; a live run, a run of another host (or pid namespace) and a run with no record keep their
slots. A step of
this code location records its run's process, and frees a dead run's slot before a later step
of its own run asks for it."""

from __future__ import annotations

import io
import os
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import dagster as dg
import pytest

from assets import dead_runs as dr
from assets.pipeline import EVALUATION_POOL, TRAINING_POOL

REPO = Path(__file__).resolve().parents[1]
HOST = socket.gethostname()


@pytest.fixture
def instance(tmp_path):
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copyfile(REPO / "assets" / "dagster.yaml", home / "dagster.yaml")
    with dg.DagsterInstance.from_config(str(home)) as inst:
        for pool in (TRAINING_POOL, EVALUATION_POOL):
            inst.event_log_storage.set_concurrency_slots(pool, 10)  # room for every run below
        yield inst


def _dead_process() -> tuple[int, str | None]:
    """The pid and start time of a process that has ended (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    start = dr.process_start(proc.pid)
    proc.communicate(b"")
    return proc.pid, start


def _started_run(instance: dg.DagsterInstance, tags: dict[str, str], pool: str | None = TRAINING_POOL) -> str:
    """A run STARTED by a RUN_START event (so it has a start time), holding one slot of ``pool``."""
    run_id = str(uuid.uuid4())
    instance.add_run(dg.DagsterRun(job_name="pipeline", run_id=run_id, tags=tags,
                                   status=dg.DagsterRunStatus.NOT_STARTED))
    instance.report_dagster_event(dg.DagsterEvent(dg.DagsterEventType.RUN_START.value, job_name="pipeline"), run_id=run_id)
    if pool is not None:
        instance.event_log_storage.claim_concurrency_slot(pool, run_id, "train_step")
    return run_id


def _holders(instance: dg.DagsterInstance) -> set[str]:
    storage = instance.event_log_storage
    return {s.run_id for pool in (TRAINING_POOL, EVALUATION_POOL) for s in storage.get_concurrency_info(pool).claimed_slots}


def test_reap_frees_only_runs_whose_process_is_gone_from_this_host(instance):
    dead_pid, dead_start = _dead_process()
    me = dr.RunProcess(HOST, os.getpid(), dr.process_start(os.getpid()))
    assert dr.process_alive(me.pid, me.start) and not dr.process_alive(dead_pid, dead_start)
    runs = {
        "dead": _started_run(instance, dr.RunProcess(HOST, dead_pid, dead_start).tags()),
        "reused_pid": _started_run(instance, dr.RunProcess(HOST, os.getpid(), "1").tags()),  # a later process has its pid
        "live": _started_run(instance, me.tags()),
        "other_host": _started_run(instance, dr.RunProcess(f"not-{HOST}", dead_pid, dead_start).tags()),
        # same host name, another pid namespace (another container): its pids are not ours to look up
        "other_pid_ns": _started_run(instance, dr.RunProcess(HOST, dead_pid, dead_start, "pid:[1]").tags()),
        "unrecorded": _started_run(instance, {}),
        "dead_no_slot": _started_run(instance, dr.RunProcess(HOST, dead_pid, dead_start).tags(), pool=None),
    }
    finished = _started_run(instance, dr.RunProcess(HOST, dead_pid, dead_start).tags(), pool=EVALUATION_POOL)
    instance.report_run_failed(instance.get_run_by_id(finished), "failed, its slot left behind")
    assert _holders(instance) == {*runs.values(), finished} - {runs["dead_no_slot"]}

    lines = dr.reap(instance, host=HOST)

    status = {name: instance.get_run_by_id(rid).status for name, rid in runs.items()}
    failed = dg.DagsterRunStatus.FAILURE
    assert status == {"dead": failed, "reused_pid": failed, "dead_no_slot": failed,
                      **dict.fromkeys(("live", "other_host", "other_pid_ns", "unrecorded"), dg.DagsterRunStatus.STARTED)}
    assert _holders(instance) == {runs[n] for n in ("live", "other_host", "other_pid_ns", "unrecorded")}
    assert sorted(line.split(":")[0] for line in lines) == sorted(
        [f"run {runs[n]}" for n in ("dead", "reused_pid", "dead_no_slot")] + [f"run {finished}"])
    by_run = {line.split(":")[0]: line for line in lines}
    assert by_run[f"run {runs['dead']}"] == (
        f"run {runs['dead']}: its process (pid {dead_pid} on {HOST}) is gone; marked failed, "
        f"its pool slots ({TRAINING_POOL}: train_step) freed")
    assert by_run[f"run {finished}"].endswith(f"is gone; its pool slots ({EVALUATION_POOL}: train_step) freed")
    assert dr.reap(instance, host=HOST) == []  # nothing left to free; no second failure event

    holders = dr.pool_holders(instance)
    assert len(holders) == 4
    live = next(line for line in holders if runs["live"] in line)
    assert live.startswith(f"pool slot held: {TRAINING_POOL}: train_step by run {runs['live']} (STARTED, "
                           f"pid {os.getpid()} on {HOST}, started 20")
    assert "process not recorded" in next(line for line in holders if runs["unrecorded"] in line)
    assert f"on not-{HOST}" in next(line for line in holders if runs["other_host"] in line)


def test_a_dead_runs_queued_step_is_dropped_so_it_never_takes_the_slot(instance):
    storage = instance.event_log_storage
    storage.set_concurrency_slots(EVALUATION_POOL, 1)
    live = _started_run(instance, dr.RunProcess(HOST, os.getpid(), dr.process_start(os.getpid())).tags(),
                        pool=EVALUATION_POOL)
    dead_pid, dead_start = _dead_process()
    dead = _started_run(instance, dr.RunProcess(HOST, dead_pid, dead_start).tags(), pool=None)
    assert not storage.claim_concurrency_slot(EVALUATION_POOL, dead, "eval_step").is_claimed  # queued behind live

    assert dr.reap(instance, host=HOST) == [
        f"run {dead}: its process (pid {dead_pid} on {HOST}) is gone; marked failed, its steps queued for a "
        f"pool slot ({EVALUATION_POOL}: eval_step) dropped"]
    info = storage.get_concurrency_info(EVALUATION_POOL)
    assert [s.run_id for s in info.claimed_slots] == [live] and {p.run_id for p in info.pending_steps} == {live}
    storage.free_concurrency_slots_for_run(live)  # the live run ends: the next run's step gets the slot
    assert storage.claim_concurrency_slot(EVALUATION_POOL, str(uuid.uuid4()), "eval_step").is_claimed


def test_check_prints_freed_runs_and_holders(instance, monkeypatch):
    dead_pid, dead_start = _dead_process()
    dead = _started_run(instance, dr.RunProcess(HOST, dead_pid, dead_start).tags())
    live = _started_run(instance, dr.RunProcess(HOST, os.getpid(), dr.process_start(os.getpid())).tags())
    monkeypatch.setenv("DAGSTER_HOME", str(Path(instance.root_directory)))
    out = io.StringIO()
    dr.check(out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"run {dead}: its process") and live in lines[1], lines


@pytest.mark.timeout(60)
def test_a_step_records_its_run_process_and_frees_a_dead_runs_slot_first(instance):
    """A killed run holds the training pool's only slot; a new run's first step frees it, so the
    run's training step (same pool) is not blocked, and the new run is tagged with this process."""
    instance.event_log_storage.set_concurrency_slots(TRAINING_POOL, 1)
    dead_pid, dead_start = _dead_process()
    dead = _started_run(instance, dr.RunProcess(HOST, dead_pid, dead_start).tags())

    @dg.asset
    def first(context) -> None:
        dr.tend(context)

    @dg.asset(deps=[first], pool=TRAINING_POOL)
    def trains(context) -> None:
        pass

    result = dg.materialize([first, trains], instance=instance)  # in-process: this process runs the run
    assert result.success
    run = instance.get_run_by_id(result.run_id)
    assert dr.RunProcess.from_tags(run.tags) == dr.RunProcess(HOST, os.getpid(), dr.process_start(os.getpid()),
                                                              dr.pid_namespace())
    assert instance.get_run_by_id(dead).status == dg.DagsterRunStatus.FAILURE
    assert _holders(instance) == set()
