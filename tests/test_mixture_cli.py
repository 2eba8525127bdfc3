"""A Levanter-style mixture YAML (three local sources, two phases) trained from the command line
under each stop strategy, and evaluated per component.

References: the run's length under first_exhausted / all_exhausted is found by walking the rows
the restart order reads until a component would need a row it does not have (or every one has);
the report's aggregates are recomputed from its per-component rows.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lm_pipeline.config import load_config
from lm_pipeline.steps import Pipeline

pytestmark = pytest.mark.slow  # three short trainings through the CLI: ~1.5 min

TEXTS = {
    "web": [f"def web_{i}(x):\n    return [x * i for i in range({i})]\n" for i in range(40)],
    "code": [f"class Code{i}:\n    value = {i}\n    def get(self):\n        return self.value\n" for i in range(20)],
    "books": [f"Chapter {i}. It was a quiet evening in the town of {i}.\n" for i in range(6)],
}

YAML = """\
data:
  tokenizer: {tok}
  configs:
    web:   {{train_urls: ["{root}/web/train.jsonl"], validation_urls: ["{root}/web/val.jsonl"]}}
    code:  {{train_urls: ["{root}/code/train.jsonl"], validation_urls: ["{root}/code/val.jsonl"]}}
    books: {{train_urls: ["{root}/books/*.jsonl"], validation: {{held_out: ["{root}/books_val.jsonl"]}}}}
  train_weights:
    - [0, {{web: 0.8, code: 0.2}}]
    - [4, {{web: 0.5, code: 0.3, books: 0.2}}]
  stop_strategy: restart
  mixture_block_size: 16
  num_workers: 1
model: {{type: gpt2, seq_len: 16, hidden_dim: 32, num_heads: 2, num_layers: 1, gradient_checkpointing: false}}
trainer:
  num_train_steps: 60
  train_batch_size: 8
  mp: f32
  steps_per_eval: 1000
  progress: false
  log_dir: {root}/logs
  checkpointer: {{keep: [{{every: 1000}}]}}
optimizer: {{learning_rate: 0.001, warmup: 0.0}}
store: {{root: {root}/store}}
"""


def write_sources(root: Path) -> None:
    for name, texts in TEXTS.items():
        (root / name).mkdir(parents=True)
        (root / name / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    for name in ("web", "code"):
        (root / name / "val.jsonl").write_text(json.dumps({"text": TEXTS[name][0][::-1] * 3}) + "\n")
    (root / "books_val.jsonl").write_text(json.dumps({"text": "Chapter 99. A quiet town at night.\n" * 4}) + "\n")


@pytest.fixture(scope="module")
def experiment(tmp_path_factory) -> Path:
    from lm_pipeline.data.config import TokenizerConfig
    from lm_pipeline.data.tokenizer import build_tokenizer

    root = tmp_path_factory.mktemp("mix")
    write_sources(root)
    build_tokenizer(TokenizerConfig(kind="bpe", vocab_size=300), str(root / "tok"),
                    iter([t for ts in TEXTS.values() for t in ts]), progress=False)
    path = root / "mix.yaml"
    path.write_text(textwrap.dedent(YAML.format(root=root, tok=root / "tok")))
    return path


def walk_end(pipe: Pipeline, strategy: str) -> int:
    """Full steps before the first (first_exhausted) or last (all_exhausted) component needs a row
    past its last, walking the restart order's rows."""
    from lm_pipeline.data.mixture import mixture_source

    train, *_ = pipe.datasets()
    sizes = {n: len(ds) for n, ds in train.items()}
    src = mixture_source(dataclasses.replace(pipe.cfg.data, stop_strategy="restart"), train, pipe.cfg.trainer.train_batch_size, pipe.cfg.trainer.seed,
                         process_index=0, process_count=1)
    drawn, out = dict.fromkeys(sizes, 0), set()
    step = 0
    while len(out) < (1 if strategy == "first_exhausted" else len(sizes)):
        comp, _ = src.global_rows(step)
        for c in comp.tolist():
            name = src.names[c]
            drawn[name] += 1
            if drawn[name] > sizes[name]:
                out.add(name)
            if len(out) == (1 if strategy == "first_exhausted" else len(sizes)):
                return step
        step += 1
    return step


@pytest.mark.parametrize("strategy", ["restart", "first_exhausted", "all_exhausted"])
def test_a_levanter_mixture_trains_from_the_command_line(experiment, strategy):
    override = ["--data.stop_strategy", strategy]
    out = subprocess.run([sys.executable, "-m", "lm_pipeline.cli", "train", "--config_path", str(experiment),
                          *override], capture_output=True, text=True, timeout=600, cwd=experiment.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    pipe = Pipeline(load_config(experiment, override), progress=False)
    run = pipe.cached("train_ckpt")
    assert run is not None
    expected = 60 if strategy == "restart" else min(60, walk_end(pipe, strategy))
    assert run.manifest["summary"]["final_step"] == expected
    if strategy == "first_exhausted":
        assert expected < 60  # a component runs out well before
    report = pipe.eval_report()
    rows = {r["dataset"]: r for r in report.manifest["rows"]}
    sets = {"web/validation", "code/validation", "books/held_out"}
    assert set(rows) == sets | {"_micro", "_macro"}
    tokens = sum(rows[s]["tokens"] for s in sets)
    assert rows["_micro"]["loss"] == pytest.approx(sum(rows[s]["loss"] * rows[s]["tokens"] for s in sets) / tokens)
    assert rows["_macro"]["loss"] == pytest.approx(sum(rows[s]["loss"] for s in sets) / 3)
    for s in sets:
        assert rows[s]["unigram_loss"] > 0 and rows[s]["bpb"] > 0
