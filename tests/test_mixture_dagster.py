"""A data mixture through Dagster: each component's token cache is its own asset (the cache a
single-source experiment over that component has), the mixture's weights are shown where they
are used, the run trains and is evaluated per component, and editing one source's file marks
exactly what ``lm-pipeline plan`` would rebuild as stale."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._core.loader import LoadingContextForTest
from helpers.mixture import COMPONENTS, mixture_config

from assets.experiment import load_experiments
from assets.pipeline import OBSERVE_JOB, PIPELINE_JOB, build_definitions
from lm_pipeline.store import ArtifactStore
from resources import TrainingLauncherResource

pytestmark = [pytest.mark.filterwarnings("ignore::dagster.BetaWarning"),
              pytest.mark.slow]  # the pipeline through Dagster, training included: ~1 min

WEIGHTS = [[0, {"web": 0.8, "code": 0.2}], [3, {"web": 0.5, "code": 0.3, "books": 0.2}]]


def deploy(tmp: Path) -> Path:
    folder = tmp / "experiments"
    folder.mkdir()
    (folder / "default.yaml").write_text(yaml.safe_dump(mixture_config(tmp, WEIGHTS), sort_keys=False))
    return folder


def definitions(folder: Path) -> dg.Definitions:
    return build_definitions(load_experiments(folder), resources={
        "training": TrainingLauncherResource(mode="in_process", poll_seconds=0.2)}, executor=dg.in_process_executor)


def stale_keys(folder: Path, instance: dg.DagsterInstance) -> set[str]:
    graph = definitions(folder).resolve_asset_graph()
    resolver = CachingStaleStatusResolver(instance, graph, LoadingContextForTest(instance))
    return {k.to_user_string() for k in graph.materializable_asset_keys
            if resolver.get_status(k) == StaleStatus.STALE and k.path[-1] != "checkpoint_eval"
            and k.path[0] != "experiments"}


def plan_misses(folder: Path) -> set[str]:
    """The plan's misses as asset keys: a component's raw_shards and token_cache are its cache asset."""
    (exp,) = load_experiments(folder)
    out = set()
    for row in exp.fresh_pipeline(ArtifactStore(exp.store_root)).plan():
        if not row["hit"]:
            stage, _, comp = row["stage"].rstrip("]").partition("[")
            out.add(f"components/{comp}/token_cache" if comp else stage)
    return out


def materializations(result) -> dict[str, dg.AssetMaterialization]:
    return {e.asset_key.to_user_string(): e.event_specific_data.materialization for e in result.all_events
            if e.event_type_value == "ASSET_MATERIALIZATION"}


def test_a_mixture_through_dagster(tmp_path):
    folder = deploy(tmp_path)
    instance = dg.DagsterInstance.ephemeral()
    defs = definitions(folder)
    graph = defs.resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert {f"components/{c}/{what}" for c in COMPONENTS for what in ("data_sources", "token_cache")} <= keys
    assert "data_sources" not in keys  # one source per component, not one for the mixture
    train_spec = graph.get(dg.AssetKey("train_ckpt"))
    assert {f"components/{c}/data_sources" for c in COMPONENTS} <= {k.to_user_string() for k in train_spec.parent_keys}
    assert not graph.get(dg.AssetKey("tokenizer")).parent_keys  # a given tokenizer reads no data
    shown = defs.get_assets_def("train_ckpt").specs_by_key[dg.AssetKey("train_ckpt")].metadata
    table = {r.data["component"]: r.data for r in shown["mixture"].records}
    assert table["books"] == {"component": "books", "step 0": 0.0, "step 3": 0.2}
    assert table["web"]["step 0"] == 0.8 and shown["mixture_schedule"].value.startswith("![")

    result = defs.resolve_job_def(PIPELINE_JOB).execute_in_process(instance=instance)
    assert result.success
    mats = materializations(result)
    (exp,) = load_experiments(folder)
    pipe = exp.fresh_pipeline(ArtifactStore(exp.store_root))
    for c in COMPONENTS:  # each component's cache: its own asset, at the component's own address
        got = mats[f"components/{c}/token_cache"].tags["dagster/data_version"]
        assert got == pipe.components()[c].address("token_cache").fingerprint
    index = pipe.cached("token_cache").manifest["components"]
    assert {c: index[c]["fingerprint"] for c in COMPONENTS} == {
        c: mats[f"components/{c}/token_cache"].tags["dagster/data_version"] for c in COMPONENTS}
    rows = {r["dataset"]: r for r in pipe.cached("eval_report").manifest["rows"]}
    assert set(rows) == {"web/validation", "_micro", "_macro"}
    compared = json.loads(Path(mats["experiments/comparison"].metadata["path"].value, "comparison.json").read_text())[0]
    assert compared["bpb_by_set"] == f"web/validation {rows['web/validation']['bpb']:.4g}"
    assert compared["macro_bpb"] == pytest.approx(rows["_macro"]["bpb"])
    assert stale_keys(folder, instance) == set() == plan_misses(folder)

    # one source's file edited and observed: its cache and what reads the mixture are stale, as planned
    books = Path(pipe.cfg.data.configs["books"].train_urls[0])
    books.write_text(books.read_text() + json.dumps({"text": "def appended():\n    return 1\n"}) + "\n")
    assert definitions(folder).resolve_job_def(OBSERVE_JOB).execute_in_process(instance=instance).success
    expected = {"components/books/token_cache", "raw_shards", "token_cache", "train_ckpt", "eval_report", "hf_export"}
    assert plan_misses(folder) == expected
    assert stale_keys(folder, instance) == expected


@pytest.mark.parametrize("strategy", ["first_exhausted", "all_exhausted"])
def test_each_stop_strategy_trains_through_dagster(tmp_path, strategy):
    """The other two stop strategies through Dagster: train_ckpt (and what it reads) materializes
    and ends, before its configured steps, at the step the walk over the restart order's rows
    finds (as from the command line, tests/test_mixture_cli.py)."""
    from test_mixture_cli import walk_end

    folder = tmp_path / "experiments"
    folder.mkdir()
    cfg = mixture_config(tmp_path, WEIGHTS, stop_strategy=strategy)
    cfg["trainer"].update(train_batch_size=64, num_train_steps=60)  # a component runs out within the run
    (folder / "default.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    defs = definitions(folder)
    graph = defs.resolve_asset_graph()
    wanted = [k for k in dg.AssetSelection.keys("train_ckpt").upstream().resolve(graph) if graph.get(k).is_materializable]
    result = defs.resolve_job_def(PIPELINE_JOB).execute_in_process(instance=dg.DagsterInstance.ephemeral(),
                                                                   asset_selection=wanted)
    assert result.success
    (exp,) = load_experiments(folder)
    pipe = exp.fresh_pipeline(ArtifactStore(exp.store_root))
    assert pipe.cfg.data.stop_strategy == strategy
    final = materializations(result)["train_ckpt"].metadata["final_step"].value
    end = walk_end(pipe, strategy)
    assert end < pipe.cfg.trainer.num_train_steps  # the strategy, not the step count, ends the run
    assert final == end
