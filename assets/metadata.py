"""Dagster metadata for each stage's result: what a user wants to see on an asset's page.

Every materialization carries ``path``, ``fingerprint``, ``cache_hit`` and ``seconds``, plus the
stage's counts and sizes; training adds its loss curve (a PNG embedded as a markdown image and
saved beside the run) and final metrics; evaluation adds its report as a table.
"""

from __future__ import annotations

import base64
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import dagster as dg

LOSS_CURVE = "loss_curve.png"


def _num(v: Any) -> Any:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return v if not (isinstance(v, float) and not math.isfinite(v)) else None
    return None


def _dir_bytes(path: str) -> int | None:
    if "://" in path and not path.startswith("file://"):
        return None
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total


def common(res, *, size: bool = True) -> dict[str, Any]:
    """The metadata every stage reports."""
    md: dict[str, Any] = {
        "path": dg.MetadataValue.path(res.path),
        "fingerprint": dg.MetadataValue.text(res.fingerprint),
        "cache_hit": dg.MetadataValue.bool(bool(res.hit)),
        "seconds": dg.MetadataValue.float(round(float(res.seconds), 3)),
        "built_seconds": dg.MetadataValue.float(float(res.manifest.get("seconds", 0.0))),
        "created": dg.MetadataValue.text(str(res.manifest.get("created", ""))),
    }
    if size:
        nbytes = _dir_bytes(res.path)
        if nbytes is not None:
            md["size_bytes"] = dg.MetadataValue.int(nbytes)
    return md


def raw_shards(res) -> dict[str, Any]:
    s = res.manifest.get("summary", {})
    md = common(res, size=False)
    for k in ("num_shards", "records", "valid", "skipped"):
        if _num(s.get(k)) is not None:
            md[k] = dg.MetadataValue.int(int(s[k]))
    rows = []
    for split, shards in (res.manifest.get("shards") or {}).items():
        for sh in shards:
            rows.append(dg.TableRecord({"split": split, "shard": str(sh.get("name")), "records": int(sh.get("records") or 0),
                                        "valid": int(sh.get("valid") or 0),
                                        "skipped": int(sum((sh.get("skipped") or {}).values()))}))
    if rows:
        md["shards"] = dg.MetadataValue.table(rows[:200], schema=dg.TableSchema(columns=[
            dg.TableColumn("split", "string"), dg.TableColumn("shard", "string"), dg.TableColumn("records", "int"),
            dg.TableColumn("valid", "int"), dg.TableColumn("skipped", "int")]))
    return md


def tokenizer(res) -> dict[str, Any]:
    s = res.manifest.get("summary", {})
    md = common(res)
    for k in ("vocab_size", "eos_id", "bos_id"):
        if _num(s.get(k)) is not None:
            md[k] = dg.MetadataValue.int(int(s[k]))
    return md


def token_cache(res) -> dict[str, Any]:
    s = res.manifest.get("summary", {})
    md = common(res)
    splits = s.get("splits") or {}
    rows = [dg.TableRecord({"split": name, "docs": int(v.get("num_docs") or 0), "tokens": int(v.get("num_tokens") or 0),
                            "bytes": int(v.get("num_bytes") or 0)}) for name, v in splits.items()]
    if rows:
        md["splits"] = dg.MetadataValue.table(rows, schema=dg.TableSchema(columns=[
            dg.TableColumn("split", "string"), dg.TableColumn("docs", "int"), dg.TableColumn("tokens", "int"),
            dg.TableColumn("bytes", "int")]))
    if _num(s.get("train_tokens")) is not None:
        md["train_tokens"] = dg.MetadataValue.int(int(s["train_tokens"]))
    for k in ("built_by",):
        if res.manifest.get(k):
            md[k] = dg.MetadataValue.text(str(res.manifest[k]))
    if _num(res.manifest.get("groups")) is not None:
        md["shard_groups"] = dg.MetadataValue.int(int(res.manifest["groups"]))
    return md


def _read_metrics(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, "metrics.jsonl")
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass
    except OSError:
        pass
    return out


def loss_curve_png(run_dir: str, out_path: str | None = None) -> str | None:
    """Plot train/eval loss against step from ``<run_dir>/metrics.jsonl`` into a PNG; its path."""
    records = _read_metrics(run_dir)
    train = [(r["step"], r["train/loss"]) for r in records if _num(r.get("train/loss")) is not None]
    evals = [(r["step"], r["eval/loss"]) for r in records if _num(r.get("eval/loss")) is not None]
    if not train and not evals:
        return None
    out_path = out_path or os.path.join(run_dir, LOSS_CURVE)
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=80)
    if train:
        ax.plot(*zip(*train, strict=True), label="train/loss", lw=1.2)
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval/loss", lw=1.2, ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = out_path + ".tmp.png"
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, out_path)
    return out_path


