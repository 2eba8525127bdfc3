"""The pipeline through Dagster's own command line and UI, in subprocesses with a temporary
DAGSTER_HOME and a tiny experiment chosen by environment variables (``$LM_PIPELINE_EXPERIMENT``:
one file, ``tiny.yaml``, the deployment's default experiment, so every key is the bare stage
name): the multiprocess fan-out, ``dagster asset materialize -m assets.definitions --select
train_ckpt`` (refused in one line until its upstream is materialized, then with
``'*train_ckpt'``, then as typed), the named job, two simultaneous materializations, and
``dagster dev`` serving the lineage graph."""

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
from helpers import pipeline as pt
from test_steps import cache_digest

from assets.deployment import COMPARISON_KEY
from assets.pipeline import LINEAGE
from lm_pipeline.config import load_config
from lm_pipeline.steps import Pipeline
from lm_pipeline.store import ArtifactStore

REPO = pt.REPO
EXP = "tiny"  # pt.write_config's file, tiny.yaml: the experiment's name (its asset group)


def _key(stage: str) -> dg.AssetKey:
    return dg.AssetKey(stage)  # the one experiment of $LM_PIPELINE_EXPERIMENT is the default: bare keys


def _name(stage: str) -> str:
    return _key(stage).to_user_string()  # "<stage>", as --select takes it


