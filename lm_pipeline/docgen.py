"""Generate docs/configuration.md from the config classes, so the reference cannot drift.

    python -m lm_pipeline.docgen > docs/configuration.md
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, get_args, get_origin

from lm_pipeline.config import RunConfig
from lm_pipeline.schema import MISSING, Choice, type_name

HEADER = """# Configuration reference

Generated from the config classes by `python -m lm_pipeline.docgen`; a test fails when this
file is out of date. Every run is one YAML file with these sections; any field can be
overridden on the command line as `--section.field VALUE` (values are parsed as YAML); an
override replaces the file's value whichever spelling (name or alias) either uses, while two
spellings of one field in one file are an error.

**Fingerprint** says whether a field is *semantic*: part of the fingerprint of the artifacts
it affects, so changing it re-runs exactly the stages downstream of it. Fields marked "no"
(log cadence, worker counts, trackers, paths, parallelism layout) never trigger work.
"""


def _default(f: dataclasses.Field) -> str:
    if f.default is not MISSING:
        value = f.default
    elif f.default_factory is not MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "(section)"
    if isinstance(value, tuple):
        value = list(value)
        if value and dataclasses.is_dataclass(value[0]):
            return "`" + ", ".join(str(dataclasses.asdict(v)) for v in value) + "`"
    return f"`{value!r}`" if not isinstance(value, str) else f"`{value}`"


def _nested(tp: Any) -> list[type]:
    """Dataclass types reachable from a field type (through Optional, tuple, dict)."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return [tp]
    if isinstance(tp, type) and issubclass(tp, Choice):
        return list(tp.registry.values())
    out: list[type] = []
    for arg in get_args(tp):
        out += _nested(arg)
    return out


def _section(cls: type, prefix: str, lines: list[str], parent_semantic: bool = True) -> None:
    hints = typing.get_type_hints(cls)
    rows, children = [], []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        semantic = parent_semantic and f.metadata.get("semantic", True)
        nested = _nested(tp)
        if f.name == "type" and issubclass(cls, Choice):
            rows.append(f"| `type` | `{_default(f).strip('`')}` | selects this family member | {'yes' if semantic else 'no'} |")
            continue
        if nested and get_origin(tp) is not dict:
            children.append((f, nested, semantic))
            continue
        aliases = f.metadata.get("aliases", ())
        alias = f" (alias: {', '.join(f'`{a}`' for a in aliases)})" if aliases else ""
        cells = [f"`{f.name}`{alias}", _default(f), f"{f.metadata.get('help', '')} ({type_name(tp)})",
                 "yes" if semantic else "no"]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    if rows:
        lines += ["", f"## `{prefix}`" if prefix else "## (top level)", "", (cls.__doc__ or "").strip().split("\n")[0], "",
                  "| field | default | meaning | fingerprint |", "|---|---|---|---|", *rows]
    for f, nested, semantic in children:
        for sub in nested:
            name = f"{prefix}.{f.name}" if prefix else f.name
            if issubclass(sub, Choice) and len(nested) > 1:
                kind = next(k for k, v in sub.family().registry.items() if v is sub)
                name = f"{name} (type: {kind})"
            _section(sub, name, lines, semantic)


def render() -> str:
    lines = [HEADER.rstrip()]
    _section(RunConfig, "", lines)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
