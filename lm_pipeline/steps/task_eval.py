"""The ``task_eval`` stage: downstream tasks of lm-evaluation-harness (the config's ``eval_harness:``
section, :mod:`lm_pipeline.eval.tasks`) on one checkpoint of the run.

Its address covers the checkpoint (the run's fingerprint and the step), the semantic part of the
section (the tasks with their overrides and few-shot counts, ``max_examples``, ``max_eval_length``,
``bootstrap_iters``, ``add_bos_token``, ``apply_chat_template``, the evaluation's compute dtype),
the harness's version (its seeds are its defaults, fixed by the version) and the sha256 of every
file under ``include_path`` (task YAML files and their local data): editing a task file makes
exactly the task evaluations of the experiments that include it stale. ``batch_size`` and
``log_samples`` change no score. An experiment without tasks has no ``task_eval`` stage.
"""

from __future__ import annotations

import os
from typing import Any

from lm_pipeline.steps.display import Image, Path, Table, common
from lm_pipeline.steps.stage import Stage

NAME = "task_eval"
COLUMNS = (("metric", "string"), ("value", "float"), ("stderr", "float"))


def not_applicable(pipe) -> str | None:
    h = pipe.cfg.eval_harness
    return None if h is not None and h.task_spec else "its config has no eval_harness tasks (eval_harness.task_spec)"


def config(pipe) -> dict[str, Any]:
    """The section's semantic fields (not ``batch_size``, ``log_samples``) and the compute dtype."""
    from lm_pipeline.fingerprint import semantic_view

    view = semantic_view(pipe.cfg.eval_harness)
    view.pop("include_path", None)  # named by content (sources), never by path, as a local tokenizer is
    return {**view, "compute_dtype": pipe.eval_config.compute_dtype}


#: Under an ``include_path``, what is not a task's source: hidden files and directories (``.git``),
#: and the bytecode Python writes beside a task's ``!function`` module when the harness imports it
#: (``__pycache__``), which would otherwise change the version after the first evaluation.
_SKIPPED_DIRS = ("__pycache__",)
_SKIPPED_SUFFIXES = (".pyc", ".pyo")


def _files(root: str) -> list[str]:
    if os.path.isfile(root):
        return [root]
    out = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if not x.startswith(".") and x not in _SKIPPED_DIRS]
        out += [os.path.join(d, f) for f in names if not f.startswith(".") and not f.endswith(_SKIPPED_SUFFIXES)]
    return sorted(out)


def sources(pipe, content: bool) -> dict[str, Any]:
    """The harness's version and every local task file's sha256 (small files: hashed also without
    ``content``, like a local tokenizer), keyed ``include_path[<i>]/<relative path>``: by content
    and place within the entry, not by how the entry's path is spelled."""
    from importlib.metadata import version

    from lm_pipeline import fs
    from lm_pipeline.schema import ConfigError

    out: dict[str, Any] = {"lm_eval": version("lm_eval")}
    for i, root in enumerate(pipe.cfg.eval_harness.include_path):
        if not os.path.exists(root):
            raise ConfigError(f"eval_harness.include_path[{i}]", f"{root} does not exist (give a directory or file "
                              "of task YAML files)")
        for path in _files(root):
            rel = os.path.relpath(path, root) if path != root else os.path.basename(path)
            out[f"include_path[{i}]/{rel}"] = fs.sha256_of(path)
    return out


def result_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """``{task, metric, value, stderr}`` per numeric metric of the harness's results (``acc,none``
    -> ``acc``, its ``acc_stderr,none`` as the stderr; None where not computed)."""
    from lm_pipeline.eval.tasks import metrics

    flat = metrics(results)
    rows = []
    for key, value in flat.items():
        _, task, metric = key.split("/", 2)
        if metric.endswith("_stderr") or metric == "sample_len":  # a count, not a score
            continue
        rows.append({"task": task, "metric": metric, "value": value, "stderr": flat.get(f"lm_eval/{task}/{metric}_stderr")})
    return rows