# Materialize assets of the deployment ($LM_PIPELINE_EXPERIMENT) in this process, into a fresh
# ephemeral instance; print {key: {cache_hit, data_version}} as JSON on the last line.
#     python -c MATERIALIZE raw_shards,tokenizer,token_cache
MATERIALIZE = """
import json, sys
import dagster as dg
from assets.deployment import Deployment
from assets.experiment import default_experiment, load_experiments
from assets.pipeline import build_assets, default_resources
names = sys.argv[1].split(",")
keys = [dg.AssetKey.from_user_string(n) for n in names]
exps = load_experiments()
dep = Deployment(exps, default=default_experiment(exps))
instance = dg.DagsterInstance.ephemeral()
result = dg.materialize(build_assets(dep), selection=keys, resources=default_resources(dep), instance=instance)
out = {}
for name, key in zip(names, keys):
    m = instance.get_latest_materialization_event(key).asset_materialization
    out[name] = {"cache_hit": m.metadata["cache_hit"].value, "data_version": m.tags["dagster/data_version"]}
print(json.dumps(out))
raise SystemExit(0 if result.success else 1)
"""


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
    keys = ",".join(_name(s) for s in ("raw_shards", "tokenizer", "token_cache"))
    procs = [subprocess.Popen([sys.executable, "-c", MATERIALIZE, keys], env=env, cwd=REPO, stdout=subprocess.PIPE,
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
    fp = outs[0][_name("token_cache")]["data_version"]
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


@pytest.mark.slow  # a Dagster run with the multiprocess executor (about 20 s); the in-process fan-out equality is in test_steps.py
def test_multiprocess_fan_out_builds_the_single_process_cache(tmp_path):
    """``dagster asset materialize`` (multiprocess executor): the shard groups tokenize in separate
    processes, in parallel, and the cache equals the one built in a single process."""
    experiment = pt.write_config(tmp_path)
    home = tmp_path / "dagster_home"
    env = pt.subprocess_env(tmp_path, experiment, dagster_home=home)
    env["LM_PIPELINE_FAULTPOINT"] = "token_cache.before_commit:*:sleep=1"  # each group takes >= 1 s: overlap is visible
    _run(_dagster("asset", "materialize", "-m", "assets.definitions", "--select",
                  ",".join(_name(s) for s in ("raw_shards", "tokenizer", "token_cache"))), env)
    with _instance(home) as instance:
        m = instance.get_latest_materialization_event(_key("token_cache"))
        fp = m.asset_materialization.tags["dagster/data_version"]
        records = instance.all_logs(m.run_id)
    graph = _key("token_cache").to_python_identifier()  # token_cache: the graph asset's ops are named after it
    starts, ends = {}, {}
    for r in records:
        step = r.step_key or ""
        if r.dagster_event is None or not step.startswith(f"{graph}.{graph}_group["):
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
    """The documented commands against a persistent instance: ``dagster asset materialize -m
    assets.definitions --select train_ckpt`` on a fresh instance fails in one line saying what to
    run first (Dagster has no materialization of its upstream), with no traceback, and trains
    nothing; ``--select '*train_ckpt'`` (it and everything upstream) trains through Pipes; then
    the named job for all six and the comparison; then the first command as typed succeeds (a
    cache hit), and ``dg launch --assets train_ckpt`` too; then the job again: all hits, nothing written."""
    experiment = pt.write_config(tmp_path)
    home = tmp_path / "dagster_home"
    env = pt.subprocess_env(tmp_path, experiment, mode="pipes", dagster_home=home)
    env.pop("LM_PIPELINE_TRAIN_MODE")  # the default: Pipes
    cmd = _dagster("asset", "materialize", "-m", "assets.definitions", "--select", _name("train_ckpt"))
    refused = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0, output[-4000:]
    told = [line for line in output.splitlines() if "materialize" in line and _name("token_cache") in line]
    assert told, output[-6000:]
    assert any(f"{_name('train_ckpt')} reads token_cache " in line and "which is not built" in line
               and f"materialize {_name('token_cache')} first" in line and "`python -m assets materialize`" in line
               for line in told), told
    assert "Traceback" not in output and "Stack Trace" not in output, output[-6000:]
    with _instance(home) as instance:
        assert not [s for s in LINEAGE if instance.get_latest_materialization_event(_key(s)) is not None]
        assert not instance.fetch_observations(_key("train_ckpt"), limit=10).records
    store = ArtifactStore(str(tmp_path / "store"))
    assert store.complete("token_cache") == [] and store.complete("train_ckpt") == []  # refused before any work

    # '*key': the key and all its ancestors ('+key' is one level only: tiny/token_cache's own
    # inputs would be missing)
    _run(_dagster("asset", "materialize", "-m", "assets.definitions", "--select", f"*{_name('train_ckpt')}"), env)
    with _instance(home) as instance:
        built = {s: instance.get_latest_materialization_event(_key(s)) for s in LINEAGE}
        assert {s for s, e in built.items() if e is not None} == {"raw_shards", "tokenizer", "token_cache", "train_ckpt"}
        assert len({built[s].run_id for s in ("raw_shards", "tokenizer", "token_cache", "train_ckpt")}) == 1
        assert not any(built[s].asset_materialization.metadata["cache_hit"].value
                       for s in ("raw_shards", "tokenizer", "token_cache"))
        m = built["train_ckpt"].asset_materialization
        assert m.metadata["final_step"].value == 6 and m.metadata["cache_hit"].value is False
        obs = instance.fetch_observations(_key("train_ckpt"), limit=10).records
        assert len(obs) == 2  # step-3 and step-6, reported through Pipes as they landed

    _run([sys.executable, "-m", "assets", "materialize"], env)  # dagster job execute -j pipeline
    keys = [*LINEAGE, "comparison"]

    def latest(instance: dg.DagsterInstance) -> dict[str, dg.AssetMaterialization]:
        return {s: instance.get_latest_materialization_event(
            COMPARISON_KEY if s == "comparison" else _key(s)).asset_materialization for s in keys}

    with _instance(home) as instance:
        first = latest(instance)
    assert {k: v.metadata["cache_hit"].value for k, v in first.items()} == {
        **dict.fromkeys(LINEAGE, True), "eval_report": False, "hf_export": False, "comparison": False}

    _run(cmd, env)  # the first command, as typed: now its inputs are recorded, a cache hit
    with _instance(home) as instance:
        event = instance.get_latest_materialization_event(_key("train_ckpt"))
        m, m_run = event.asset_materialization, event.run_id
        assert m.metadata["cache_hit"].value is True
        assert m.tags["dagster/data_version"] == first["train_ckpt"].tags["dagster/data_version"]
        check = instance.event_log_storage.get_latest_asset_check_execution_by_key(
            [dg.AssetCheckKey(_key("train_ckpt"), "final_loss")])[dg.AssetCheckKey(_key("train_ckpt"), "final_loss")]
        assert check.status.value in ("SUCCEEDED", "FAILED")  # the check ran (a tiny run may not beat unigram)
    # the same with dg (dagster-dg-cli, [tool.dg] in pyproject.toml: this repository is the project)
    _run([str(Path(sys.executable).parent / "dg"), "launch", "--assets", _name("train_ckpt")], env)
    with _instance(home) as instance:
        again_by_dg = instance.get_latest_materialization_event(_key("train_ckpt"))
        assert again_by_dg.run_id != m_run and again_by_dg.asset_materialization.metadata["cache_hit"].value is True

    before = pt.store_files(tmp_path / "store")
    _run(_dagster("job", "execute", "-m", "assets.definitions", "-j", "pipeline"), env)
    with _instance(home) as instance:
        again = latest(instance)
    assert all(again[k].metadata["cache_hit"].value for k in keys)
    assert {k: v.tags["dagster/data_version"] for k, v in again.items()} == {
        k: v.tags["dagster/data_version"] for k, v in first.items()}
    after = pt.store_files(tmp_path / "store")  # no work: not one artifact file written, added or removed
    assert after == before, sorted(set(after.items()) ^ set(before.items()))[:20]



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
        src, comparison = _name("data_sources"), COMPARISON_KEY.to_user_string()
        # one experiment: its data source, six stages and per-checkpoint evaluation, and the comparison
        assert set(graph) == {src, *(_name(s) for s in LINEAGE), _name("checkpoint_eval"), comparison}
        assert graph[src] == set()  # every stage reads the data source directly (its staleness reaches each)
        assert graph[_name("raw_shards")] == {src}
        assert graph[_name("tokenizer")] == {src, _name("raw_shards")}
        assert graph[_name("token_cache")] == {src, _name("raw_shards"), _name("tokenizer")}
        assert graph[_name("train_ckpt")] == {src, _name("token_cache")}
        assert graph[_name("eval_report")] == {src, _name("train_ckpt"), _name("token_cache")}
        assert graph[_name("hf_export")] == {src, _name("train_ckpt")}
        assert graph[_name("checkpoint_eval")] == {_name("train_ckpt")}
        assert graph[comparison] == {_name("train_ckpt"), _name("eval_report")}
        evals = _name("checkpoint_eval")
        assert {k: groups[k] for k in graph if k not in (comparison, evals)} == dict.fromkeys(
            set(graph) - {comparison, evals}, EXP)
        assert groups[evals] == f"{EXP}_checkpoints"
        assert groups[comparison] == "experiments"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        log.close()
