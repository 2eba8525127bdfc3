"""The token cache built on a Ray cluster (``lm_pipeline.cluster.ray_cache``) is the single-process cache.

On a cluster the fixture starts on this machine (a head node and one worker node, 1 CPU each,
``tests/helpers/ray_cluster.py``), the tiny experiment's token cache (five shard groups) is built
with one Ray task per group, ``SPREAD`` over the nodes, into a store every node sees (a local
directory: the nodes are one host). It must equal ``Pipeline.token_cache()`` run in one process
on another store: the same fingerprint, every file of the artifact byte for byte (arrays,
ledgers, markers; the manifest's summary), the groups' parts built by the tasks on both nodes.
Then again with the worker of one task SIGKILLed after it wrote its part (fault point
``token_cache.ray_part_built``, armed once): Ray re-runs the task and the commit is the same.

The default tier checks the refusals: a bad address or no ``ray`` package fails the CLI and the
Dagster asset in one line before anything is built.
"""

from __future__ import annotations

import io
import json
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import dagster as dg
import pytest
from helpers import pipeline as pt
from helpers.ray_cluster import one_line_failure, ray_cluster  # noqa: F401  (fixture)

from lm_pipeline.config import load_config
from lm_pipeline.steps import Pipeline
from lm_pipeline.store import ArtifactStore


