"""The comparison of every experiment of the deployment: one table and one plot.

Per experiment: its model, parameters, training tokens and wall time, and its final evaluation
(loss, bits per byte) beside the unigram baseline of the same validation data. The table is
written as ``comparison.json`` and ``comparison.png`` under ``<store>/comparison/<fingerprint>/``
(the fingerprint hashes the evaluation reports it was made from, so an unchanged set of reports
is a cache hit) and shown on the page of the asset ``experiments/comparison`` (:func:`comparison_asset`).
"""

import hashlib
import io
import json
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from assets.dead_runs import tend
from assets.deployment import COMPARISON_GROUP, COMPARISON_KEY, Deployment
from assets.metadata import png_markdown
from resources import ArtifactStoreResource

COLUMNS = ("experiment", "model", "params", "step", "train_tokens", "train_seconds", "eval_loss", "bpb",
           "unigram_bpb", "bpb_vs_unigram", "eval_report", "train_ckpt")


def _micro(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    return next((r for r in rows if r.get("kind") == "micro"), rows[0] if rows else {})


def experiment_row(name: str, pipe) -> dict[str, Any]:
    """One experiment's row: its final evaluation and training, read from the store (no compute).
    Values are None where the experiment has not been trained or evaluated yet."""
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    row["experiment"] = name
    row["model"] = pipe.cfg.model.type
    train = pipe.cached("train_ckpt")
    if train is not None:
        summary = train.manifest.get("summary", {})
        step = summary.get("final_step")
        row["step"] = step
        row["train_ckpt"] = train.fingerprint
        row["train_seconds"] = train.manifest.get("train_seconds")
        if step is not None:
            row["train_tokens"] = int(step) * pipe.cfg.trainer.train_batch_size * pipe.cfg.model.seq_len
        report = pipe.cached("eval_report")
        if report is not None:
            micro = _micro(report.manifest.get("rows") or [])
            row["eval_report"] = report.fingerprint
            row["params"] = micro.get("num_params")
            row["eval_loss"] = micro.get("loss")
            row["bpb"] = micro.get("bpb")
            row["unigram_bpb"] = micro.get("unigram_bpb")
            if row["bpb"] is not None and row["unigram_bpb"]:
                row["bpb_vs_unigram"] = row["bpb"] / row["unigram_bpb"]
    return row


def comparison_fingerprint(rows: Sequence[Mapping[str, Any]]) -> str:
    """The address of a comparison: what it was made from (experiments and their reports)."""
    basis = [(r["experiment"], r["model"], r["train_ckpt"], r["eval_report"]) for r in rows]
    return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()[:16]


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
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    shown = ("experiment", "model", "params", "step", "train_tokens", "train_seconds", "eval_loss", "bpb",
             "unigram_bpb", "bpb_vs_unigram")
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in shown) + " |" for r in rows]
    return "\n".join(lines)


def write_comparison(store, rows: Sequence[Mapping[str, Any]]) -> tuple[str, str, bool]:
    """Write (or find) the comparison artifact; returns (fingerprint, path, cache hit)."""
    from lm_pipeline import atomic

    fp = comparison_fingerprint(rows)
    art = store.artifact("comparison", fp)
    if store.is_complete("comparison", fp):
        return fp, art.path, True
    with store.lock(art):
        if store.is_complete("comparison", fp):
            return fp, art.path, True
        atomic.atomic_write_json(atomic.join(art.path, "comparison.json"), list(rows))
        atomic.atomic_write_bytes(atomic.join(art.path, "comparison.png"), plot_png(rows))
        store.commit(art, {"summary": {"experiments": [r["experiment"] for r in rows]}})
    return fp, art.path, False


def comparison_asset(dep: Deployment):
    """``experiments/comparison``: every experiment's final evaluation side by side."""
    evals = sorted({dep.key(n, "eval_report") for n in dep.experiments}, key=lambda k: k.to_user_string())

    @dg.asset(key=COMPARISON_KEY, deps=evals, group_name=COMPARISON_GROUP, kinds={"pandas"},
              description="Every experiment's final evaluation side by side (loss, bits per byte vs the unigram "
                          "baseline, parameters, training tokens and wall time): a table and a plot. Refreshed by "
                          "comparison_sensor when an evaluation lands.")
    def comparison(context: dg.AssetExecutionContext, store: ArtifactStoreResource) -> dg.MaterializeResult:
        tend(context)
        artifacts = store.store()  # the deployment's one store (build_definitions checks it)
        rows = [experiment_row(name, exp.fresh_pipeline(artifacts)) for name, exp in dep.experiments.items()]
        fp, path, hit = write_comparison(artifacts, rows)
        context.log.info(f"comparison {fp}: {'cache hit' if hit else 'written'} at {path}")
        table = dg.MetadataValue.table(
            [dg.TableRecord({c: r[c] for c in COLUMNS}) for r in rows],
            schema=dg.TableSchema(columns=[dg.TableColumn(c, "string" if c in ("experiment", "model", "eval_report",
                                                                              "train_ckpt") else "float")
                                           for c in COLUMNS]))
        meta = {"path": dg.MetadataValue.path(path), "fingerprint": dg.MetadataValue.text(fp),
                "cache_hit": dg.MetadataValue.bool(hit), "experiments": dg.MetadataValue.int(len(rows)),
                "evaluated": dg.MetadataValue.int(sum(r["bpb"] is not None for r in rows)),
                "comparison": table, "comparison_md": dg.MetadataValue.md(markdown_table(rows))}
        if any(r["bpb"] is not None for r in rows):
            meta["plot"] = png_markdown("bits per byte by experiment", f"{path}/comparison.png")
        return dg.MaterializeResult(metadata=meta, data_version=dg.DataVersion(fp))

    return comparison
