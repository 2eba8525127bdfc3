"""What a stage's result shows, as plain data (no Dagster here).

A stage's ``metadata(result)`` returns ``{name: value}`` where a value is a ``bool``, ``int``,
``float`` or ``str`` (shown as text), or one of the small types below; the Dagster layer turns
each into its metadata value (``assets/metadata.py``). :func:`common` is what every stage shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Path:
    """A file or directory (local path or URL)."""

    path: str


@dataclass(frozen=True)
class Markdown:
    text: str


@dataclass(frozen=True)
class Json:
    value: Any


@dataclass(frozen=True)
class Table:
    """Rows of ``{column: value}`` with their ``(column, type)`` schema (type: string, int, float)."""

    columns: tuple[tuple[str, str], ...]
    rows: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class Image:
    """A PNG (its bytes), shown as a markdown image titled ``title``."""

    title: str
    png: bytes


def number(v: Any) -> Any:
    """``v`` if it is a finite int or float (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return None if isinstance(v, float) and not math.isfinite(v) else v


def counts(source: dict[str, Any], keys: tuple[str, ...], kind: type = int) -> dict[str, Any]:
    """``{key: kind(value)}`` for each of ``keys`` whose value in ``source`` is a number."""
    return {k: kind(source[k]) for k in keys if number(source.get(k)) is not None}


def common(res: Any, *, size: bool = True) -> dict[str, Any]:
    """What every stage shows: where, its fingerprint, whether it was a cache hit, how long it took
    (here and when built), when it was built and (``size``) the bytes under its directory."""
    from lm_pipeline import fs

    out: dict[str, Any] = {"path": Path(res.path), "fingerprint": res.fingerprint, "cache_hit": bool(res.hit),
                           "seconds": round(float(res.seconds), 3),
                           "built_seconds": float(res.manifest.get("seconds", 0.0)),
                           "created": str(res.manifest.get("created", ""))}
    if size:
        try:
            out["size_bytes"] = sum(fs.file_sizes(res.path).values())
        except Exception:  # noqa: BLE001 -- a size is informative; never fail a materialization for it
            pass
    return out