def _files(artifact: Path) -> dict[str, bytes]:
    """Every file of an artifact but its manifest (which records how and when it was built)."""
    return {str(p.relative_to(artifact)): p.read_bytes() for p in sorted(artifact.rglob("*"))
            if p.is_file() and p.name != "manifest.json"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The tiny experiment's config, and its token cache built in one process (the reference)."""
    tmp = tmp_path_factory.mktemp("ray-cache")
    path = pt.write_config(tmp)
    ref = Pipeline(load_config(path), ArtifactStore(str(tmp / "single")), progress=False).token_cache()
    assert ref.manifest["built_by"] == "single"
    return tmp, path, ref


def _build_on_ray(cluster, path: Path, store: Path, **options):
    from lm_pipeline.cluster.ray_cache import build_token_cache_on_ray

    pipe = Pipeline(load_config(path), ArtifactStore(str(store)), progress=False)
    groups = [g.key for g in pipe.token_cache_groups()]
    placed: list[dict] = []
    res = build_token_cache_on_ray(pipe, address=cluster.gcs_address, num_cpus=1, scheduling_strategy="SPREAD",
                                   on_part=placed.append, **options)
    return pipe, groups, placed, res


def _assert_same_cache(res, ref, groups, placed) -> None:
    assert not res.hit and res.fingerprint == ref.fingerprint
    assert res.manifest["built_by"] == "fan-out"
    # every group's part was built by a task (none left to the commit), each once
    assert sorted(p["part"]["group"] for p in placed) == sorted(groups) and res.manifest["parts_built"] == len(groups)
    assert res.manifest["summary"] == ref.manifest["summary"]
    got, want = _files(Path(res.path)), _files(Path(ref.path))
    assert sorted(got) == sorted(want)
    assert [name for name in want if got[name] != want[name]] == []
    assert {"train/ledger.json", "validation/ledger.json"} <= set(want)


@pytest.mark.slow
def test_token_cache_built_by_ray_tasks_on_two_nodes_is_the_single_process_cache(ray_cluster, corpus, monkeypatch):  # noqa: F811
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    tmp, path, ref = corpus
    for attempt in range(3):  # SPREAD is a preference: on a loaded machine Ray may keep every task on one node
        store = tmp / f"ray{attempt}"
        pipe, groups, placed, res = _build_on_ray(ray_cluster, path, store)
        if len({p["node_id"] for p in placed}) == 2:
            break
    assert len(groups) == 5
    assert len({p["node_id"] for p in placed}) == 2, placed  # SPREAD: both nodes tokenized
    _assert_same_cache(res, ref, groups, placed)
    assert not list((store / "token_cache").glob(".parts-*"))  # the parts are removed after the commit
    assert pipe.token_cache().hit  # the same address as the local build
    # the command line: lm-pipeline cache --ray_address ADDR
    out = io.StringIO()
    with redirect_stdout(out):
        rc, _ = _cli(["cache", "--config_path", str(path), "--store.root", str(tmp / "cli"),
                      "--ray_address", ray_cluster.gcs_address])
    printed = json.loads(out.getvalue())
    assert rc == 0 and printed["hit"] is False and printed["path"].endswith(f"/token_cache/{ref.fingerprint}")
    assert _files(Path(printed["path"])) == _files(Path(ref.path))


@pytest.mark.slow
def test_a_killed_ray_task_is_retried_and_the_cache_is_the_same(ray_cluster, corpus, monkeypatch):  # noqa: F811
    from lm_pipeline.cluster.ray_cache import FAULTPOINT

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    tmp, path, ref = corpus
    once = tmp / "killed-once"
    env = {"LM_PIPELINE_FAULTPOINT": FAULTPOINT, "LM_PIPELINE_FAULTPOINT_ACTION": "kill",
           "LM_PIPELINE_FAULTPOINT_ONCE": str(once)}
    pipe, groups, placed, res = _build_on_ray(ray_cluster, path, tmp / "killed", max_retries=2,
                                              runtime_env={"env_vars": env})
    assert once.exists()  # a task's worker was SIGKILLed after writing its part
    _assert_same_cache(res, ref, groups, placed)
    # without retries the build fails naming the group, and commits nothing
    from lm_pipeline.cluster import ClusterError

    env["LM_PIPELINE_FAULTPOINT_ONCE"] = str(tmp / "killed-once-more")
    with pytest.raises(ClusterError, match=r"^token cache group \w+ failed on the cluster: \w+"):
        _build_on_ray(ray_cluster, path, tmp / "no-retry", max_retries=0, runtime_env={"env_vars": env})
    assert not list((tmp / "no-retry" / "token_cache").rglob("manifest.json"))


@pytest.mark.slow
def test_dagster_token_cache_in_ray_mode_is_the_single_process_cache(ray_cluster, corpus, monkeypatch):  # noqa: F811
    from assets.deployment import Deployment
    from assets.experiment import load_experiment
    from assets.pipeline import build_assets, default_resources
    from resources import TokenizingResource

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    tmp, _, ref = corpus
    exp = load_experiment(pt.write_config(tmp, "dagster.yaml", store={"root": str(tmp / "dagster")}))
    keys = [dg.AssetKey(["dagster", s]) for s in ("raw_shards", "tokenizer", "token_cache")]
    resources = {**default_resources(exp), "tokenizing": TokenizingResource(mode="ray", ray_address=ray_cluster.gcs_address)}
    result = dg.materialize(build_assets(Deployment([exp])), selection=keys, resources=resources,
                            instance=dg.DagsterInstance.ephemeral())
    assert result.success
    mat = [e for e in result.get_asset_materialization_events() if e.asset_key == keys[-1]]
    assert len(mat) == 1 and mat[0].materialization.metadata["groups_tokenized_in_this_run"].value == 5
    steps = {e.step_key for e in result.all_events if e.step_key}
    assert not [k for k in steps if "token_cache_group" in k] and any("token_cache_commit" in k for k in steps)  # no local op
    res = Pipeline(load_config(exp.path), ArtifactStore(str(tmp / "dagster")), progress=False).cached("token_cache")
    assert res is not None and res.fingerprint == ref.fingerprint and res.manifest["built_by"] == "fan-out"
    assert _files(Path(res.path)) == _files(Path(ref.path))


# --------------------------------------------------------------------------------------------
# default tier: refusals in one line, before any work
# --------------------------------------------------------------------------------------------


def _cli(argv: list[str]) -> tuple[int, str]:
    from lm_pipeline.cli import main

    err = io.StringIO()
    with redirect_stderr(err):
        rc = main(argv)
    return rc, err.getvalue()


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_cli_refuses_a_bad_ray_address_or_missing_ray_in_one_line_before_any_work(tmp_path, monkeypatch):
    from lm_pipeline.cluster import ClusterError
    from lm_pipeline.cluster.ray_cache import build_token_cache_on_ray, check_ray_address

    path = pt.write_config(tmp_path)
    for addr, says in [("http://head:8265", "is a job API (dashboard) address"),
                       ("head", "is not one ray.init takes")]:
        rc, err = _cli(["cache", "--config_path", str(path), "--ray_address", addr])
        assert rc == 2 and _error_lines(err) == [_error_lines(err)[0]] and says in err and "Traceback" not in err, err
    assert check_ray_address(" ray://head:10001 ") == "ray://head:10001" and check_ray_address("10.0.0.1:6379")
    monkeypatch.setitem(sys.modules, "ray", None)  # ray not installed
    rc, err = _cli(["cache", "--config_path", str(path), "--ray_address", "auto"])
    assert rc == 2 and len(_error_lines(err)) == 1 and "Traceback" not in err, err
    assert "tokenizing on Ray needs the 'ray' package" in err and "pip install 'lm-pipeline[cluster]'" in err
    with pytest.raises(ClusterError, match=r"^tokenizing on Ray needs the 'ray' package"):
        build_token_cache_on_ray(Pipeline(load_config(path), progress=False), address="auto")
    assert not (tmp_path / "store").exists()  # nothing was built, not even raw_shards


def test_dagster_token_cache_refuses_a_bad_ray_setting_in_one_line_before_any_work(tmp_path, monkeypatch):
    from assets.deployment import Deployment
    from assets.experiment import load_experiment
    from assets.pipeline import build_assets, default_resources
    from resources import TokenizingResource

    monkeypatch.delenv("LM_PIPELINE_TOKENIZE_RAY_ADDRESS", raising=False)
    assert TokenizingResource.from_env().mode == "local"  # the local fan-out is the default
    monkeypatch.setenv("LM_PIPELINE_TOKENIZE_RAY_ADDRESS", "ray://head:10001")
    assert TokenizingResource.from_env().mode == "ray"
    exp = load_experiment(pt.write_config(tmp_path))
    resources = {**default_resources(exp), "tokenizing": TokenizingResource(mode="ray", ray_address="http://head:8265")}
    result = dg.materialize(build_assets(Deployment([exp])), selection=[dg.AssetKey(["tiny", "token_cache"])],
                            resources=resources, instance=dg.DagsterInstance.ephemeral(), raise_on_error=False)
    assert not result.success
    failures = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert len(failures) == 1
    msg = failures[0].event_specific_data.error.message
    assert "tokenizing resource (mode 'ray'): ray address 'http://head:8265' is a job API" in msg
    assert "\n" not in msg.strip() and "Traceback" not in msg
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").rglob("manifest.json"))
    assert "mode must be one of local, ray" in one_line_failure(TokenizingResource(mode="cluster").validate)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert "no cluster address" in one_line_failure(TokenizingResource(mode="ray").validate)
    assert TokenizingResource().validate() == "local"
    monkeypatch.setitem(sys.modules, "ray", None)
    assert "pip install 'lm-pipeline[cluster]'" in one_line_failure(TokenizingResource(mode="ray", ray_address="auto").validate)
