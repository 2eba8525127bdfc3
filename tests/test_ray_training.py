"""Training on a Ray cluster through the Dagster asset: the training resource in ``ray`` mode
submits one Ray job that runs the run as two processes of one ``jax.distributed`` job.

On a cluster the fixture starts on this machine (a head node and one worker node, 1 CPU each,
``tests/helpers/ray_cluster.py``) the tiny experiment's ``train_ckpt`` is materialized three ways:

* ``one``: the default launcher (its own process through Pipes, one process, a local store), the
  reference;
* ``ray``: two processes on the cluster (one per node), uninterrupted, the store (token cache,
  checkpoints, manifest) on the loopback S3 server (``tests/helpers/s3.py``; the credentials
  reach the cluster's processes through the job's environment);
* ``killed``: the same, but training process 1 is SIGKILLed mid-run: the fault point
  ``train_ckpt.after_step`` (armed once) holds one process after step 5, once the step-3
  checkpoint is complete (the other waits for it in the next step's all-reduce); the test reads
  process 1's pid from the step's log (the job reports where each process runs) and kills it.
  Dagster's retry has to resume.

The two-process run's per-step losses equal the one-process run's (f32, within 1e-5: the
gradient's all-reduce over two processes sums in another order than one process's batch
reduction, so bit equality is not expected; ``tests/test_multihost.py`` has the same bound). Each
process reads its own half of every global batch, so two processes that read the same rows, or
a slice at the wrong offset, change the loss at the first step. The killed run's retry resumes
from step 3 (not 0) and ends with exactly the uninterrupted run's parameters. (Checked: with every
process reading process 0's rows, step 1's loss differs by 5e-3.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import dagster as dg
import numpy as np
import pytest
from helpers import pipeline as pt
from helpers.ray_cluster import one_line_failure, ray_cluster  # noqa: F401  (fixture)
from helpers.s3 import REGION, clear_fsspec_cache, s3_server  # noqa: F401  (fixture)

from assets.deployment import Deployment
from assets.experiment import load_experiment
from assets.pipeline import build_assets, checkpoint_key, default_resources
from resources import JaxRuntimeResource, TrainingLauncherResource

NAME = "tiny"
STAGES = ("raw_shards", "tokenizer", "token_cache", "train_ckpt")
# every step's loss in the metrics log; a learning rate at which 6 steps move the loss visibly
OVERRIDES = "trainer.log_every=1 optimizer.learning_rate=1e-2"
# The tiny model compiles in a fraction of the time with LLVM optimisation off; every run here uses
# the same flags (tests/test_multihost.py measured it).
CHILD_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_backend_optimization_level=0"}
FAULT = "train_ckpt.after_step:5:pause"  # one process waits after step 5 (once step-3 is complete) to be killed


def K(stage: str) -> dg.AssetKey:
    return dg.AssetKey([NAME, stage])


def _materialize(tmp: Path, training: TrainingLauncherResource, instance: dg.DagsterInstance, store_root: str | None = None):
    sections = {"store": {"root": store_root}} if store_root else {}
    exp = load_experiment(pt.write_config(tmp, **sections), overrides=OVERRIDES)
    resources = {**default_resources(exp), "training": training, "jax_runtime": JaxRuntimeResource(platforms="cpu")}
    result = dg.materialize(build_assets(Deployment([exp])), selection=[K(s) for s in STAGES], resources=resources,
                            instance=instance, raise_on_error=False)
    return exp, result


def _ray_launcher(cluster, env: dict[str, str]) -> TrainingLauncherResource:
    return TrainingLauncherResource(mode="ray", ray_address=cluster.job_api, ray_num_processes=2, ray_cpus_per_process=1,
                                    ray_placement_strategy="SPREAD", ray_python=sys.executable, poll_seconds=0.2,
                                    ray_runtime_env={"env_vars": {**CHILD_ENV, **env}}, ray_start_timeout_s=120)


def _losses(run_dir: str) -> dict[int, float]:
    from lm_pipeline import fs

    rows = [json.loads(line) for line in fs.read_text(f"{run_dir}/metrics.jsonl").splitlines() if line.strip()]
    return {int(r["step"]): float(r["train/loss"]) for r in rows if "train/loss" in r}


def _params(checkpoint: str) -> list[np.ndarray]:
    import jax

    from lm_pipeline.eval.loading import load_model_from_checkpoint

    return [np.asarray(x) for x in jax.tree.leaves(load_model_from_checkpoint(checkpoint).model)]


def _observed(instance: dg.DagsterInstance) -> list[str]:
    records = instance.fetch_observations(K("train_ckpt"), limit=100, ascending=True).records
    return sorted({r.asset_observation.metadata["checkpoint_key"].value for r in records if r.asset_observation.metadata})


def _failure_text(result) -> str:
    """The step's failures, each with its causes (a retry's error is the policy's; its cause is ours)."""
    out = []
    for e in result.all_events:
        if e.event_type_value in ("STEP_UP_FOR_RETRY", "STEP_FAILURE") and e.event_specific_data.error:
            err = e.event_specific_data.error
            while err is not None:
                out.append(err.message.strip())
                err = err.cause
    return "\n".join(out)


