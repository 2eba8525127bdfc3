"""The names of a mixture's components, and every name derived from one.

A component name is one or more segments joined by ``/`` (Levanter's configs name evaluation
sets ``paloma/4chan``), each starting with a letter or digit and using only letters, digits,
``_``, ``.``, ``-``: no empty segment, no ``..``, no leading ``/``, so a name is also a safe
relative path. What derives from a name is made here and nowhere else:

- :func:`split_key`: a component's split among the mixture's splits, ``<component>/<split>``
  (``paloma/4chan/validation``); :func:`parse_split_key` reads it back (split names hold no
  ``/``, so the last ``/`` separates them).
- :func:`asset_segment`: one Dagster asset-key segment (only letters, digits and ``_``), e.g.
  ``paloma_4chan``; :func:`name_problems` refuses two components that would share one.
- the config path of a component's field, ``data.configs.<name>.<field>`` (:func:`config_path`),
  which is also the command-line override (``--data.configs.paloma/4chan.validation_urls``; a name
  holding '.' is matched against the file's components, :func:`lm_pipeline.config.apply_overrides`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["asset_segment", "config_path", "name_problem", "name_problems", "parse_split_key", "split_key"]

_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9_.\-]*"
_NAME = re.compile(rf"^{_SEGMENT}(?:/{_SEGMENT})*$")


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a component, or None."""
    if not isinstance(name, str) or not _NAME.match(name):
        return ("component names are segments joined by '/', each starting with a letter or digit and using "
                "only letters, digits, '_', '.', '-'")
    return None


def asset_segment(name: str) -> str:
    """The component's Dagster asset-key segment: every character but letters, digits and ``_``
    becomes ``_``."""
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def name_problems(names: Iterable[str]) -> list[tuple[str, str]]:
    """(component, problem) for each bad name and each name whose asset segment another took."""
    out, seen = [], {}
    for name in names:
        problem = name_problem(name)
        if problem is not None:
            out.append((name, problem))
            continue
        other = seen.setdefault(asset_segment(name), name)
        if other != name:
            out.append((name, f"gives the same asset name {asset_segment(name)!r} as component {other!r} (names "
                        "differing only in '/', '.', '-' and '_' cannot both be used); rename one"))
    return out


def config_path(name: str, field: str | None = None) -> str:
    """``data.configs.<name>`` (``.<field>``): where the component's problems are reported, and
    the key of a command-line override."""
    return f"data.configs.{name}" + (f".{field}" if field else "")


def split_key(name: str, split: str) -> str:
    """The mixture's name for ``split`` of component ``name``: ``<name>/<split>``."""
    return f"{name}/{split}"


def parse_split_key(key: str) -> tuple[str, str]:
    """(component, split) of a :func:`split_key`."""
    name, sep, split = key.rpartition("/")
    if not sep or not name:
        raise ValueError(f"not a component's split: {key!r}")
    return name, split
