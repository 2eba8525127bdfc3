"""The comparison of experiments records what it read: after an added experiment retrains, the
comparison is stale, and materializing it fails in one line until Dagster records the new run's
evaluation report -- whether checkpoint_eval has built that report already (then materializing
eval_report is a cache hit) or not; once recorded, the input versions Dagster records for the
comparison are exactly the runs and reports its comparison.json names."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._core.loader import LoadingContextForTest
from helpers import pipeline as pt

from assets.deployment import COMPARISON_KEY
from assets.experiment import load_experiments
from assets.pipeline import PIPELINE_JOB, build_definitions, checkpoint_key
from lm_pipeline.steps import comparison
from resources import TrainingLauncherResource

pytestmark = pytest.mark.filterwarnings("ignore::dagster.BetaWarning")
INPUT_TAG = "dagster/input_data_version/"


class Walk:
    """A deployment's folder of experiments over one Dagster instance."""

    def __init__(self, tmp: Path):
        self.tmp, self.folder = tmp, pt.write_experiments(tmp, {"gpt": {}})
        self.instance = dg.DagsterInstance.ephemeral()

    def defs(self) -> dg.Definitions:
        return build_definitions(load_experiments(self.folder, overrides=""), executor=dg.in_process_executor,
                                 resources={"training": TrainingLauncherResource(mode="in_process", poll_seconds=0.2)})

    def materialize(self, *keys: str, raise_on_error: bool = True):
        job = self.defs().resolve_implicit_global_asset_job_def()
        return job.execute_in_process(instance=self.instance, raise_on_error=raise_on_error,
                                      asset_selection=[dg.AssetKey.from_user_string(k) for k in keys])

    def add(self, name: str, learning_rate: float) -> None:
        """Add (or edit) experiment ``name``: the shared data and tokenizer, its own training run."""
        cfg = pt.tiny_config(self.tmp, optimizer={"learning_rate": learning_rate})
        (self.folder / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    def pipe(self, name: str):
        exp = {e.name: e for e in load_experiments(self.folder, overrides="")}[name]
        return exp.fresh_pipeline(exp.pipeline().store)

    def status(self) -> StaleStatus:
        graph = self.defs().resolve_asset_graph()
        resolver = CachingStaleStatusResolver(self.instance, graph, LoadingContextForTest(self.instance))
        return resolver.get_status(COMPARISON_KEY)

    def latest(self) -> dg.AssetMaterialization:
        return self.instance.get_latest_materialization_event(COMPARISON_KEY).asset_materialization

    def recorded_and_used(self) -> tuple[dict[str, str], dict[str, str]]:
        """The comparison's input versions as Dagster records them, and the runs and reports its
        comparison.json names (read from the artifact, not from the metadata)."""
        m = self.latest()
        recorded = {k[len(INPUT_TAG):]: v for k, v in m.tags.items() if k.startswith(INPUT_TAG)}
        rows = json.loads(Path(m.metadata["path"].value, "comparison.json").read_text())
        used = {f"{r['experiment']}/{s}": r[s] for r in rows for s in ("train_ckpt", "eval_report")}
        return recorded, used

    def failure(self) -> str:
        """Materialize the comparison, which must fail: its one-line message."""
        before = self.instance.get_latest_materialization_event(COMPARISON_KEY).timestamp
        result = self.materialize(COMPARISON_KEY.to_user_string(), raise_on_error=False)
        assert not result.success  # and nothing recorded:
        assert self.instance.get_latest_materialization_event(COMPARISON_KEY).timestamp == before
        event = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        message = str(event.step_failure_data.error.message).strip()
        assert "\n" not in message
        return message

    def evaluate_final_checkpoint(self, name: str, run: str, step: int) -> None:
        """What new_checkpoint_sensor requests for the run's final checkpoint, run as it would be."""
        defs = self.defs()
        ticked = defs.resolve_sensor_def("new_checkpoint_sensor")(
            dg.build_sensor_context(instance=self.instance, definitions=defs))
        for req in ticked.dynamic_partitions_requests:
            self.instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
        req = next(r for r in ticked.run_requests if r.partition_key == checkpoint_key(run, step)
                   and r.job_name == f"evaluate_{name}")
        assert defs.resolve_job_def(req.job_name).execute_in_process(
            instance=self.instance, partition_key=req.partition_key, tags=req.tags).success


@pytest.mark.slow  # two experiments trained, one retrained, through Dagster: ~60 s
def test_after_an_added_experiment_retrains_the_comparison_reads_what_dagster_records_or_fails(tmp_path):
    w = Walk(tmp_path)
    assert w.defs().resolve_asset_graph().get(COMPARISON_KEY).code_version == str(comparison.CODE_VERSION)
    assert w.defs().resolve_job_def(PIPELINE_JOB).execute_in_process(instance=w.instance).success
    w.add("mine", 2e-3)  # an added experiment: shares the cache, trains its own run
    assert w.defs().resolve_job_def(PIPELINE_JOB).execute_in_process(instance=w.instance).success
    recorded, used = w.recorded_and_used()
    assert recorded == used and set(used) == {f"{n}/{s}" for n in ("gpt", "mine") for s in ("train_ckpt", "eval_report")}
    assert None not in used.values() and w.status() == StaleStatus.FRESH

    w.add("mine", 3e-3)  # edited: retrains; its eval_report is not rebuilt
    old_report = used["mine/eval_report"]
    assert w.materialize("mine/train_ckpt").success
    assert w.status() == StaleStatus.STALE  # a new run of one of its inputs
    new = w.pipe("mine")
    want = new.address("eval_report").fingerprint
    assert want != old_report and new.cached("eval_report") is None
    message = w.failure()
    assert (f"experiments/comparison reads mine's eval_report {want}, which is not built: "
            "materialize mine/eval_report first") in message

    # the final checkpoint evaluated by checkpoint_eval: the report is in the store, Dagster's
    # eval_report asset still records the old one
    w.evaluate_final_checkpoint("mine", new.address("train_ckpt").fingerprint, 6)
    assert new.cached("eval_report") is not None
    message = w.failure()
    assert (f"experiments/comparison reads mine's eval_report {want}, which is complete in the store "
            "(a cache hit) but not recorded by Dagster: materialize mine/eval_report first") in message

    report = w.materialize("mine/eval_report")  # a cache hit: checkpoint_eval built it
    assert report.success
    hits = [e.event_specific_data.materialization.metadata["cache_hit"].value for e in report.all_events
            if e.event_type_value == "ASSET_MATERIALIZATION"]
    assert hits == [True]
    assert w.status() == StaleStatus.STALE
    assert w.materialize(COMPARISON_KEY.to_user_string()).success
    recorded, used = w.recorded_and_used()
    assert recorded == used and used["mine/eval_report"] == want
    assert used["mine/train_ckpt"] == new.address("train_ckpt").fingerprint
    assert w.latest().metadata["input_fingerprints"].value == used
    assert w.status() == StaleStatus.FRESH
