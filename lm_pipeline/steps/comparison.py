"""The comparison of experiments: every experiment's final evaluation side by side.

Per experiment: its model, parameters, training tokens and wall time, and its final evaluation
(loss, bits per byte) beside the unigram baseline of the same validation data; where experiments
evaluate downstream tasks (``task_eval``), one column per task and metric. It is an artifact
like a stage's: ``<store>/comparison/<fingerprint>/`` holds ``comparison.json`` and
``comparison.png``; its fingerprint hashes what it reads (each experiment's model, training run
and evaluation report), so an unchanged set of reports is a cache hit; it is built by
:func:`lm_pipeline.steps.artifact.build` (the lock, the manifest last). Reads the store only.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

from lm_pipeline import atomic, fs
from lm_pipeline.fingerprint import fingerprint
from lm_pipeline.steps import artifact
from lm_pipeline.steps.display import Image, Markdown, Path, Table
from lm_pipeline.steps.result import Address, StageResult

NAME = "comparison"
CODE_VERSION = 1
COLUMNS = ("experiment", "model", "params", "step", "train_tokens", "train_seconds", "eval_loss", "bpb",
           "macro_bpb", "unigram_bpb", "bpb_vs_unigram", "bpb_by_set", "eval_report", "train_ckpt", "task_eval")
_TEXT_COLUMNS = ("experiment", "model", "bpb_by_set", "eval_report", "train_ckpt", "task_eval")
_FINGERPRINTS = ("eval_report", "train_ckpt", "task_eval")  # not in the markdown table
#: The columns of the table shown in the UI, numbers to 4 significant digits (narrow enough to
#: read beside the asset's definition); the markdown table and comparison.json hold every column.
TABLE_COLUMNS = ("experiment", "model", "params", "step", "bpb", "unigram_bpb", "bpb_vs_unigram")


def _short(v: Any) -> Any:
    return float(f"{v:.4g}") if isinstance(v, float) else v


def _micro(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    return next((r for r in rows if r.get("kind") == "micro"), rows[0] if rows else {})


def experiment_row(name: str, pipe) -> dict[str, Any]:
    """One experiment's row: its final evaluation and training, read from the store (no compute).
    Values are None where the experiment has not been trained or evaluated yet."""
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    row.update(experiment=name, model=pipe.cfg.model.type, tasks={})
    train = pipe.cached("train_ckpt")
    if train is None:
        return row
    step = train.manifest.get("summary", {}).get("final_step")
    row.update(step=step, train_ckpt=train.fingerprint, train_seconds=train.manifest.get("train_seconds"))
    if step is not None:
        # the rows of the steps before `step` (a batch-size schedule's sizes summed) x seq_len
        row["train_tokens"] = pipe.cfg.trainer.batch_schedule.offset_at(int(step)) * pipe.cfg.model.seq_len
    report = pipe.cached("eval_report")
    if report is not None:
        sets = report.manifest.get("rows") or []
        micro = _micro(sets)
        row.update(eval_report=report.fingerprint, params=micro.get("num_params"), eval_loss=micro.get("loss"),
                   bpb=micro.get("bpb"), unigram_bpb=micro.get("unigram_bpb"),
                   macro_bpb=next((r.get("bpb") for r in sets if r.get("kind") == "macro"), None),
                   bpb_by_set=", ".join(f"{r['dataset']} {r['bpb']:.4g}" for r in sets  # a mixture: per component
                                        if r.get("kind") == "dataset" and r.get("bpb") is not None))
        if row["bpb"] is not None and row["unigram_bpb"]:
            row["bpb_vs_unigram"] = row["bpb"] / row["unigram_bpb"]
    tasks = pipe.cached("task_eval") if "task_eval" in pipe.stages else None  # an experiment with tasks
    if tasks is not None:
        row.update(task_eval=tasks.fingerprint,
                   tasks={f"{r['task']}/{r['metric']}": r["value"] for r in tasks.manifest.get("rows") or []})
    return row


def task_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every ``<task>/<metric>`` some experiment has a score for, sorted."""
    return sorted({c for r in rows for c in r.get("tasks") or {}})


def _cells(row: Mapping[str, Any], columns: Sequence[str]) -> dict[str, Any]:
    return {c: row.get(c, (row.get("tasks") or {}).get(c)) for c in columns}


def address(rows: Sequence[Mapping[str, Any]]) -> Address:
    """The comparison's address: what it reads (each experiment's model, run and report)."""
    inputs = {r["experiment"]: {"model": r["model"], "train_ckpt": r["train_ckpt"], "eval_report": r["eval_report"],
                                **({"task_eval": r["task_eval"]} if r.get("task_eval") else {})} for r in rows}
    return Address(NAME, fingerprint(NAME, {}, CODE_VERSION, inputs), {}, inputs, CODE_VERSION)


def plot_png(rows: Sequence[Mapping[str, Any]]) -> bytes:
    """A bar chart: each evaluated experiment's bits per byte beside its unigram baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r.get("bpb") is not None]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(done) + 2), 3.2), dpi=100)
    xs = range(len(done))
    ax.bar([x - 0.2 for x in xs], [r["bpb"] for r in done], width=0.4, label="model")
    ax.bar([x + 0.2 for x in xs], [r["unigram_bpb"] or 0.0 for r in done], width=0.4, label="unigram baseline")
    ax.set_xticks(list(xs), [r["experiment"] for r in done])
    ax.set_ylabel("validation bits per byte")
    ax.set_title("experiments: final evaluation (lower is better)")
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "—"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    shown = [c for c in COLUMNS if c not in _FINGERPRINTS] + task_columns(rows)
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(cell(v) for v in _cells(r, shown).values()) + " |" for r in rows]
    return "\n".join(lines)


def compare(store, pipes: Mapping[str, Any]) -> StageResult:
    """The comparison of the experiments ``pipes`` (name -> pipeline over ``store``): built, or
    found complete (a cache hit)."""
    rows = [experiment_row(name, pipe) for name, pipe in pipes.items()]

    def write(path: str):
        atomic.atomic_write_json(fs.join(path, "comparison.json"), rows)
        atomic.atomic_write_bytes(fs.join(path, "comparison.png"), plot_png(rows))
        return {"experiments": [r["experiment"] for r in rows]}, {"rows": rows}

    return artifact.build(store, address(rows), write)


def metadata(res: StageResult) -> dict[str, Any]:
    """What the comparison shows: the table (and as markdown), the plot, where it is."""
    rows = res.manifest.get("rows") or []
    out: dict[str, Any] = {"path": Path(res.path), "fingerprint": res.fingerprint, "cache_hit": bool(res.hit),
                           "experiments": len(rows), "evaluated": sum(r.get("bpb") is not None for r in rows),
                           "comparison": Table(tuple((c, "string" if c in _TEXT_COLUMNS else "float") for c in TABLE_COLUMNS)
                                               + tuple((c, "float") for c in task_columns(rows)),
                                               tuple({c: _short(v) if c in TABLE_COLUMNS else v for c, v in
                                                      _cells(r, (*TABLE_COLUMNS, *task_columns(rows))).items()} for r in rows)),
                           "comparison_md": Markdown(markdown_table(rows))}
    if any(r.get("bpb") is not None for r in rows):
        png = fs.read_bytes(fs.join(res.path, "comparison.png"))
        if png is not None:
            out["plot"] = Image("bits per byte by experiment", png)
    return out
