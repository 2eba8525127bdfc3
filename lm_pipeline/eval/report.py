"""Evaluation reports: one row per (checkpoint, dataset or aggregate), validated, as Parquet + JSON.

Aggregates are named ``_micro`` (totals over all sets) and ``_macro`` (unweighted mean of the
sets); columns are :data:`REPORT_COLUMNS` (``max_eval_batches`` is -1 when all rows were
evaluated; missing values are NaN). :func:`report_schema` (pandera) validates a report before
:func:`write_report` saves it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from lm_pipeline import atomic
from lm_pipeline.eval.bpb import bits_per_byte

if TYPE_CHECKING:
    import pandas as pd

    from lm_pipeline.eval.evaluate import DatasetMetrics

__all__ = [
    "KINDS", "MACRO", "MICRO", "REPORT_COLUMNS", "REPORT_NAME", "read_report", "report_frame", "report_rows",
    "report_schema", "validate_report", "write_report",
]

REPORT_NAME = "eval_report"
REPORT_COLUMNS = (
    "checkpoint", "step", "dataset", "kind", "loss", "perplexity", "bpb", "tokens", "bytes",
    "unigram_loss", "unigram_bpb", "unigram_entropy", "rows", "batches", "max_eval_batches",
    "model_type", "num_params", "seq_len", "compute_dtype", "eval_seconds",
)
KINDS = ("dataset", "micro", "macro")
MICRO, MACRO = "_micro", "_macro"  # dataset names of the aggregate rows (set names cannot start with '_')


def report_rows(
    checkpoint: str, step: int, metrics: Mapping[str, DatasetMetrics], *, entropy: float | None,
    max_eval_batches: int | None, model_type: str, num_params: int, seq_len: int, compute_dtype: str,
) -> list[dict[str, Any]]:
    """The report rows of one checkpoint: one per dataset, then ``_micro`` and ``_macro``."""
    nan = float("nan")
    base = {
        "checkpoint": checkpoint, "step": int(step), "max_eval_batches": -1 if max_eval_batches is None else int(max_eval_batches),
        "model_type": model_type, "num_params": int(num_params), "seq_len": int(seq_len),
        "compute_dtype": compute_dtype, "unigram_entropy": nan if entropy is None else float(entropy),
    }
    rows = []
    for name, m in metrics.items():
        rows.append({
            **base, "dataset": name, "kind": "dataset", "loss": m.loss, "perplexity": math.exp(m.loss),
            "bpb": m.bpb, "tokens": m.tokens, "bytes": nan if m.bytes is None else m.bytes,
            "unigram_loss": m.unigram_loss, "unigram_bpb": m.unigram_bpb, "rows": m.rows,
            "batches": m.batches, "eval_seconds": m.seconds,
        })
    ms = list(metrics.values())
    nats, tokens = sum(m.nats for m in ms), sum(m.tokens for m in ms)
    have_bytes = all(m.bytes is not None for m in ms)
    have_uni = all(m.unigram_nats is not None for m in ms)
    nbytes = sum(m.bytes for m in ms) if have_bytes else None  # type: ignore[misc]
    uni = sum(m.unigram_nats for m in ms) if have_uni else None  # type: ignore[misc]
    totals = {
        "tokens": tokens, "bytes": nan if nbytes is None else nbytes, "rows": sum(m.rows for m in ms),
        "batches": sum(m.batches for m in ms), "eval_seconds": sum(m.seconds for m in ms),
    }
    micro_loss = nats / tokens
    rows.append({
        **base, **totals, "dataset": MICRO, "kind": "micro", "loss": micro_loss, "perplexity": math.exp(micro_loss),
        "bpb": nan if nbytes is None else bits_per_byte(nats, nbytes),
        "unigram_loss": nan if uni is None else uni / tokens,
        "unigram_bpb": nan if uni is None or nbytes is None else bits_per_byte(uni, nbytes),
    })
    macro_loss = float(np.mean([m.loss for m in ms]))
    rows.append({
        **base, **totals, "dataset": MACRO, "kind": "macro", "loss": macro_loss, "perplexity": math.exp(macro_loss),
        "bpb": float(np.mean([m.bpb for m in ms])) if have_bytes else nan,
        "unigram_loss": float(np.mean([m.unigram_loss for m in ms])) if have_uni else nan,
        "unigram_bpb": float(np.mean([m.unigram_bpb for m in ms])) if have_uni and have_bytes else nan,
    })
    return rows


def report_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """``rows`` as a table with the report's columns, in order, and their dtypes."""
    import pandas as pd

    df = pd.DataFrame(rows, columns=list(REPORT_COLUMNS))
    ints = ("step", "tokens", "rows", "batches", "max_eval_batches", "num_params", "seq_len")
    floats = ("loss", "perplexity", "bpb", "bytes", "unigram_loss", "unigram_bpb", "unigram_entropy", "eval_seconds")
    return df.astype({**{c: "int64" for c in ints}, **{c: "float64" for c in floats}})



