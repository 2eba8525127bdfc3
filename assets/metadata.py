"""Dagster metadata for each stage's result: what a user wants to see on an asset's page.

What a stage shows is declared with the stage, as plain data (its ``metadata``:
:mod:`lm_pipeline.steps.shown` for the stages of the table); :func:`stage_metadata` turns it into
Dagster's metadata values (images as embedded markdown, tables with their schema).
:func:`result` makes the materialization (its data version is the artifact's fingerprint).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Any

import dagster as dg

from lm_pipeline.steps import display


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


def to_dagster(value: Any) -> dg.MetadataValue:
    """A plain metadata value (:mod:`lm_pipeline.steps.display`) as Dagster's."""
    if isinstance(value, bool):
        return dg.MetadataValue.bool(value)
    if isinstance(value, int):
        return dg.MetadataValue.int(value)
    if isinstance(value, float):
        return dg.MetadataValue.float(value)
    if isinstance(value, str):
        return dg.MetadataValue.text(value)
    if isinstance(value, display.Path):
        return dg.MetadataValue.path(value.path)
    if isinstance(value, display.Markdown):
        return dg.MetadataValue.md(value.text)
    if isinstance(value, display.Json):
        return dg.MetadataValue.json(plain_json(value.value))
    if isinstance(value, display.Image):
        return png_markdown(value.title, value.png)
    if isinstance(value, display.Table):
        return dg.MetadataValue.table([dg.TableRecord(r) for r in value.rows], schema=dg.TableSchema(
            columns=[dg.TableColumn(c, k) for c, k in value.columns]))
    if isinstance(value, dg.MetadataValue):
        return value
    raise TypeError(f"not a metadata value: {type(value).__name__} ({value!r:.80})")


def stage_metadata(stage, res) -> dict[str, Any]:
    """What stage ``stage`` (its declaration) shows of its result ``res``: its ``metadata``, else
    what every stage shows (:func:`lm_pipeline.steps.display.common`)."""
    values = stage.metadata(res) if stage.metadata is not None else display.common(res)
    return {k: to_dagster(v) for k, v in values.items()}


def checkpoint_observation(c: Mapping[str, Any], *, run_fingerprint: str, partition_key: str) -> dict[str, Any]:
    """Metadata of a ``train_ckpt`` observation for one complete checkpoint."""
    return {
        "checkpoint_path": dg.MetadataValue.path(str(c["path"])),
        "step": dg.MetadataValue.int(int(c["step"])),
        "kind": dg.MetadataValue.text(str(c.get("kind", "permanent"))),
        "run_fingerprint": dg.MetadataValue.text(run_fingerprint),
        "checkpoint_key": dg.MetadataValue.text(partition_key),
    }


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