def build(ctx, inputs, checkpoint: str | None = None):
    """Run the section's tasks on a checkpoint (default: the run's final one); the harness's
    results are written to ``harness_results.json`` in the artifact. The task names are checked
    before a run that is not trained yet trains (else before the model is loaded)."""
    from lm_pipeline.eval.tasks import evaluate_tasks, prepare_tasks

    manager = prepare_tasks(ctx.cfg.eval_harness) if checkpoint is None and not inputs.complete("train_ckpt") else None
    ckpt, step = inputs.checkpoint(checkpoint)

    def write(path: str):
        import time

        t0 = time.perf_counter()
        results, files = evaluate_tasks(ckpt, ctx.cfg.eval_harness, path, manager=manager,
                                        compute_dtype=ctx.eval_config.compute_dtype, store_root=ctx.cfg.store.root)
        rows = result_rows(results)
        summary = {"step": step, "checkpoint": ckpt, "eval_seconds": round(time.perf_counter() - t0, 3),
                   **{f"{r['task']}/{r['metric']}": r["value"] for r in rows}}
        return summary, {"checkpoint": ckpt, "step": step, "files": files, "rows": rows,
                         "n_samples": {t: n.get("effective") for t, n in (results.get("n-samples") or {}).items()}}

    return ctx.run(write, step=step)


def history(res) -> list[dict[str, Any]]:
    """The manifests of every complete task evaluation of the same run with the same settings
    (checkpoints of one run), by step."""
    from lm_pipeline import fs
    from lm_pipeline.store import ArtifactStore

    store = ArtifactStore(fs.parent(fs.parent(res.path)))
    mine = {k: v for k, v in res.manifest.get("inputs", {}).items() if k != "step"}
    same = [m for m in store.complete(NAME) if m.get("config") == res.manifest.get("config")
            and {k: v for k, v in m.get("inputs", {}).items() if k != "step"} == mine]
    return sorted(same, key=lambda m: m.get("step", 0))


def accuracy_plot(manifests: list[dict[str, Any]]) -> bytes | None:
    """Each task's accuracy (``acc``, else its first metric) over the run's evaluated steps, as a PNG."""
    import tempfile

    from lm_pipeline import fs
    from lm_pipeline.plots import line_plot

    lines: dict[str, list[tuple[float, float]]] = {}
    for m in manifests:
        by_task: dict[str, dict[str, float]] = {}
        for r in m.get("rows") or []:
            by_task.setdefault(r["task"], {})[r["metric"]] = r["value"]
        for task, values in by_task.items():
            metric = "acc" if "acc" in values else next(iter(values))
            lines.setdefault(f"{task} {metric}", []).append((float(m.get("step", 0)), float(values[metric])))
    with tempfile.TemporaryDirectory() as tmp:
        path = line_plot(os.path.join(tmp, "tasks.png"), lines, xlabel="step", ylabel="score",
                         title="downstream tasks per checkpoint", markers=True)
        return fs.read_bytes(path) if path else None


def metadata(res) -> dict[str, Any]:
    """A table per task (metric, value, stderr), the scores over the run's evaluated checkpoints."""
    out = common(res)
    rows = res.manifest.get("rows") or []
    for task in dict.fromkeys(r["task"] for r in rows):
        out[f"task_{task}"] = Table(COLUMNS, tuple({k: v for k, v in r.items() if k != "task" and v is not None}
                                                   for r in rows if r["task"] == task))
    if res.manifest.get("step") is not None:
        out["step"] = int(res.manifest["step"])
    if res.manifest.get("checkpoint"):
        out["checkpoint"] = Path(res.manifest["checkpoint"])
    steps = history(res)
    png = accuracy_plot(steps)
    if png is not None:
        out["task_scores_over_steps"] = Image(f"task scores over {len(steps)} evaluated checkpoints", png)
    return out


TASK_EVAL = Stage(NAME, 1, ("train_ckpt",), config, build, kind="lm_eval", sources=sources, per_checkpoint=True,
                  pool="evaluation", metadata=metadata, not_applicable=not_applicable,
                  command=("task-eval", "run the config's eval_harness tasks on the run's final checkpoint (trains first if needed)"),
                  description="Downstream tasks of lm-evaluation-harness (the eval_harness section) on a checkpoint: "
                              "each task's metrics with their standard errors.")
