"""The ``eval_harness:`` section of a run config: downstream tasks of EleutherAI's
lm-evaluation-harness, written as Levanter writes it.

Light on purpose (parsing a config imports it): no JAX, no ``lm_eval`` here. The tasks run in
:mod:`lm_pipeline.eval.tasks`; the model behind them is :mod:`lm_pipeline.eval.harness`.

    eval_harness:
      task_spec:
        - hellaswag                      # a task (or group) by the harness's name
        - task: arc_easy                 # or a mapping: the harness's per-task overrides
          task_alias: arc_easy_5shot
          num_fewshot: 5
      max_examples: 100                  # per task (the harness's --limit)
      include_path: [tasks/]             # directories of task YAML files beside the harness's own
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from lm_pipeline.data.config import raise_problems
from lm_pipeline.schema import ConfigError, field

__all__ = ["EvalHarnessConfig", "HarnessTask"]


@dataclass(frozen=True)
class HarnessTask:
    """A task of `task_spec` with overrides (Levanter's TaskConfig); unset keys keep the task's definition."""

    task: str = field(help="The harness's name of a task or group (or one from include_path).")
    task_alias: str | None = field(None, help="The name the results are reported under.")
    num_fewshot: int | None = field(None, help="Few-shot examples before each question; null = the task's default.")
    use_prompt: str | None = field(None, help="A promptsource prompt by name (replaces doc_to_text / doc_to_target / doc_to_choice).")
    description: str | None = field(None, help="Text (a Jinja2 template) put before the few-shot examples.")
    target_delimiter: str | None = field(None, help="Between a question and its answer; null = the task's (' ').")
    fewshot_delimiter: str | None = field(None, help="Between few-shot examples; null = the task's ('\\n\\n').")
    doc_to_text: str | None = field(None, help="Jinja2 template: a document to the question text.")
    doc_to_target: str | None = field(None, help="Jinja2 template: a document to its answer.", aliases=("doct_to_target",))
    doc_to_choice: str | None = field(None, help="Jinja2 template: a document to its answer choices (multiple choice).")

    def validate(self) -> None:
        problems = []
        if not self.task.strip():
            problems.append(ConfigError("task", "must name a task (e.g. hellaswag)"))
        if self.num_fewshot is not None and self.num_fewshot < 0:
            problems.append(ConfigError("num_fewshot", f"must be >= 0 or null, got {self.num_fewshot}"))
        raise_problems(problems)

    def to_dict(self) -> dict[str, Any]:
        """The mapping the harness takes for a task: only the keys that are set."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class EvalHarnessConfig:
    """Downstream tasks through lm-evaluation-harness (`lm-pipeline eval` with this section or `--tasks`)."""

    task_spec: tuple[str | HarnessTask, ...] = field((), help="Tasks: harness task or group names, or mappings with `task` and overrides (task_alias, num_fewshot, ...).")
    max_examples: int | None = field(None, help="Evaluate at most this many documents per task (the first ones); null = all.")
    max_eval_length: int | None = field(None, help="Longest token window the model sees (left-truncated beyond); null = the model's seq_len.")
    log_samples: bool = field(False, help="Also write every document's requests and responses (samples_<task>.jsonl).", semantic=False)
    bootstrap_iters: int = field(0, help="Bootstrap resamples for the metrics' standard errors; 0 = none.")
    apply_chat_template: bool = field(False, help="Format prompts with the tokenizer's chat template.")
    include_path: tuple[str, ...] = field((), help="Directories (or files) of task YAML files to use beside the harness's own tasks. Named by content: the task evaluation's address covers every file under them, not how their paths are spelled, so moving them changes nothing.")
    batch_size: int = field(16, help="Sequences per forward pass (log-likelihoods) and per generation batch.", semantic=False)
    add_bos_token: bool | None = field(None, help="Prepend BOS to every encoding: null = as the tokenizer's post-processor does (the harness's default).")

    def validate(self) -> None:
        problems = []
        if self.max_examples is not None and self.max_examples < 1:
            problems.append(ConfigError("max_examples", f"must be >= 1 or null, got {self.max_examples}"))
        if self.max_eval_length is not None and self.max_eval_length < 2:
            problems.append(ConfigError("max_eval_length", f"must be >= 2 or null, got {self.max_eval_length}"))
        if self.bootstrap_iters < 0:
            problems.append(ConfigError("bootstrap_iters", f"must be >= 0, got {self.bootstrap_iters}"))
        if self.batch_size < 1:
            problems.append(ConfigError("batch_size", f"must be >= 1, got {self.batch_size}"))
        names = [t if isinstance(t, str) else (t.task_alias or t.task) for t in self.task_spec]
        for i, name in enumerate(names):
            if isinstance(self.task_spec[i], str) and not name.strip():
                problems.append(ConfigError(f"task_spec[{i}]", "must name a task (e.g. hellaswag)"))
            elif name in names[:i]:
                problems.append(ConfigError(f"task_spec[{i}]", f"{name!r} is given twice; give one a task_alias"))
        raise_problems(problems)

    def task_list(self) -> list[str | dict[str, Any]]:
        """The tasks as the harness takes them (names, and mappings for the overridden ones)."""
        return [t if isinstance(t, str) else t.to_dict() for t in self.task_spec]