class Killer(threading.Thread):
    """Once a training process is held at the fault point, SIGKILLs training process 1 by the pid
    the job reported for it (in the step's log: ``process 1: pid N on ...``)."""

    def __init__(self, instance: dg.DagsterInstance, paused: Path):
        super().__init__(daemon=True)
        self.instance, self.paused, self.killed = instance, paused, None
        self.stop = threading.Event()

    def pid_of_process_1(self) -> int | None:
        for run in self.instance.get_runs():
            for rec in self.instance.all_logs(run.run_id):
                m = re.search(r"process 1: pid (\d+) on ", rec.user_message or "")
                if m:
                    return int(m.group(1))  # the first report: the first attempt's processes
        return None

    def run(self) -> None:
        while not self.stop.wait(0.2):
            if self.paused.exists() and self.paused.read_text().strip():
                pid = self.pid_of_process_1()
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    self.killed = pid
                    return


class Runs:
    """The three materializations, each made when a test first asks for it (so ``-k killed``
    does not run the reference): ``runs[name]`` = (experiment, result, instance, seconds)."""

    def __init__(self, cluster, tmp: Path, s3):
        import boto3

        self.tmp, self.done, self.killed_pid = tmp, {}, None
        bucket = f"lm-ray-{os.urandom(4).hex()}"
        boto3.client("s3", endpoint_url=s3.endpoint, region_name=REGION).create_bucket(Bucket=bucket)
        clear_fsspec_cache()
        # The Ray runs keep their store on the loopback S3 server; the reference stays local.
        self.roots = {"one": None, "ray": f"s3://{bucket}/ray/store", "killed": f"s3://{bucket}/killed/store"}
        self.launchers = {
            "one": TrainingLauncherResource(mode="pipes", poll_seconds=0.2, extra_env=CHILD_ENV),
            "ray": _ray_launcher(cluster, dict(s3.env)),
            "killed": _ray_launcher(cluster, {**s3.env, "LM_PIPELINE_FAULTPOINT": FAULT,
                                              "LM_PIPELINE_FAULTPOINT_ONCE": str(tmp / "killed-marker"),
                                              "LM_PIPELINE_FAULTPOINT_FILE": str(tmp / "paused")}),
        }

    def __getitem__(self, name: str):
        if name not in self.done:
            instance = dg.DagsterInstance.ephemeral()
            killer = Killer(instance, self.tmp / "paused")
            if name == "killed":
                killer.start()
            if name == "ray":  # an earlier attempt's job still running this run: the step must stop it first
                self.stale_job = self._submit_stale_job(self.tmp / name)
            t0 = time.perf_counter()
            try:
                exp, result = _materialize(self.tmp / name, self.launchers[name], instance, self.roots[name])
            finally:
                killer.stop.set()
            self.done[name] = (exp, result, instance, time.perf_counter() - t0)
            print(f"materialized {name!r} in {self.done[name][3]:.1f} s")
            if name == "killed":
                self.killed_pid = killer.killed
        return self.done[name]

    def _submit_stale_job(self, tmp: Path) -> str:
        from ray.job_submission import JobSubmissionClient

        fp = load_experiment(pt.write_config(tmp), overrides=OVERRIDES).pipeline().address("train_ckpt").fingerprint
        self.client = JobSubmissionClient(self.launchers["ray"].ray_address)
        return self.client.submit_job(entrypoint="sleep 600", metadata={"train_ckpt": fp})


