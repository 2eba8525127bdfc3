"""A killed main command blocks no later run.

``python -m assets materialize`` (the README's command: the whole ``pipeline`` job in one Dagster
run) on the tiny experiment, with Dagster Pipes training (the default) and the instance template
(one slot per pool), is SIGKILLed as a process group while it trains, once the run's first
checkpoint has landed. The killed run is left STARTED, holding the ``lm_pipeline_training`` slot.
The same command again must mark it failed, free that slot before its own training step asks for
it (no "blocked by limit for pool" wait), resume the training from the checkpoint, and end with
an export byte-identical to the uninterrupted reference run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest
from conftest import REPO, artifact_dir, child_env, files, finish

from assets.dead_runs import HOST_TAG, PID_TAG
from assets.pipeline import TRAINING_POOL
from lm_pipeline import faultpoints

pytestmark = [pytest.mark.faults, pytest.mark.timeout(600)]

RERUN_BOUND_S = 240  # the whole uninterrupted command takes about 50 s on a 2-core machine
TRAIN_STEP = "train_ckpt"  # the one experiment of LM_PIPELINE_EXPERIMENT is the default: bare keys


def _main_command(experiment, store: Path, home: Path, extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = child_env({"LM_PIPELINE_EXPERIMENT": str(experiment.config), "LM_PIPELINE_OVERRIDES": f"store.root={store}",
                     "DAGSTER_HOME": str(home), **(extra or {})})
    env.pop("LM_PIPELINE_TRAIN_MODE", None)  # the default: training in its own process through Pipes
    return subprocess.Popen([sys.executable, "-m", "assets", "materialize"], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _kill_while_training(experiment, store: Path, home: Path, tmp_path: Path):
    """Run the main command until training pauses after step 3 (step 2's checkpoint complete),
    then SIGKILL its whole process group. Returns (its pid, its output)."""
    paused = tmp_path / "paused.txt"
    proc = _main_command(experiment, store, home, {
        faultpoints.ENV: "train_ckpt.after_step:3:pause", faultpoints.ENV_FILE: str(paused),
        faultpoints.ENV_TRACE: str(tmp_path / "trace.txt")})

    def training_paused() -> bool:
        return paused.exists() and "train_ckpt.after_step 3" in paused.read_text()

    run = finish(proc, tmp_path / "trace.txt", timeout=240, kill_when=training_paused)
    assert run.killed, f"the command was not killed while training (rc {run.returncode}):\n{run.output[-3000:]}"
    return proc.pid, run.output


@pytest.mark.reliability("crash (SIGKILL) and re-run")
def test_killed_main_command_frees_its_pool_slot_and_the_rerun_resumes(experiment, tmp_path, note):
    store, home = tmp_path / "store", tmp_path / "dagster_home"
    pid, _ = _kill_while_training(experiment, store, home, tmp_path)
    run_dir = artifact_dir(store, "train_ckpt")
    assert run_dir is not None and (run_dir / "step-2" / "checkpoint.json").exists()
    assert not (run_dir / "manifest.json").exists() and not (run_dir / "step-4").exists()
    with dg.DagsterInstance.from_config(str(home)) as instance:
        [dead] = instance.get_runs()
        assert dead.status == dg.DagsterRunStatus.STARTED
        # the run recorded its process: the command's own pid (python -m assets execs into dagster)
        assert dead.tags[PID_TAG] == str(pid) and dead.tags[HOST_TAG]
        held = instance.event_log_storage.get_concurrency_info(TRAINING_POOL).claimed_slots
        assert [(s.run_id, s.step_key) for s in held] == [(dead.run_id, TRAIN_STEP)]

    t0 = time.monotonic()
    proc = _main_command(experiment, store, home)
    try:
        out, _ = proc.communicate(timeout=RERUN_BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the re-run did not finish within {RERUN_BOUND_S} s:\n{out[-4000:]}")
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, out[-4000:]
    assert "blocked by limit for pool" not in out, out[-4000:]
    freed = [line for line in out.splitlines() if line.startswith(f"run {dead.run_id}: its process (pid {pid} on ")]
    assert freed and f"is gone; marked failed, its pool slots (lm_pipeline_training: {TRAIN_STEP}) freed" in freed[0], \
        out[:3000]
    assert f"resumed from {run_dir / 'step-2'} at step 2" in out, "the re-run did not resume from step 2's checkpoint"

    with dg.DagsterInstance.from_config(str(home)) as instance:
        runs = {r.run_id: r for r in instance.get_runs()}
        assert runs.pop(dead.run_id).status == dg.DagsterRunStatus.FAILURE
        assert [r.status for r in runs.values()] == [dg.DagsterRunStatus.SUCCESS]
        assert instance.event_log_storage.get_concurrency_info(TRAINING_POOL).claimed_slots == []
    ref, got = artifact_dir(experiment.reference, "hf_export"), artifact_dir(store, "hf_export")
    assert ref is not None and got is not None and got.name == ref.name  # same fingerprint
    a, b = files(ref, skip=("manifest.json", ".build.lock")), files(got, skip=("manifest.json", ".build.lock"))
    assert sorted(a) == sorted(b) and [k for k in a if a[k] != b[k]] == []
    note(f"python -m assets materialize SIGKILLed (process group) while training, step 2 checkpointed: the run "
         f"stayed STARTED holding the {TRAINING_POOL} slot; the same command marked it failed, freed the slot, "
         f"resumed from step 2 and finished in {seconds:.0f} s with no wait on the pool; "
         f"{len(a)} export files byte-identical to the uninterrupted run")
