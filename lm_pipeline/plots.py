"""PNG plots of a training run, written beside its artifacts (matplotlib, Agg backend).

:func:`write_training_plots` reads ``<run_dir>/metrics.jsonl`` and writes into ``<run_dir>/plots/``:

* ``loss.png`` -- train and eval loss against step;
* ``learning_rate.png`` -- the learning-rate schedule as it ran;
* ``eval_bpb.png`` -- eval bits per byte at each evaluation (one line per validation set);
* ``tokens_per_second.png`` -- training throughput against elapsed training time.

Plots are a nicety: a missing matplotlib, an empty log or an unwritable directory yields fewer
(or no) plots, never an exception.
"""

from __future__ import annotations

import io
import json
import logging
import math
from typing import Any

from lm_pipeline import fs
from lm_pipeline.atomic import atomic_write_bytes

log = logging.getLogger(__name__)

PLOTS_DIR = "plots"


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/metrics.jsonl`` (torn or malformed lines skipped; [] if absent)."""
    out: list[dict[str, Any]] = []
    try:
        text = fs.read_text(fs.join(run_dir, "metrics.jsonl"))
        if text is None:
            return out
        for line in text.splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(r, dict) and _num(r.get("step")):
                out.append(r)
    except (OSError, UnicodeDecodeError):
        pass
    return out


def _series(records: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    return [(r["step"], r[key]) for r in records if _num(r.get(key))]


def _elapsed_throughput(records: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(elapsed seconds, tokens/s): elapsed time accumulated from each window's step time."""
    out, t, prev = [], 0.0, 0
    for r in records:
        if _num(r.get("throughput/tokens_per_second")) and _num(r.get("throughput/step_seconds")):
            t += max(r["step"] - prev, 0) * r["throughput/step_seconds"]
            prev = r["step"]
            out.append((t, r["throughput/tokens_per_second"]))
    return out


def _save(fig, path: str) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())  # a local path or a URL
    return path


def line_plot(path: str, lines: dict[str, list[tuple[float, float]]], *, xlabel: str, ylabel: str,
              title: str, markers: bool = False) -> str | None:
    """A PNG at ``path`` of each labelled series of (x, y) points; None (nothing written) when all are empty."""
    lines = {k: v for k, v in lines.items() if v}
    if not lines:
        return None
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=80)
    for label, pts in lines.items():
        xs, ys = zip(*pts, strict=True)
        ax.plot(xs, ys, "o-" if markers or len(pts) == 1 else "-", label=label, lw=1.2, ms=4)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(lines) > 1 or markers:
        ax.legend(fontsize="small")
    return _save(fig, path)


def write_training_plots(run_dir: str) -> list[str]:
    """Write the run's plots into ``<run_dir>/plots/``; the paths written (possibly none)."""
    try:
        records = read_metrics(run_dir)
        if not records:
            return []
        import matplotlib

        matplotlib.use("Agg", force=True)
        out_dir = fs.join(run_dir, PLOTS_DIR)
        bpb_keys = sorted({k for r in records for k in r if k.startswith("eval/") and k.endswith("/bpb")})
        written = [
            line_plot(fs.join(out_dir, "loss.png"),
                       {"train/loss": _series(records, "train/loss"), "eval/loss": _series(records, "eval/loss")},
                       xlabel="step", ylabel="loss (nats/token)", title="loss"),
            line_plot(fs.join(out_dir, "learning_rate.png"),
                       {"learning rate": _series(records, "optim/learning_rate")},
                       xlabel="step", ylabel="learning rate", title="learning rate"),
            line_plot(fs.join(out_dir, "eval_bpb.png"),
                       {k[len("eval/"):-len("/bpb")]: _series(records, k) for k in bpb_keys},
                       xlabel="step", ylabel="bits per byte", title="eval bpb per checkpoint", markers=True),
            line_plot(fs.join(out_dir, "tokens_per_second.png"),
                       {"tokens/s": _elapsed_throughput(records)},
                       xlabel="elapsed training time (s)", ylabel="tokens/s", title="throughput"),
        ]
        return [p for p in written if p]
    except Exception as e:  # noqa: BLE001 -- a plot must never fail a run
        log.warning("could not write training plots for %s: %s", run_dir, e)
        return []


def write_eval_plot(rows: list[dict[str, Any]], path: str) -> str | None:
    """Eval bpb per checkpoint step, one line per dataset, from evaluation report rows
    (``dataset``, ``step``, ``bpb``); the path, or None when there is nothing to plot."""
    try:
        lines: dict[str, list[tuple[float, float]]] = {}
        for r in rows:
            if _num(r.get("step")) and _num(r.get("bpb")) and str(r.get("dataset", "")) != "_macro":
                lines.setdefault(str(r["dataset"]), []).append((r["step"], r["bpb"]))
        if not lines:
            return None
        import matplotlib

        matplotlib.use("Agg", force=True)
        return line_plot(path, {k: sorted(v) for k, v in lines.items()}, xlabel="checkpoint step",
                          ylabel="bits per byte", title="eval bpb per checkpoint", markers=True)
    except Exception as e:  # noqa: BLE001
        log.warning("could not write the eval plot %s: %s", path, e)
        return None