@pytest.fixture(scope="module")
def runs(ray_cluster, s3_server, tmp_path_factory):  # noqa: F811
    return Runs(ray_cluster, tmp_path_factory.mktemp("ray_training"), s3_server)


def _run_dir(run) -> str:
    exp, result, instance, _ = run
    assert result.success, _failure_text(result)
    return exp.pipeline().run_dir()


@pytest.mark.slow
def test_two_ray_processes_train_like_one(runs):
    """Per-step losses of the 2-process Ray run = the 1-process run's; the processes ran on both
    nodes; each checkpoint reached Dagster as an observation while the job ran."""
    one, ray = _losses(_run_dir(runs["one"])), _losses(_run_dir(runs["ray"]))
    assert sorted(one) == sorted(ray) == list(range(1, 7))
    steps = sorted(one)
    diffs = [abs(ray[k] - one[k]) for k in steps]
    print("per-step |loss(2 ray processes) - loss(1 process)|:", ", ".join(f"{d:.2e}" for d in diffs))
    np.testing.assert_allclose([ray[k] for k in steps], [one[k] for k in steps], rtol=0, atol=1e-5)
    assert one[steps[-1]] < one[steps[0]] - 0.1  # the model moved: the comparison has teeth

    exp, result, instance, _ = runs["ray"]
    meta = instance.get_latest_materialization_event(K("train_ckpt")).asset_materialization.metadata
    assert meta["num_processes"].value == 2
    procs = meta["ray_processes"].value
    assert [p["process_id"] for p in procs] == [0, 1]
    assert len({p["node_id"] for p in procs}) == 2, f"SPREAD puts one process on each node: {procs}"
    assert meta["ray_job_id"].value.startswith("lm-pipeline-train-")
    assert meta["final_step"].value == 6 and "resumed_from" not in meta
    fp = exp.pipeline().address("train_ckpt").fingerprint
    assert _observed(instance) == [checkpoint_key(fp, 3), checkpoint_key(fp, 6)]
    # process 0's metrics came back through Pipes as log lines of the step
    texts = [r.user_message for r in instance.all_logs(result.run_id)]
    assert any(t.startswith("step 6: train/loss=") for t in texts), texts[-20:]
    assert any("2 processes: process 0: pid" in t for t in texts)
    assert runs.client.get_job_status(runs.stale_job).value == "STOPPED"
    assert any(t.startswith(f"stopping Ray job {runs.stale_job}: an earlier attempt") for t in texts)
    # The final parameters agree with the one-process run's too, more loosely: Adam divides each
    # update by the root of its squared-gradient average, so for a parameter whose gradient is
    # near zero the f32 reduction-order difference between the runs moves the update by up to ~lr.
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(
        _params(meta["final_checkpoint"].value), _params(_run_dir(runs["one"]) + "/step-6"), strict=True))
    print(f"final parameters max |2 ray processes - 1 process| = {worst:.3g}")
    assert worst < 1e-3


