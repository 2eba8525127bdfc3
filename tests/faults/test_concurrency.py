"""Concurrency: two pipelines that share ancestors run at once (the ancestors are built once,
both finish), and two Dagster runs materializing the same assets never corrupt them."""

from __future__ import annotations

import re

import pytest
from conftest import artifact_dir, files, finish, run_stage

pytestmark = [pytest.mark.faults, pytest.mark.timeout(400)]


@pytest.mark.reliability("concurrency")
def test_two_pipelines_sharing_ancestors_build_them_once(experiment, tmp_path, note):
    store = tmp_path / "store"  # empty: both runs need raw_shards, tokenizer and token_cache
    slow = "token_cache.before_commit:*:sleep=0.3"  # widen the window in which both want the cache
    procs = [run_stage(experiment, store, "train_ckpt", fault=slow, wait=False,
                       overrides=("--optimizer.learning_rate", lr)) for lr in ("0.001", "0.002")]
    runs = [finish(p, timeout=300) for p in procs]
    for r in runs:
        assert r.returncode == 0, r.output[-3000:]
    built = {}
    for stage in ("raw_shards", "tokenizer", "token_cache"):
        building = [r for r in runs if re.search(rf"{stage} \w+: building at", r.output)]
        assert len(building) == 1, f"{stage} was built {len(building)} times"
        built[stage] = artifact_dir(store, stage)
    fps = {p.name for p in (store / "train_ckpt").iterdir() if p.is_dir() and not p.name.startswith(".")}
    assert len(fps) == 2 and all((store / "train_ckpt" / fp / "manifest.json").exists() for fp in fps)
    ref = artifact_dir(experiment.reference, "token_cache")
    a = {k: v for k, v in files(built["token_cache"], skip=("manifest.json", ".build.lock")).items() if "/packing/" not in k}
    b = {k: v for k, v in files(ref, skip=("manifest.json", ".build.lock")).items() if "/packing/" not in k}
    assert a == b
    note("two trainings with different learning rates started together on an empty store: raw_shards, "
         "tokenizer and token_cache each built by exactly one of them (the other waited on the lock and "
         "hit), both runs finished, the shared cache byte-identical to the reference")


@pytest.mark.reliability("concurrency")
def test_two_dagster_runs_materializing_the_same_assets(tmp_path, note):
    """The default tier's Dagster test, recorded here: two ``materialize`` processes at once."""
    from test_dagster_cli import test_two_simultaneous_materializations_leave_one_intact_artifact as two_runs

    two_runs(tmp_path)
    note("two Dagster materializations of raw_shards, tokenizer, token_cache at once: each asset built by "
         "one run and a hit in the other, one complete artifact per asset, identical to a reference build "
         "(tests/test_dagster_cli.py)")