def report_schema():
    """The pandera ``DataFrameSchema`` of an evaluation report."""
    import pandera.pandas as pa

    def nonneg(nullable: bool = False) -> Any:
        return pa.Column(float, pa.Check.ge(0.0), nullable=nullable)

    def perplexity_is_exp_loss(df):
        return (df["perplexity"] - np.exp(df["loss"])).abs() <= 1e-6 * df["perplexity"].abs()

    return pa.DataFrameSchema(
        {
            "checkpoint": pa.Column(str, pa.Check.str_length(min_value=1)),
            "step": pa.Column("int64", pa.Check.ge(0)),
            "dataset": pa.Column(str, pa.Check.str_length(min_value=1)),
            "kind": pa.Column(str, pa.Check.isin(KINDS)),
            "loss": nonneg(),
            "perplexity": pa.Column(float, pa.Check.ge(1.0)),
            "bpb": nonneg(nullable=True),
            "tokens": pa.Column("int64", pa.Check.gt(0)),
            "bytes": nonneg(nullable=True),
            "unigram_loss": nonneg(nullable=True),
            "unigram_bpb": nonneg(nullable=True),
            "unigram_entropy": nonneg(nullable=True),
            "rows": pa.Column("int64", pa.Check.gt(0)),
            "batches": pa.Column("int64", pa.Check.gt(0)),
            "max_eval_batches": pa.Column("int64", pa.Check.ge(-1)),
            "model_type": pa.Column(str),
            "num_params": pa.Column("int64", pa.Check.gt(0)),
            "seq_len": pa.Column("int64", pa.Check.gt(0)),
            "compute_dtype": pa.Column(str),
            "eval_seconds": nonneg(),
        },
        checks=[
            pa.Check(perplexity_is_exp_loss, error="perplexity must equal exp(loss)"),
            pa.Check(lambda df: ((df["kind"] == "dataset") != df["dataset"].isin([MICRO, MACRO])),
                     error="aggregate rows are named _micro/_macro, dataset rows are not"),
        ],
        unique=["checkpoint", "dataset"],
        strict=True,
        ordered=False,
        coerce=False,
        name="eval_report",
    )


def validate_report(df: pd.DataFrame) -> pd.DataFrame:
    """Validate a report table against :func:`report_schema`; every problem is collected and
    raised together as ``pandera.errors.SchemaErrors``."""
    return report_schema().validate(df, lazy=True)


def write_report(df: pd.DataFrame, out_dir: str | os.PathLike) -> dict[str, str]:
    """Validate ``df`` and write ``eval_report.parquet`` and ``eval_report.json`` (a list of
    records; NaN as null) into ``out_dir`` (local or fsspec URL), each atomically."""
    import io

    df = validate_report(df)
    out = os.fspath(out_dir)
    buf = io.BytesIO()
    df.to_parquet(buf, index=False)
    parquet = atomic.join(out, f"{REPORT_NAME}.parquet")
    atomic.atomic_write_bytes(parquet, buf.getvalue())
    records = json.loads(df.to_json(orient="records", double_precision=15))
    path_json = atomic.join(out, f"{REPORT_NAME}.json")
    atomic.atomic_write_json(path_json, records)
    return {"parquet": parquet, "json": path_json}


def read_report(path: str | os.PathLike) -> pd.DataFrame:
    """Read a report written by :func:`write_report` (its dir or the .parquet file), validated."""
    import pandas as pd

    p = os.fspath(path)
    if not p.endswith(".parquet"):
        p = atomic.join(p, f"{REPORT_NAME}.parquet")
    return validate_report(pd.read_parquet(p))