@pytest.mark.slow
def test_killed_ray_process_is_retried_and_resumes(runs):
    """A training process SIGKILLed at step 5 fails the Ray job and the step; Dagster's retry
    submits a new job that resumes from step 3 and ends with the uninterrupted run's parameters."""
    exp, result, instance, _ = runs["killed"]
    run_dir = _run_dir(runs["killed"])
    pid = runs.killed_pid
    assert pid is not None, "a process was held at the fault point and process 1 was killed"
    retries = [e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
    assert len(retries) == 1, _failure_text(result)
    said = _failure_text(result)
    print(f"killed process 1 (pid {pid}); attempt 1 failed with: {said}")
    assert f"training process 1 of 2 (pid {pid} on " in said and "died" in said.lower()
    assert "a retry resumes from the latest checkpoint" in said
    meta = instance.get_latest_materialization_event(K("train_ckpt")).asset_materialization.metadata
    assert meta["resumed_from"].value == f"{run_dir}/step-3", meta.get("resumed_from")
    assert meta["final_step"].value == 6
    texts = [r.user_message for r in instance.all_logs(result.run_id)]
    assert any(t == f"attempt 2: resuming from {run_dir}/step-3" for t in texts)
    killed, whole = _params(f"{run_dir}/step-6"), _params(_run_dir(runs["ray"]) + "/step-6")
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(killed, whole, strict=True))
    print(f"resumed from step 3; final parameters max |killed+resumed - uninterrupted| = {worst:.3g}")
    assert worst <= 1e-6
    fp = exp.pipeline().address("train_ckpt").fingerprint
    assert _observed(instance) == [checkpoint_key(fp, 3), checkpoint_key(fp, 6)]


# ------------------------------------------------------------------------------------------------
# default tier: the launcher's settings are checked before anything runs (no cluster needed)
# ------------------------------------------------------------------------------------------------


def test_ray_mode_settings_fail_in_one_line_before_compute(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("LM_PIPELINE_RAY_ADDRESS", raising=False)
    assert "no cluster address" in one_line_failure(TrainingLauncherResource(mode="ray").validate_mode)
    assert "is not a Ray job API address" in one_line_failure(
        TrainingLauncherResource(mode="ray", ray_address="ray://head:10001").validate_mode)
    assert "placement_strategy" in one_line_failure(
        TrainingLauncherResource(mode="ray", ray_address="http://head:8265", ray_placement_strategy="ANYWHERE").validate_mode)
    assert "num_processes" in one_line_failure(
        TrainingLauncherResource(mode="ray", ray_address="http://head:8265", ray_num_processes=0).validate_mode)
    assert "must be one of pipes, in_process, ray" in one_line_failure(TrainingLauncherResource(mode="rya").validate_mode)
    # nothing listens there: the job API is unreachable, said at once
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    msg = one_line_failure(TrainingLauncherResource(mode="ray", ray_address=f"http://127.0.0.1:{port}").ray_job_client)
    assert msg.startswith(f"cannot reach the Ray cluster's job API at http://127.0.0.1:{port}") and time.perf_counter() - t0 < 30
    # through the asset: the step fails on the setting before reading anything (no upstream built)
    exp = load_experiment(pt.write_config(tmp_path))
    resources = {**default_resources(exp), "training": TrainingLauncherResource(mode="ray", ray_address="nowhere")}
    result = dg.materialize(build_assets(Deployment([exp])), selection=[K("train_ckpt")], resources=resources,
                            instance=dg.DagsterInstance.ephemeral(), raise_on_error=False)
    assert not result.success
    failures = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert len(failures) == 1 and "ray_address 'nowhere' is not a Ray job API address" in failures[0].event_specific_data.error.message
    assert not (tmp_path / "store" / "train_ckpt").exists()
    # ray not installed: how to install it
    monkeypatch.setitem(sys.modules, "ray", None)
    msg = one_line_failure(TrainingLauncherResource(mode="ray", ray_address="http://head:8265").validate_mode)
    assert "pip install 'lm-pipeline[cluster]'" in msg
    # the core side alone (no Dagster): importable without Ray, one line when used
    from lm_pipeline.cluster import ClusterError, ray_train

    with pytest.raises(ClusterError, match=r"^training on Ray needs the 'ray' package .*pip install 'lm-pipeline\[cluster\]'$"):
        ray_train.run_on_ray("{}", str(tmp_path / "store"), ray_train.RayTrainSpec())
