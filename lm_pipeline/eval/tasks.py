"""Downstream tasks through lm-evaluation-harness: find the tasks of an ``eval_harness:`` section
(:class:`~lm_pipeline.eval.harness_config.EvalHarnessConfig`), run them on a model, and write the
results.

Tasks are the harness's own definitions: its built-in tasks by name (their data from the
Hugging Face hub, or its local cache) and the YAML task files under ``include_path``. Every
task name is checked before any model is loaded. Results are written atomically to
``<output_dir>/harness_results.json`` (the harness's results, per-task configs, few-shot counts
and sample counts) and, with ``log_samples``, ``samples_<task>.jsonl`` (every document's
requests and responses). :func:`metrics` flattens results into ``lm_eval/<task>/<metric>``.
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Any

from lm_pipeline.data.config import raise_problems
from lm_pipeline.eval.harness_config import EvalHarnessConfig
from lm_pipeline.schema import ConfigError

if TYPE_CHECKING:
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

__all__ = ["RESULTS_FILE", "check_tasks", "evaluate_tasks", "harness_config", "load_tasks", "metrics",
           "prepare_tasks", "results_table", "run_tasks", "task_manager", "write_results"]

RESULTS_FILE = "harness_results.json"


def task_manager(cfg: EvalHarnessConfig) -> TaskManager:
    """The harness's task index: its own tasks plus the files under ``cfg.include_path``
    (relative to the working directory); a missing path is a :class:`ConfigError` naming it."""
    from lm_eval.tasks import TaskManager

    problems = [ConfigError(f"eval_harness.include_path[{i}]", f"{path} does not exist (give a directory or file of "
                            "task YAML files)") for i, path in enumerate(cfg.include_path) if not os.path.exists(path)]
    raise_problems(problems)
    return TaskManager(include_path=list(cfg.include_path) or None)


def check_tasks(cfg: EvalHarnessConfig, manager: TaskManager) -> None:
    """Every task of ``cfg.task_spec`` is one the harness knows; else one error naming them all."""
    if not cfg.task_spec:
        raise ConfigError("eval_harness.task_spec", "no tasks: list some (e.g. [hellaswag]) or pass --tasks")
    known = set(manager.all_tasks)
    problems = []
    for i, task in enumerate(cfg.task_spec):
        name = task if isinstance(task, str) else task.task
        if name not in known:
            import difflib

            hint = difflib.get_close_matches(name, sorted(known), n=1)
            problems.append(ConfigError(f"eval_harness.task_spec[{i}]", f"no task or group {name!r} in the harness "
                                        f"or include_path{f' (did you mean {hint[0]!r}?)' if hint else ''}"))
    raise_problems(problems)


def load_tasks(cfg: EvalHarnessConfig, manager: TaskManager) -> list[Any]:
    """The harness's tasks of ``cfg.task_spec``: a name as the harness loads it; a mapping as the
    task (or each task of the group) it names with the mapping's keys set on its config, and
    under its ``task_alias`` (a task only), so one task can run with two settings."""
    out: list[Any] = []
    for i, spec in enumerate(cfg.task_spec):
        if isinstance(spec, str):
            out.append(spec)
            continue
        loaded = manager.load([spec.task])
        overrides = {k: v for k, v in spec.to_dict().items() if k not in ("task", "task_alias")}
        for task in loaded["tasks"].values():
            for key, value in overrides.items():
                task.set_config(key=key, value=value)
        if spec.task in loaded["groups"]:
            if spec.task_alias:
                raise ConfigError(f"eval_harness.task_spec[{i}].task_alias", f"{spec.task!r} is a group: an alias "
                                  "renames a task (list the group's tasks to rename them)")
            out.append(loaded["groups"][spec.task])
            continue
        (task,) = loaded["tasks"].values()
        if spec.task_alias:
            task.set_config(key="task", value=spec.task_alias)
            task.set_config(key="task_alias", value=spec.task_alias)
        out.append(task)
    return out


def run_tasks(lm: LM, cfg: EvalHarnessConfig, manager: TaskManager, *, log_samples: bool | None = None) -> dict[str, Any]:
    """The harness's results of ``cfg``'s tasks on ``lm`` (``simple_evaluate``'s dict; with
    ``samples`` when ``log_samples`` (default ``cfg.log_samples``))."""
    from lm_eval import simple_evaluate

    return simple_evaluate(
        model=lm, tasks=load_tasks(cfg, manager), limit=cfg.max_examples, bootstrap_iters=cfg.bootstrap_iters,
        log_samples=cfg.log_samples if log_samples is None else log_samples, task_manager=manager,
        apply_chat_template=cfg.apply_chat_template,
    )


def metrics(results: dict[str, Any]) -> dict[str, float]:
    """``{"lm_eval/<task>/<metric>": value}`` of every numeric metric (the harness's
    ``acc,none`` keys lose their ``,none`` filter suffix)."""
    out = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            if key == "alias" or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            metric = key[: -len(",none")] if key.endswith(",none") else key.replace(",", "/")
            if not (isinstance(value, float) and math.isnan(value)):
                out[f"lm_eval/{task}/{metric}"] = float(value)
    return out


def write_results(results: dict[str, Any], output_dir: str) -> dict[str, str]:
    """Write ``harness_results.json`` (and the samples, when present) atomically; their paths."""
    from lm_eval.utils import handle_non_serializable

    from lm_pipeline import fs
    from lm_pipeline.atomic import atomic_write_bytes

    fs.makedirs(output_dir)
    body = {k: v for k, v in results.items() if k != "samples"}
    files = {"results": fs.join(output_dir, RESULTS_FILE)}
    for task, samples in (results.get("samples") or {}).items():
        path = fs.join(output_dir, f"samples_{task}.jsonl")
        lines = "".join(json.dumps(s, default=handle_non_serializable, ensure_ascii=False) + "\n" for s in samples)
        atomic_write_bytes(path, lines.encode("utf-8"))
        files[f"samples_{task}"] = path
    text = json.dumps(body, default=handle_non_serializable, indent=2, ensure_ascii=False) + "\n"
    atomic_write_bytes(files["results"], text.encode("utf-8"))
    return files


def harness_config(section: EvalHarnessConfig | None, tasks: str | None) -> EvalHarnessConfig | None:
    """The tasks to run: ``section`` (the config's ``eval_harness:``) with its task list replaced
    by ``tasks`` when given (``--tasks``: comma-separated names, ``NAME:K`` for K-shot); None
    when there are none."""
    from lm_pipeline.eval.harness_config import HarnessTask
    from lm_pipeline.schema import from_dict, to_dict

    if tasks is None:
        return section if section is not None and section.task_spec else None
    spec: list[Any] = []
    for item in (t.strip() for t in tasks.split(",") if t.strip()):
        name, _, shots = item.partition(":")
        if shots and not shots.isdigit():
            raise ConfigError("tasks", f"{item!r}: write NAME or NAME:K (K few-shot examples), e.g. hellaswag:10")
        spec.append(to_dict(HarnessTask(name, task_alias=f"{name}_{shots}shot", num_fewshot=int(shots))) if shots else name)
    if not spec:
        raise ConfigError("tasks", "names no task; e.g. --tasks hellaswag,arc_easy:5")
    base = to_dict(section) if section is not None else {}
    return from_dict(EvalHarnessConfig, {**base, "task_spec": spec}, "eval_harness")


def prepare_tasks(cfg: EvalHarnessConfig) -> TaskManager:
    """The task index with every task of ``cfg`` checked (before any model is loaded)."""
    if cfg.apply_chat_template:
        raise ConfigError("eval_harness.apply_chat_template", "is not supported here (the run's tokenizer.json "
                          "carries no chat template); set it to false")
    manager = task_manager(cfg)
    check_tasks(cfg, manager)
    return manager


def evaluate_tasks(checkpoint: str, cfg: EvalHarnessConfig, output_dir: str, *, manager: TaskManager | None = None,
                   compute_dtype: Any = None, log_samples: bool | None = None,
                   store_root: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Run ``cfg``'s tasks on a checkpoint or Hugging Face directory and write the results to
    ``output_dir``; (the harness's results, the files written). The task names are checked
    before the model is loaded; ``store_root``: keep compiled programs in the store's XLA cache
    (as evaluation does)."""
    from lm_pipeline.eval.harness import load_harness_lm

    manager = manager or prepare_tasks(cfg)
    if store_root is not None:
        from lm_pipeline.xla_cache import enable as enable_xla_cache

        enable_xla_cache(store_root)
    lm = load_harness_lm(checkpoint, dtype=compute_dtype, max_length=cfg.max_eval_length,
                         batch_size=cfg.batch_size, add_bos_token=cfg.add_bos_token)
    results = run_tasks(lm, cfg, manager, log_samples=log_samples)
    return results, write_results(results, output_dir)


def results_table(results: dict[str, Any]) -> str:
    """The harness's own Markdown table of the results (and of the groups, if any)."""
    from lm_eval.utils import make_table

    text = make_table(results)
    return text + ("\n" + make_table(results, "groups") if results.get("groups") else "")
