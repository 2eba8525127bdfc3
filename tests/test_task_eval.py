"""The ``task_eval`` stage (lm_pipeline/steps/task_eval.py) through the command line and the plan.

A Levanter-style config with an ``eval_harness:`` section over local task files (HellaSwag- and
ARC-shaped, tests/helpers/harness_tasks.py) trains a tiny model and evaluates its tasks with
``lm-pipeline task-eval``; the scores are those of the harness run directly on the same checkpoint
(:func:`lm_pipeline.eval.tasks.evaluate_tasks`), with their standard errors. Editing a task file
makes exactly that experiment's task evaluation a miss; a config without tasks has no task_eval.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
import yaml
from helpers import pipeline as pt
from helpers.harness_tasks import write_tasks

from lm_pipeline.cli import main

pytest.importorskip("lm_eval")
TASKS = ["tiny_hellaswag", {"task": "tiny_arc", "num_fewshot": 1, "task_alias": "tiny_arc_1shot"}]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def levanter_config(tmp: Path, tasks: Path) -> Path:
    """The tiny experiment as a Levanter config with an ``eval_harness:`` section of local tasks."""
    cfg = pt.tiny_config(tmp)
    cfg["eval_harness"] = {"task_spec": TASKS, "max_examples": 4, "include_path": [str(tasks)], "bootstrap_iters": 10}
    cfg["eval_harness_steps"] = 50
    path = tmp / "levanter.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("task_eval")
    tasks = write_tasks(tmp / "tasks", n_docs=4)
    config = levanter_config(tmp, tasks)
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        assert main(["task-eval", "--config_path", str(config)]) == 0  # trains, then evaluates
    printed = json.loads(out.getvalue())
    return {"tmp": tmp, "config": config, "tasks": tasks, "printed": printed}


def _pipe(config: Path):
    from lm_pipeline.config import load_config
    from lm_pipeline.steps import Pipeline

    return Pipeline(load_config(str(config)), progress=False)


def _plan(config: Path) -> dict[str, tuple[bool, list[str]]]:
    return {r["stage"]: (r["hit"], r["changes"]) for r in _pipe(config).plan()}


def test_a_levanter_config_trains_and_evaluates_its_tasks_as_the_harness_does(run, tmp_path):
    from lm_pipeline.eval.tasks import evaluate_tasks, metrics

    pipe = _pipe(run["config"])
    final = pipe.cached("train_ckpt").manifest["final_checkpoint"]
    res = pipe.cached("task_eval")
    assert run["printed"]["hit"] is False and run["printed"]["step"] == 6 and res.manifest["checkpoint"] == final
    built = json.loads(Path(res.path, "harness_results.json").read_text())
    assert built["n-shot"] == {"tiny_hellaswag": 0, "tiny_arc_1shot": 1}
    assert {t: n["effective"] for t, n in built["n-samples"].items()} == {"tiny_hellaswag": 4, "tiny_arc_1shot": 4}
    reference, _ = evaluate_tasks(final, pipe.cfg.eval_harness, str(tmp_path / "ref"), log_samples=True)
    assert metrics(reference) == pytest.approx(metrics(built), rel=1e-6)
    # each score and its standard error from the per-document scores: mean, sample std / sqrt(n)
    want = {}
    for task, samples in reference["samples"].items():
        for metric in ("acc", "acc_norm"):
            xs = [float(s[metric]) for s in samples]
            mean = sum(xs) / len(xs)
            want[f"{task}/{metric}"] = mean
            want[f"{task}/{metric}/stderr"] = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) / len(xs))
    rows = {f"{r['task']}/{r['metric']}{suffix}": r[key] for r in res.manifest["rows"]
            for key, suffix in (("value", ""), ("stderr", "/stderr"))}
    assert rows == pytest.approx(want, rel=1e-6) and len(want) == 8


def test_a_second_run_is_a_hit_and_the_plan_and_lineage_show_the_stage(run, capsys):
    from lm_pipeline.steps.lineage import lineage

    assert main(["task-eval", "--config_path", str(run["config"])]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["hit"] is True and again["fingerprint"] == run["printed"]["fingerprint"]
    plan = _plan(run["config"])
    assert list(plan)[-1] == "task_eval" and plan["task_eval"] == (True, [])
    pipe = _pipe(run["config"])
    chain = [s["stage"] for s in lineage(pipe.store, "task_eval", again["fingerprint"])]
    assert chain == ["task_eval", "train_ckpt", "token_cache", "tokenizer", "raw_shards"]


def test_editing_a_task_file_makes_only_the_task_evaluation_a_miss(run):
    before = _plan(run["config"])
    path = run["tasks"] / "tiny_hellaswag.validation.jsonl"
    text = path.read_text()
    try:
        path.write_text(text + text.splitlines()[0] + "\n")  # one more document
        after = _plan(run["config"])
        assert {s for s, (hit, _) in after.items() if not hit} == {s for s, (hit, _) in before.items() if not hit} | {"task_eval"}
        assert [c.split(":")[0] for c in after["task_eval"][1]] == ["inputs.include_path[0]/tiny_hellaswag.validation.jsonl"]
    finally:
        path.write_text(text)
    assert _plan(run["config"])["task_eval"] == (True, [])


def test_the_task_files_are_named_by_content_not_by_where_they_lie(run, tmp_path):
    """The same task files in another directory, spelled another way: the same address (a hit);
    one byte changed there: a miss."""
    import shutil

    moved = tmp_path / "elsewhere" / "tasks"
    shutil.copytree(run["tasks"], moved)
    cfg = yaml.safe_load(run["config"].read_text())
    cfg["eval_harness"]["include_path"] = [f"{moved.parent}/./tasks/"]
    config = run["tmp"] / "moved.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert _plan(config)["task_eval"] == (True, [])
    target = moved / "tiny_arc.validation.jsonl"
    target.write_text(target.read_text().replace("a", "b", 1))
    assert _plan(config)["task_eval"][0] is False


def test_the_scores_over_steps_and_the_table_per_task(run):
    from lm_pipeline.steps import task_eval

    pipe = _pipe(run["config"])
    run_dir = pipe.cached("train_ckpt").manifest["run_dir"]
    early = pipe.build("task_eval", checkpoint=str(Path(run_dir, "step-3")))  # the run's other checkpoint
    final = pipe.cached("task_eval")
    assert early.manifest["step"] == 3 and early.fingerprint != final.fingerprint
    assert [m["step"] for m in task_eval.history(final)] == [3, 6]
    shown = task_eval.metadata(final)
    table = shown["task_tiny_arc_1shot"]
    assert [c for c, _ in table.columns] == ["metric", "value", "stderr"]
    assert {r["metric"]: (r["value"], r["stderr"]) for r in table.rows} == {
        r["metric"]: (r["value"], r["stderr"]) for r in final.manifest["rows"] if r["task"] == "tiny_arc_1shot"}
    assert shown["task_scores_over_steps"].png.startswith(b"\x89PNG")
    assert shown["task_scores_over_steps"].title == "task scores over 2 evaluated checkpoints"


def test_a_config_without_tasks_has_no_task_evaluation(tmp_path, capsys):
    config = pt.write_config(tmp_path)
    pipe = _pipe(config)
    assert "task_eval" not in pipe.stages and "task_eval" not in [r["stage"] for r in pipe.plan()]
    assert main(["task-eval", "--config_path", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: config: stage 'task_eval' does not apply to this experiment: its config has no "
                   "eval_harness tasks (eval_harness.task_spec)")
    assert not (tmp_path / "store").exists()  # refused before any work


def test_the_comparison_shows_task_scores_side_by_side(run, tmp_path):
    """An experiment with tasks beside one without: a column per task and metric, empty for the other."""
    from lm_pipeline.steps import comparison

    pipe = _pipe(run["config"])
    other = _pipe(pt.write_config(run["tmp"], "plain.yaml"))  # the same data and run, no eval_harness
    assert "task_eval" not in other.stages and other.address("train_ckpt") == pipe.address("train_ckpt")
    res = comparison.compare(pipe.store, {"tasks": pipe, "plain": other})
    shown = comparison.metadata(res)
    scores = {f"{r['task']}/{r['metric']}": r["value"] for r in pipe.cached("task_eval").manifest["rows"]}
    rows = {r["experiment"]: r for r in shown["comparison"].rows}
    assert [c for c, _ in shown["comparison"].columns][-4:] == sorted(scores)
    assert {c: rows["tasks"][c] for c in scores} == scores and all(rows["plain"][c] is None for c in scores)
    assert res.manifest["inputs"]["tasks"]["task_eval"] == pipe.cached("task_eval").fingerprint
    assert "task_eval" not in res.manifest["inputs"]["plain"]
    md = shown["comparison_md"].text.splitlines()
    assert md[0].endswith(" | ".join(sorted(scores)) + " |") and md[3].startswith("| plain |") and md[3].endswith("| — | — | — | — |")
    assert md[2].startswith("| tasks |") and md[2].endswith(" | ".join(f"{scores[c]:.4g}" for c in sorted(scores)) + " |")


def test_only_an_experiment_with_tasks_has_task_evaluation_assets(tmp_path):
    """In one deployment, the experiment with tasks has task_eval and its per-checkpoint partitions
    (in its evaluation job, beside checkpoint_eval); the other has neither, its graph as before."""
    import dagster as dg

    from assets.experiment import load_experiments
    from assets.pipeline import EVALUATION_POOL, LINEAGE, build_definitions

    harness = {"task_spec": ["tiny_hellaswag"], "include_path": [str(write_tasks(tmp_path / "tasks", n_docs=2))]}
    folder = pt.write_experiments(tmp_path, {"tasks": {"eval_harness": harness}, "plain": {}})
    defs = build_definitions(load_experiments(folder))
    keys = {k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys()}
    own = {"data_sources", "checkpoint_eval", *LINEAGE}
    assert keys == {f"plain/{s}" for s in own} | {f"tasks/{s}" for s in (*own, "task_eval", "checkpoint_task_eval")} | {
        "experiments/comparison"}
    graph = defs.resolve_asset_graph()
    assert graph.get(dg.AssetKey(["tasks", "task_eval"])).parent_keys == {dg.AssetKey(["tasks", "train_ckpt"]),
                                                                         dg.AssetKey(["tasks", "data_sources"])}
    part = graph.get(dg.AssetKey(["tasks", "checkpoint_task_eval"]))
    assert part.partitions_def.name == "checkpoints_tasks" and part.pools == {EVALUATION_POOL}
    jobs = {n: {k.to_user_string() for k in defs.resolve_job_def(n).asset_layer.selected_asset_keys}
            for n in ("evaluate_tasks", "evaluate_plain")}
    assert jobs == {"evaluate_tasks": {"tasks/checkpoint_eval", "tasks/checkpoint_task_eval"},
                    "evaluate_plain": {"plain/checkpoint_eval"}}


def test_an_unknown_task_is_one_line_before_any_training(tmp_path, capsys):
    tasks = write_tasks(tmp_path / "tasks", n_docs=2)
    config = pt.write_config(tmp_path, eval_harness={"task_spec": ["tiny_hellaswag", "tiny_hellaswog"],
                                                     "include_path": [str(tasks)]})
    assert main(["task-eval", "--config_path", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: config field 'eval_harness.task_spec[1]': no task or group 'tiny_hellaswog' in the "
                       "harness or include_path (did you mean 'tiny_hellaswag'?)")
    assert not (tmp_path / "store" / "train_ckpt").exists()
