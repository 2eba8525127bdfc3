"""The task evaluation through Dagster: two experiments, each with its own local task files, on
one instance. The pipeline evaluates each run's final checkpoint (``<experiment>/task_eval``);
``new_checkpoint_sensor`` requests each checkpoint's evaluations exactly once, and each run of an
experiment's evaluation job materializes ``<experiment>/checkpoint_task_eval`` for it (the final
step's a cache hit of ``task_eval``: the same address). Nothing changed: every one a hit with the
same data version. One task file edited: exactly that experiment's task evaluations are stale
(both checkpoints and the final one), as ``lm-pipeline plan`` says; re-evaluated, fresh again."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._core.loader import LoadingContextForTest
from helpers import pipeline as pt
from helpers.harness_tasks import write_tasks

from assets.experiment import load_experiments
from assets.pipeline import LINEAGE, PIPELINE_JOB, build_definitions
from resources import TrainingLauncherResource

pytest.importorskip("lm_eval")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::dagster.BetaWarning")]
NAMES = ("gpt", "llama")


def _experiments(tmp: Path) -> Path:
    def harness(tasks: Path) -> dict:
        return {"task_spec": ["tiny_hellaswag", {"task": "tiny_arc", "num_fewshot": 1}], "max_examples": 4,
                "include_path": [str(tasks)], "bootstrap_iters": 10}

    return pt.write_experiments(tmp, {
        "gpt": {"eval_harness": harness(write_tasks(tmp / "tasks_gpt", n_docs=4))},
        "llama": {"model": pt.TINY_LLAMA, "eval_harness": harness(write_tasks(tmp / "tasks_llama", n_docs=4, seed=1))}})


class Walk:
    def __init__(self, tmp: Path, instance: dg.DagsterInstance):
        self.folder, self.instance = _experiments(tmp), instance

    def defs(self) -> dg.Definitions:
        return build_definitions(load_experiments(self.folder),
                                 resources={"training": TrainingLauncherResource(mode="in_process", poll_seconds=0.2)},
                                 executor=dg.in_process_executor)

    def evaluate(self, requests) -> dict[tuple[str, str], dg.AssetMaterialization]:
        """Run each request's evaluation job; (asset, partition) -> its task evaluation's materialization."""
        defs, out = self.defs(), {}
        for req in requests:
            result = defs.resolve_job_def(req.job_name).execute_in_process(
                instance=self.instance, partition_key=req.partition_key, tags=req.tags)
            assert result.success
            for m in result.asset_materializations_for_node(_node(req.job_name)):
                out[(m.asset_key.to_user_string(), req.partition_key)] = m
        return out

    def status(self) -> dict[tuple[str, str | None], StaleStatus]:
        graph = self.defs().resolve_asset_graph()
        resolver = CachingStaleStatusResolver(self.instance, graph, LoadingContextForTest(self.instance))
        out = {}
        for n in NAMES:
            key = dg.AssetKey([n, "checkpoint_task_eval"])
            for part in self.instance.get_dynamic_partitions(f"checkpoints_{n}"):
                out[(key.to_user_string(), part)] = resolver.get_status(key, part)
                out[(f"{n}/checkpoint_eval", part)] = resolver.get_status(dg.AssetKey([n, "checkpoint_eval"]), part)
            for s in (*LINEAGE, "task_eval"):
                out[(f"{n}/{s}", None)] = resolver.get_status(dg.AssetKey([n, s]))
        return out

    def misses(self) -> set[str]:
        from lm_pipeline.store import ArtifactStore

        return {f"{e.name}/{r['stage']}" for e in load_experiments(self.folder)
                for r in e.fresh_pipeline(ArtifactStore(e.store_root)).plan() if not r["hit"]}


def _node(job: str) -> str:
    return f"{job.removeprefix('evaluate_')}__checkpoint_task_eval"


def _sensor(w: Walk):
    defs = w.defs()
    result = defs.resolve_sensor_def("new_checkpoint_sensor")(dg.build_sensor_context(instance=w.instance, definitions=defs))
    for req in result.dynamic_partitions_requests:
        w.instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
    return result


def test_task_evaluations_per_experiment_and_checkpoint_cached_and_staled_by_their_task_files(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    w = Walk(tmp_path, dg.DagsterInstance.ephemeral())
    first = w.defs().resolve_job_def(PIPELINE_JOB).execute_in_process(instance=w.instance)
    assert first.success
    final = {n: first.asset_materializations_for_node(f"{n}__task_eval")[0] for n in NAMES}
    assert all(m.metadata["cache_hit"].value is False for m in final.values())
    # the comparison: each experiment's task scores side by side, as its task_eval shows them
    table = first.asset_materializations_for_node("experiments__comparison")[0].metadata["comparison"].value
    compared = {r.data["experiment"]: r.data for r in table.records}
    for n in NAMES:
        scores = {f"{t}/{r.data['metric']}": r.data["value"] for t in ("tiny_hellaswag", "tiny_arc")
                  for r in final[n].metadata[f"task_{t}"].value.records}
        assert len(scores) == 4 and {c: compared[n][c] for c in scores} == scores

    # the sensor: each experiment's two checkpoints, requested once; each run evaluates both ways
    result = _sensor(w)
    assert sorted((r.job_name, int(r.partition_key[-7:])) for r in result.run_requests) == [
        ("evaluate_gpt", 3), ("evaluate_gpt", 6), ("evaluate_llama", 3), ("evaluate_llama", 6)]
    built = w.evaluate(result.run_requests)
    assert len(built) == 4
    for (key, part), m in built.items():
        name, step = key.split("/")[0], int(part[-7:])
        assert m.metadata["step"].value == step
        # the final checkpoint's evaluation is the pipeline's task_eval: the same address, a hit
        assert m.metadata["cache_hit"].value is (step == 6)
        if step == 6:
            assert m.tags["dagster/data_version"] == final[name].tags["dagster/data_version"]
        assert {r.data["metric"] for r in m.metadata["task_tiny_hellaswag"].value.records} == {"acc", "acc_norm"}
        assert all(r.data["stderr"] >= 0 for r in m.metadata["task_tiny_arc"].value.records)
    assert not _sensor(w).run_requests  # exactly once
    steps3 = {k: m for k, m in built.items() if k[1].endswith("3")}
    assert all("task_scores_over_steps" in m.metadata for m in steps3.values())

    # nothing changed: every evaluation a cache hit with the same data version; nothing stale
    again = w.evaluate(result.run_requests)
    assert all(m.metadata["cache_hit"].value for m in again.values())
    assert {k: m.tags["dagster/data_version"] for k, m in again.items()} == {
        k: m.tags["dagster/data_version"] for k, m in built.items()}
    assert set(w.status().values()) == {StaleStatus.FRESH} and w.misses() == set()

    # one task file of gpt edited: gpt's task evaluations stale (both checkpoints, the final one), as the plan says
    path = tmp_path / "tasks_gpt" / "tiny_arc.validation.jsonl"
    path.write_text(path.read_text() + path.read_text().splitlines()[0] + "\n")
    stale = {k for k, v in w.status().items() if v == StaleStatus.STALE}
    assert stale == {("gpt/checkpoint_task_eval", p) for p in w.instance.get_dynamic_partitions("checkpoints_gpt")} | {
        ("gpt/task_eval", None)}
    assert w.misses() == {"gpt/task_eval"}

    # re-evaluated: new results; the final checkpoint's is then gpt/task_eval's too (a hit); fresh again
    redone = w.evaluate([r for r in result.run_requests if r.job_name == "evaluate_gpt"])
    assert all(m.metadata["cache_hit"].value is False for m in redone.values())
    assert all(m.tags["dagster/data_version"] != built[k].tags["dagster/data_version"] for k, m in redone.items())
    assert {k for k, v in w.status().items() if v == StaleStatus.STALE} == {("gpt/task_eval", None)}
    assert w.misses() == set()
    rerun = w.defs().resolve_job_def("pipeline_gpt").execute_in_process(instance=w.instance)
    assert rerun.asset_materializations_for_node("gpt__task_eval")[0].metadata["cache_hit"].value is True
    assert set(w.status().values()) == {StaleStatus.FRESH}
