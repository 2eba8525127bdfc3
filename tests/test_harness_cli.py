"""``lm-pipeline eval`` with lm-evaluation-harness tasks, end to end.

A Levanter-style config with an ``eval_harness:`` section (local task files: HellaSwag-, ARC-,
LAMBADA-shaped and a generate_until task) trains a tiny model through the command line; ``eval``
then writes the loss report and the harness's results; ``eval --tasks`` on the checkpoint and on
its Hugging Face export give the metrics of the harness's own HF backend on that export.
Bad task names end in one line, before any model is loaded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from helpers.harness_tasks import write_tasks

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")

from helpers import pipeline as pt  # noqa: E402  (tests/helpers/pipeline.py)

from lm_pipeline.cli import main  # noqa: E402

TASKS = ["tiny_hellaswag", {"task": "tiny_arc", "num_fewshot": 1, "task_alias": "tiny_arc_1shot"}, "tiny_lambada",
         "tiny_qa"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("harness_cli")
    tasks = write_tasks(tmp / "tasks", n_docs=4)
    cfg = pt.tiny_config(tmp)
    cfg["trainer"].update({"num_train_steps": 2, "steps_per_eval": 100})
    cfg["eval"] = {"batch_size": 2}
    cfg["eval_harness"] = {"task_spec": TASKS, "max_examples": 4, "include_path": [str(tasks)]}
    cfg["eval_harness_steps"] = 50
    config = tmp / "levanter.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        assert main(["train", "--config_path", str(config)]) == 0
    from lm_pipeline.config import load_config
    from lm_pipeline.steps import Pipeline

    ckpt = Pipeline(load_config(str(config)), progress=False).cached("train_ckpt").manifest["final_checkpoint"]
    return {"tmp": tmp, "config": str(config), "ckpt": ckpt, "tasks": tasks}


def _metrics(out: Path) -> dict[str, float]:
    from lm_pipeline.eval.tasks import metrics

    return metrics(json.loads((out / "harness_results.json").read_text()))


@pytest.mark.slow
def test_a_levanter_config_trains_and_evaluates_its_tasks(run, tmp_path):
    out = tmp_path / "eval"
    assert main(["eval", "--config_path", run["config"], "--output_dir", str(out)]) == 0
    assert (out / "eval_report.json").exists()  # the validation sets, then the tasks
    results = json.loads((out / "harness_results.json").read_text())
    assert set(results["results"]) == {"tiny_hellaswag", "tiny_arc_1shot", "tiny_lambada", "tiny_qa"}
    assert results["n-shot"]["tiny_arc_1shot"] == 1 and all(n == 4 for n in
                                                             (v["effective"] for v in results["n-samples"].values()))


@pytest.mark.slow
def test_tasks_on_the_checkpoint_and_its_export_give_the_hf_backends_metrics(run, tmp_path):
    from lm_eval.models.huggingface import HFLM

    from lm_pipeline.eval.harness_config import EvalHarnessConfig
    from lm_pipeline.eval.tasks import metrics, run_tasks, task_manager
    from lm_pipeline.schema import from_dict

    hf = tmp_path / "hf"
    assert main(["export", "--config_path", run["config"], "--checkpoint_path", run["ckpt"], "--output_dir", str(hf)]) == 0
    names = "tiny_hellaswag,tiny_arc:1,tiny_lambada,tiny_qa"
    for source, out in ((run["ckpt"], tmp_path / "ckpt"), (str(hf), tmp_path / "export")):
        assert main(["eval", "--config_path", run["config"], "--checkpoint_path", source, "--tasks", names,
                     "--output_dir", str(out)]) == 0
        assert not (out / "eval_report.json").exists()  # --tasks: the tasks only
    cfg = from_dict(EvalHarnessConfig, {"task_spec": ["tiny_hellaswag", {"task": "tiny_arc", "num_fewshot": 1,
                                                                         "task_alias": "tiny_arc_1shot"},
                                                      "tiny_lambada", "tiny_qa"],
                                        "max_examples": 4, "include_path": [str(run["tasks"])]})
    ref = metrics(run_tasks(HFLM(pretrained=str(hf), device="cpu", batch_size=4, dtype="float32"), cfg,
                            task_manager(cfg)))
    for out in (tmp_path / "ckpt", tmp_path / "export"):
        ours = _metrics(out)
        assert set(ours) == set(ref) and "lm_eval/tiny_lambada/perplexity" in ours
        for name, value in ours.items():
            assert math.isclose(value, ref[name], rel_tol=1e-4), (out.name, name, value, ref[name])


def test_unknown_tasks_and_paths_fail_in_one_line_before_any_model_loads(tmp_path, capsys):
    missing_ckpt = tmp_path / "no-checkpoint"  # the tasks are checked first
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"eval_harness": {"include_path": [str(tmp_path / "nowhere")]}}))
    code = main(["eval", "--config_path", str(config), "--checkpoint_path", str(missing_ckpt), "--tasks", "x"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "eval_harness.include_path[0]" in err and "nowhere" in err


def test_task_names_are_checked_together(tmp_path, capsys):
    tasks = write_tasks(tmp_path / "tasks", n_docs=2)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"eval_harness": {"include_path": [str(tasks)]}}))
    code = main(["eval", "--config_path", str(config), "--checkpoint_path", str(tmp_path / "none"), "--tasks",
                 "tiny_hellaswag,tiny_hellswag,nonesuch:2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "task_spec[1]" in err and "did you mean 'tiny_hellaswag'" in err and "task_spec[2]" in err
