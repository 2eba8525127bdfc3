"""What each stage of the table shows of its result (its ``metadata`` declaration), as plain data
(:mod:`lm_pipeline.steps.display`): counts and sizes, the run's plots and final metrics, the
evaluation table, the export's sample."""

from __future__ import annotations

from typing import Any

from lm_pipeline.steps.display import Image, Json, Markdown, Path, Table, common, counts, number


def _summary(res: Any) -> dict[str, Any]:
    return res.manifest.get("summary", {})


def raw_shards(res: Any) -> dict[str, Any]:
    from lm_pipeline.steps.builders import data_summary

    out = {**common(res, size=False), **counts(_summary(res), ("num_shards", "records", "valid", "skipped"))}
    shards = res.manifest.get("shards") or {}
    rows = tuple({"split": split, "shard": str(sh.get("name")), "records": int(sh.get("records") or 0),
                  "valid": int(sh.get("valid") or 0), "skipped": int(sum((sh.get("skipped") or {}).values()))}
                 for split, rows in shards.items() for sh in rows)
    if shards:
        out["data_summary"] = data_summary(res.manifest)
    if rows:
        out["shards"] = Table((("split", "string"), ("shard", "string"), ("records", "int"), ("valid", "int"),
                               ("skipped", "int")), rows[:200])
    return out


def tokenizer(res: Any) -> dict[str, Any]:
    return {**common(res), **counts(_summary(res), ("vocab_size", "eos_id", "bos_id"))}


def token_cache(res: Any) -> dict[str, Any]:
    s = _summary(res)
    out = common(res)
    rows = tuple({"split": name, "docs": int(v.get("num_docs") or 0), "tokens": int(v.get("num_tokens") or 0),
                  "bytes": int(v.get("num_bytes") or 0)} for name, v in (s.get("splits") or {}).items())
    if rows:
        out["splits"] = Table((("split", "string"), ("docs", "int"), ("tokens", "int"), ("bytes", "int")), rows)
    out.update(counts(s, ("train_tokens",)))
    if res.manifest.get("built_by"):
        out["built_by"] = str(res.manifest["built_by"])
    if number(res.manifest.get("groups")) is not None:
        out["shard_groups"] = int(res.manifest["groups"])
    return out


# metadata key -> (plot file in <run_dir>/plots/, alt text)
TRAINING_PLOTS = {"loss_curve": ("loss.png", "loss curve"),
                  "learning_rate_curve": ("learning_rate.png", "learning rate"),
                  "eval_bpb_curve": ("eval_bpb.png", "eval bpb per checkpoint"),
                  "throughput_curve": ("tokens_per_second.png", "tokens per second")}


def training_plots(run_dir: str) -> dict[str, Any]:
    """The run's plots (written by :func:`lm_pipeline.plots.write_training_plots` when missing) as
    images, each with the path of its PNG beside the run."""
    from lm_pipeline import fs
    from lm_pipeline.plots import PLOTS_DIR, write_training_plots

    out: dict[str, Any] = {}
    plots = fs.join(run_dir, PLOTS_DIR)
    if not fs.exists(fs.join(plots, "loss.png")):
        write_training_plots(run_dir)
    for key, (name, title) in TRAINING_PLOTS.items():
        png = fs.join(plots, name)
        data = fs.read_bytes(png)
        if data is not None:
            out[key] = Image(title, data)
            out[f"{key}_path"] = Path(png)
    return out


def train_ckpt(res: Any) -> dict[str, Any]:
    s = _summary(res)
    run_dir = res.manifest.get("run_dir") or res.path
    out = common(res)
    out.update({k: v for k, v in s.items() if number(v) is not None})
    for k in ("final_checkpoint", "resumed_from"):
        if s.get(k):
            out[k] = Path(s[k])
    out["run_dir"] = Path(run_dir)
    if res.manifest.get("run_id"):
        out["run_id"] = str(res.manifest["run_id"])
    ckpts = res.manifest.get("checkpoints") or []
    out["num_checkpoints"] = len(ckpts)
    if ckpts:
        out["checkpoints"] = Markdown("\n".join(f"- `{c}`" for c in ckpts))
    final = {k: v for k, v in s.items() if "/" in k and number(v) is not None}
    if final:
        out["final_metrics"] = Json(final)
    out.update(training_plots(run_dir))
    return out


EVAL_COLUMNS = (("dataset", "string"), ("kind", "string"), ("step", "int"), ("loss", "float"),
                ("perplexity", "float"), ("bpb", "float"), ("unigram_loss", "float"), ("unigram_bpb", "float"),
                ("tokens", "int"))


def _cell(v: Any, kind: str) -> Any:
    if kind == "string":
        return str(v)
    if number(v) is None:
        return None
    return int(v) if kind == "int" else round(float(v), 6)


def eval_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """An evaluation report's rows as a table and as markdown."""
    cells = [{c: _cell(r.get(c), k) for c, k in EVAL_COLUMNS} for r in rows]
    header = "| " + " | ".join(c for c, _ in EVAL_COLUMNS) + " |"
    body = ["| " + " | ".join("" if r[c] is None else str(r[c]) for c, _ in EVAL_COLUMNS) + " |" for r in cells]
    return {"report": Table(EVAL_COLUMNS, tuple({c: v for c, v in r.items() if v is not None} for r in cells)),
            "report_markdown": Markdown("\n".join([header, "|" + "---|" * len(EVAL_COLUMNS), *body]))}


def eval_report(res: Any) -> dict[str, Any]:
    s = _summary(res)
    out = common(res)
    if res.manifest.get("rows"):
        out.update(eval_table(res.manifest["rows"]))
    out.update(counts(s, ("loss", "perplexity", "bpb", "unigram_loss", "unigram_bpb"), float))
    out.update(counts(s, ("step",)))
    if s.get("checkpoint"):
        out["checkpoint"] = Path(s["checkpoint"])
    for name, path in (res.manifest.get("report") or {}).items():
        out[f"report_{name}"] = Path(path)
    return out


def hf_export(res: Any) -> dict[str, Any]:
    s = _summary(res)
    out = common(res, size=False)
    if number(s.get("bytes")) is not None:
        out["size_bytes"] = int(s["bytes"])
    out.update(counts(s, ("step",)))
    if s.get("checkpoint"):
        out["checkpoint"] = Path(s["checkpoint"])
    if s.get("files"):
        out["files"] = Markdown("\n".join(f"- `{f}`" for f in s["files"]))
    if s.get("sample") is not None:
        prompt = s.get("sample_prompt", "")
        out["sample"] = Markdown(f"prompt `{prompt!r}` (temperature 0.8, top-k 40, seed 0):\n\n```\n"
                                 f"{prompt}{s['sample']}\n```")
    out["load_with"] = Markdown(
        f"```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"model = AutoModelForCausalLM.from_pretrained({res.path!r})\ntok = AutoTokenizer.from_pretrained({res.path!r})\n```")
    return out
