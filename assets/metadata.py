"""Dagster metadata for each stage's result: what a user wants to see on an asset's page.

Every materialization carries ``path``, ``fingerprint``, ``cache_hit`` and ``seconds``, plus the
stage's counts and sizes; training adds its plots (loss, learning rate, eval bpb, throughput: PNGs
embedded as markdown images and saved under ``<run_dir>/plots/``) and final metrics; evaluation adds its report as a table.
:func:`result` makes the materialization (its data version is the artifact's fingerprint).
"""

from __future__ import annotations

import base64
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import dagster as dg


def _num(v: Any) -> Any:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return v if not (isinstance(v, float) and not math.isfinite(v)) else None
    return None


def _dir_bytes(path: str) -> int | None:
    from lm_pipeline import fs

    if not fs.is_local(path):  # an object store: the listing's sizes
        try:
            store, inner = fs.get_fs(path)
            return int(store.du(inner, total=True))
        except Exception:  # noqa: BLE001 -- a size is informative; never fail a materialization for it
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
    if res.manifest.get("shards"):
        from lm_pipeline.steps.builders import data_summary

        md["data_summary"] = dg.MetadataValue.text(data_summary(res.manifest))
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


def png_markdown(title: str, png: bytes | str) -> dg.MetadataValue:
    """A PNG (its bytes, or its path on any store) as a markdown image."""
    if isinstance(png, str):
        from lm_pipeline import fs

        data = fs.read_bytes(png)
        if data is None:
            raise FileNotFoundError(png)
        png = data
    b64 = base64.b64encode(png).decode("ascii")
    return dg.MetadataValue.md(f"![{title}](data:image/png;base64,{b64})")


# metadata key -> (plot file in <run_dir>/plots/, alt text)
TRAINING_PLOTS = {"loss_curve": ("loss.png", "loss curve"),
                  "learning_rate_curve": ("learning_rate.png", "learning rate"),
                  "eval_bpb_curve": ("eval_bpb.png", "eval bpb per checkpoint"),
                  "throughput_curve": ("tokens_per_second.png", "tokens per second")}


def training_plots(run_dir: str) -> dict[str, Any]:
    """The run's plots (written by :func:`lm_pipeline.plots.write_training_plots` when missing) as
    markdown images, each with the path of its PNG beside the run."""
    from lm_pipeline import fs
    from lm_pipeline.plots import PLOTS_DIR, write_training_plots

    md: dict[str, Any] = {}
    plots = fs.join(run_dir, PLOTS_DIR)
    if not fs.exists(fs.join(plots, "loss.png")):
        write_training_plots(run_dir)
    for key, (name, title) in TRAINING_PLOTS.items():
        png = fs.join(plots, name)
        data = fs.read_bytes(png)
        if data is not None:
            md[key] = png_markdown(title, data)
            md[f"{key}_path"] = dg.MetadataValue.path(png)
    return md


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
    md.update(training_plots(run_dir))
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


#: What each stage's materialization shows in the UI, by stage.
METADATA = {"raw_shards": raw_shards, "tokenizer": tokenizer, "token_cache": token_cache,
            "train_ckpt": train_ckpt, "eval_report": eval_report, "hf_export": hf_export}


def result(res, metadata: Mapping[str, Any]) -> dg.MaterializeResult:
    """The materialization of a stage result: ``metadata``, and the fingerprint as data version."""
    return dg.MaterializeResult(metadata=dict(metadata), data_version=dg.DataVersion(res.fingerprint))


def summary_line(res) -> str:
    """One log line: the stage result was a cache hit, or built in how long, and where."""
    if res.hit:
        return f"{res.stage} {res.fingerprint}: cache hit, no work ({res.path})"
    return f"{res.stage} {res.fingerprint}: built in {res.seconds:.1f}s at {res.path}"


def plain_json(value: Any) -> Any:
    """``value`` as plain JSON types (what a JSON metadata value holds); anything else as its string."""
    return json.loads(json.dumps(value, default=str))