def train_ckpt(res, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    s = res.manifest.get("summary", {})
    run_dir = res.manifest.get("run_dir") or res.path
    md = common(res)
    for k, v in s.items():
        if _num(v) is not None:
            md[k] = dg.MetadataValue.float(float(v)) if isinstance(v, float) else dg.MetadataValue.int(int(v))
    if s.get("final_checkpoint"):
        md["final_checkpoint"] = dg.MetadataValue.path(s["final_checkpoint"])
    if s.get("resumed_from"):
        md["resumed_from"] = dg.MetadataValue.path(s["resumed_from"])
    md["run_dir"] = dg.MetadataValue.path(run_dir)
    if res.manifest.get("run_id"):
        md["run_id"] = dg.MetadataValue.text(str(res.manifest["run_id"]))
    ckpts = res.manifest.get("checkpoints") or []
    md["num_checkpoints"] = dg.MetadataValue.int(len(ckpts))
    if ckpts:
        md["checkpoints"] = dg.MetadataValue.md("\n".join(f"- `{c}`" for c in ckpts))
    final = {k: v for k, v in s.items() if "/" in k and _num(v) is not None}
    if final:
        md["final_metrics"] = dg.MetadataValue.json(final)
    if "://" not in run_dir:
        png = os.path.join(run_dir, LOSS_CURVE)
        if not os.path.exists(png):
            try:
                png = loss_curve_png(run_dir) or ""
            except Exception:  # a plot is a nicety
                png = ""
        if png and os.path.exists(png):
            with open(png, "rb") as f:
                b64 = base64.b64encode(f.read()).decode("ascii")
            md["loss_curve"] = dg.MetadataValue.md(f"![loss curve](data:image/png;base64,{b64})")
            md["loss_curve_path"] = dg.MetadataValue.path(png)
    for k, v in (extra or {}).items():
        md.setdefault(k, v)
    return md


_EVAL_COLUMNS = (("dataset", "string"), ("kind", "string"), ("step", "int"), ("loss", "float"), ("perplexity", "float"),
                 ("bpb", "float"), ("unigram_loss", "float"), ("unigram_bpb", "float"), ("tokens", "int"))


def _cell(v: Any, kind: str) -> Any:
    if kind == "string":
        return str(v)
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return None
    return int(v) if kind == "int" else round(float(v), 6)


def eval_report(res) -> dict[str, Any]:
    s = res.manifest.get("summary", {})
    md = common(res)
    rows = res.manifest.get("rows") or []
    if rows:
        records = [dg.TableRecord({c: _cell(r.get(c), k) for c, k in _EVAL_COLUMNS if _cell(r.get(c), k) is not None})
                   for r in rows]
        md["report"] = dg.MetadataValue.table(records, schema=dg.TableSchema(
            columns=[dg.TableColumn(c, k) for c, k in _EVAL_COLUMNS]))
        header = "| " + " | ".join(c for c, _ in _EVAL_COLUMNS) + " |"
        sep = "|" + "---|" * len(_EVAL_COLUMNS)
        body = ["| " + " | ".join("" if _cell(r.get(c), k) is None else str(_cell(r.get(c), k)) for c, k in _EVAL_COLUMNS) + " |"
                for r in rows]
        md["report_markdown"] = dg.MetadataValue.md("\n".join([header, sep, *body]))
    for k in ("loss", "perplexity", "bpb", "unigram_loss", "unigram_bpb"):
        if _num(s.get(k)) is not None:
            md[k] = dg.MetadataValue.float(float(s[k]))
    if _num(s.get("step")) is not None:
        md["step"] = dg.MetadataValue.int(int(s["step"]))
    if s.get("checkpoint"):
        md["checkpoint"] = dg.MetadataValue.path(s["checkpoint"])
    for name, path in (res.manifest.get("report") or {}).items():
        md[f"report_{name}"] = dg.MetadataValue.path(path)
    return md


def hf_export(res) -> dict[str, Any]:
    s = res.manifest.get("summary", {})
    md = common(res, size=False)
    if _num(s.get("bytes")) is not None:
        md["size_bytes"] = dg.MetadataValue.int(int(s["bytes"]))
    if _num(s.get("step")) is not None:
        md["step"] = dg.MetadataValue.int(int(s["step"]))
    if s.get("checkpoint"):
        md["checkpoint"] = dg.MetadataValue.path(s["checkpoint"])
    if s.get("files"):
        md["files"] = dg.MetadataValue.md("\n".join(f"- `{f}`" for f in s["files"]))
    if s.get("sample") is not None:
        md["sample"] = dg.MetadataValue.md(f"prompt `{s.get('sample_prompt', '')!r}` (temperature 0.8, top-k 40, seed 0):\n\n```\n{s.get('sample_prompt', '')}{s['sample']}\n```")
    md["load_with"] = dg.MetadataValue.md(
        f"```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"model = AutoModelForCausalLM.from_pretrained({res.path!r})\ntok = AutoTokenizer.from_pretrained({res.path!r})\n```")
    return md


def checkpoint_observation(c: Mapping[str, Any], *, run_fingerprint: str, partition_key: str) -> dict[str, Any]:
    """Metadata of a ``train_ckpt`` observation for one complete checkpoint."""
    return {
        "checkpoint_path": dg.MetadataValue.path(str(c["path"])),
        "step": dg.MetadataValue.int(int(c["step"])),
        "kind": dg.MetadataValue.text(str(c.get("kind", "permanent"))),
        "run_fingerprint": dg.MetadataValue.text(run_fingerprint),
        "checkpoint_key": dg.MetadataValue.text(partition_key),
    }
