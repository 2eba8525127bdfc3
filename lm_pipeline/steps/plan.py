"""The plan: per stage, hit or miss, and for a miss which fields or inputs changed since the
stage's last complete artifact (``lm-pipeline plan``). Reads manifests; does no stage's work."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lm_pipeline.steps.pipeline import Pipeline


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, Mapping):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out or {prefix: {}}
    return {prefix: obj}


def diff_fields(old: Any, new: Any) -> list[str]:
    """Dotted keys whose values differ, as ``key: old -> new``."""
    a, b = _flatten(old), _flatten(new)
    lines = []
    for k in sorted(set(a) | set(b)):
        if a.get(k, "<absent>") != b.get(k, "<absent>"):
            lines.append(f"{k}: {json.dumps(a.get(k, '<absent>'), default=str)} -> {json.dumps(b.get(k, '<absent>'), default=str)}")
    return lines


def _row(pipe: Pipeline, name: str, label: str) -> dict[str, Any]:
    addr = pipe.address(name)
    hit = pipe.store.is_complete(name, addr.fingerprint)
    row: dict[str, Any] = {"stage": label, "fingerprint": addr.fingerprint, "hit": hit, "changes": []}
    if not hit:
        previous = pipe.store.complete(name)
        if previous:
            last = previous[-1]
            row["compared_with"] = last["fingerprint"]
            row["changes"] = diff_fields({"config": last.get("config"), "inputs": last.get("inputs"),
                                          "code_version": last.get("code_version")},
                                         {"config": addr.config, "inputs": addr.inputs,
                                          "code_version": addr.code_version})
        else:
            row["changes"] = ["no earlier artifact of this stage"]
    return row


def plan(pipe: Pipeline) -> list[dict[str, Any]]:
    """Per stage of the table: ``{stage, fingerprint, hit, changes[, compared_with]}``; a data
    mixture's components' ``raw_shards`` and ``token_cache`` before its own token cache, as
    ``<stage>[<component>]``."""
    rows = []
    for name in pipe.stages:
        if name == "token_cache":
            rows += [_row(sub, own, f"{own}[{comp}]") for comp, sub in pipe.components().items()
                     for own in ("raw_shards", "token_cache")]
        rows.append(_row(pipe, name, name))
    return rows


def plan_text(pipe: Pipeline) -> str:
    """The plan as the command line prints it: one line per stage, then what changed."""
    lines = []
    for row in plan(pipe):
        status = "hit " if row["hit"] else "MISS"
        lines.append(f"{status} {row['stage']:<12} {row['fingerprint']}")
        if not row["hit"] and row.get("compared_with"):
            lines.append(f"       changed since {row['compared_with']}:")
        lines.extend(f"         {c}" for c in row["changes"])
    return "\n".join(lines)
