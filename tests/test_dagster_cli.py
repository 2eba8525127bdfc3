"""The pipeline through Dagster's own command line and UI, in subprocesses with a temporary
DAGSTER_HOME and a tiny experiment chosen by environment variables: the multiprocess fan-out,
``dagster asset materialize -m assets.definitions --select train_ckpt``, the named job, two
simultaneous materializations, and ``dagster dev`` serving the lineage graph."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import dagster as dg
import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import pipeline_testing as pt  # noqa: E402
from test_steps import cache_digest  # noqa: E402

from assets.pipeline import LINEAGE  # noqa: E402
from lm_pipeline.config import load_config  # noqa: E402
from lm_pipeline.steps import Pipeline  # noqa: E402
from lm_pipeline.store import ArtifactStore  # noqa: E402

REPO = pt.REPO
MATERIALIZE = str(Path(__file__).parent / "scripts" / "materialize.py")


def _run(cmd: list[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def _dagster(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "dagster"), *args]


def _instance(home: Path) -> dg.DagsterInstance:
    return dg.DagsterInstance.from_config(str(home))


def test_two_simultaneous_materializations_leave_one_intact_artifact(tmp_path):
    experiment = pt.write_config(tmp_path)
    env = pt.subprocess_env(tmp_path, experiment)
    env["LM_PIPELINE_FAULTPOINT"] = "token_cache.before_commit:*:sleep=0.5"  # slow each group down: the runs overlap
    keys = "raw_shards,tokenizer,token_cache"
    procs = [subprocess.Popen([sys.executable, MATERIALIZE, keys], env=env, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr[-6000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    for key in keys.split(","):
        assert outs[0][key]["data_version"] == outs[1][key]["data_version"]
        # one run built it; the other found it complete (before starting, or after waiting on the lock)
        assert sorted([outs[0][key]["cache_hit"], outs[1][key]["cache_hit"]]) == [False, True], key
    fp = outs[0]["token_cache"]["data_version"]
    store = ArtifactStore(str(tmp_path / "store"))
    manifest = store.manifest("token_cache", fp)
    assert manifest is not None and manifest["fingerprint"] == fp
    assert [m["fingerprint"] for m in store.complete("token_cache")] == [fp]
    assert not list((tmp_path / "store" / "token_cache").glob(".parts-*"))
    art = tmp_path / "store" / "token_cache" / fp
    assert not [p for p in art.rglob("*") if ".tmp-" in p.name]
    reference = Pipeline(load_config(experiment), ArtifactStore(str(tmp_path / "ref")), progress=False).token_cache()
    for split in ("train", "validation"):
        assert cache_digest(art / split) == cache_digest(Path(reference.path) / split)


def test_multiprocess_fan_out_builds_the_single_process_cache(tmp_path):
    """``dagster asset materialize`` (multiprocess executor): the shard groups tokenize in separate
    processes, in parallel, and the cache equals the one built in a single process."""
    experiment = pt.write_config(tmp_path)
    home = tmp_path / "dagster_home"
    env = pt.subprocess_env(tmp_path, experiment, dagster_home=home)
    env["LM_PIPELINE_FAULTPOINT"] = "token_cache.before_commit:*:sleep=1"  # each group takes >= 1 s: overlap is visible
    _run(_dagster("asset", "materialize", "-m", "assets.definitions", "--select", "raw_shards,tokenizer,token_cache"),
         env)
    with _instance(home) as instance:
        m = instance.get_latest_materialization_event(dg.AssetKey("token_cache"))
        fp = m.asset_materialization.tags["dagster/data_version"]
        records = instance.all_logs(m.run_id)
    starts, ends = {}, {}
    for r in records:
        step = r.step_key or ""
        if r.dagster_event is None or not step.startswith("token_cache.token_cache_group["):
            continue
        if r.dagster_event.event_type_value == "STEP_START":
            starts[step] = (r.timestamp, r.dagster_event.pid)
        elif r.dagster_event.event_type_value == "STEP_SUCCESS":
            ends[step] = r.timestamp
    assert len(starts) == 5 and set(ends) == set(starts)
    assert len({pid for _, pid in starts.values()}) >= 2  # separate processes
    spans = sorted((starts[s][0], ends[s]) for s in starts)
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False)), "no two groups ran at the same time"
    reference = Pipeline(load_config(experiment), ArtifactStore(str(tmp_path / "ref")), progress=False).token_cache()
    assert reference.fingerprint == fp
    fanned = tmp_path / "store" / "token_cache" / fp
    for split in ("train", "validation"):
        assert cache_digest(fanned / split) == cache_digest(Path(reference.path) / split)


@pytest.mark.slow
def test_documented_commands_materialize_train_ckpt_then_everything(tmp_path):
    """The README's commands against a persistent instance: ``--select train_ckpt`` (training through
    Pipes), then the named job for all six, then again: all hits, quickly."""
    experiment = pt.write_config(tmp_path)
    home = tmp_path / "dagster_home"
    env = pt.subprocess_env(tmp_path, experiment, mode="pipes", dagster_home=home)
    env.pop("LM_PIPELINE_TRAIN_MODE")  # the default: Pipes
    _run(_dagster("asset", "materialize", "-m", "assets.definitions", "--select", "train_ckpt"), env)
    with _instance(home) as instance:
        m = instance.get_latest_materialization_event(dg.AssetKey("train_ckpt")).asset_materialization
        assert m.metadata["final_step"].value == 6 and m.metadata["cache_hit"].value is False
        obs = instance.fetch_observations(dg.AssetKey("train_ckpt"), limit=10).records
        assert len(obs) == 2  # step-3 and step-6, reported through Pipes as they landed

    _run([sys.executable, "-m", "assets", "materialize"], env)  # dagster job execute -j pipeline
    with _instance(home) as instance:
        first = {k: instance.get_latest_materialization_event(dg.AssetKey(k)).asset_materialization for k in LINEAGE}
    assert {k: v.metadata["cache_hit"].value for k, v in first.items()} == {
        **dict.fromkeys(LINEAGE, True), "eval_report": False, "hf_export": False}

    t0 = time.perf_counter()
    _run(_dagster("job", "execute", "-m", "assets.definitions", "-j", "pipeline"), env)
    elapsed = time.perf_counter() - t0
    with _instance(home) as instance:
        again = {k: instance.get_latest_materialization_event(dg.AssetKey(k)).asset_materialization for k in LINEAGE}
    assert all(again[k].metadata["cache_hit"].value for k in LINEAGE)
    assert {k: v.tags["dagster/data_version"] for k, v in again.items()} == {
        k: v.tags["dagster/data_version"] for k, v in first.items()}
    assert elapsed < 30, f"a fully cached run of the pipeline job took {elapsed:.1f}s"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


QUERY = "{ assetNodes { assetKey { path } dependencyKeys { path } groupName } }"


@pytest.mark.ui
def test_dagster_dev_serves_the_lineage_graph(tmp_path):
    experiment = pt.write_config(tmp_path)
    home = tmp_path / "dagster_home"
    env = pt.subprocess_env(tmp_path, experiment, dagster_home=home)
    port = _free_port()
    log = open(tmp_path / "dagster_dev.log", "w")  # noqa: SIM115
    # from the repository root, `dagster dev` finds workspace.yaml
    proc = subprocess.Popen(_dagster("dev", "-h", "127.0.0.1", "-p", str(port)), env=env, cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        nodes = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", data=json.dumps({"query": QUERY}).encode(),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=10) as resp:
                    data = json.loads(resp.read())
                nodes = (data.get("data") or {}).get("assetNodes")
                if nodes:
                    break
            except OSError:
                pass
            time.sleep(2)
        assert nodes, f"dagster dev did not serve the assets:\n{(tmp_path / 'dagster_dev.log').read_text()[-4000:]}"
        graph = {"/".join(n["assetKey"]["path"]): {"/".join(d["path"]) for d in n["dependencyKeys"]} for n in nodes}
        groups = {"/".join(n["assetKey"]["path"]): n["groupName"] for n in nodes}
        assert set(LINEAGE) <= set(graph)
        assert graph["tokenizer"] == {"raw_shards"} and graph["token_cache"] == {"raw_shards", "tokenizer"}
        assert graph["train_ckpt"] == {"token_cache"} and graph["hf_export"] == {"train_ckpt"}
        assert graph["eval_report"] == {"train_ckpt", "token_cache"}
        assert {groups[k] for k in LINEAGE} == {"pipeline"}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        log.close()
