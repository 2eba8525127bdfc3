"""Built-in corpora that need no download, materialised as ordinary JSONL shards.

``python_stdlib``: the source code of the running Python's standard library, one document per
module (``{"text": <source>, "path": "json/decoder.py"}``; ``path`` is relative to the stdlib
directory, in POSIX form). It is a few MB of real, varied, well-formed text on every machine, enough
for a tiny model to visibly learn on.

Selection (deterministic for a given Python installation):

* every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, walked in sorted order;
* skipped: test directories (``test*``, ``tests``, ``idle_test``), ``site-packages`` /
  ``dist-packages``, ``__pycache__``, hidden directories, generated tables (``encodings``,
  ``pydoc_data``), files over :data:`MAX_FILE_BYTES` and files that are not valid UTF-8;
* the cap ``max_bytes`` (``data.builtin_max_bytes``, default 4 MB) is filled by taking files in
  the order of ``sha256("select:" + path)`` -- a spread over the whole library rather than its
  alphabetical start -- skipping any file that would overflow it;
* held out as validation: files with ``sha256("split:" + path)`` below ``validation_fraction``
  (``data.builtin_validation_fraction``, default 5%), so train and validation are disjoint;
* written in sorted path order, in JSONL shards of about :data:`SHARD_BYTES`.

The content differs between Python versions; that is fine because shard fingerprints are content
based. The output directory is named by the sha256 of the corpus content (and layout), written
once (by one writer at a time, holding the lock beside it; on an object store uploaded from a
local directory) with its ``manifest.json`` last, and reused when that exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BUILTINS",
    "BuiltinCorpus",
    "BuiltinDoc",
    "default_builtin_root",
    "materialize_builtin",
    "python_stdlib_documents",
]

BUILTINS = ("python_stdlib",)
#: Files larger than this are skipped (generated tables, huge single modules).
MAX_FILE_BYTES = 200_000
#: Target size of one JSONL shard.
SHARD_BYTES = 512_000
#: Bumped when the selection / layout rules change.
LAYOUT_VERSION = 1

_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "tests", "idle_test", "encodings", "pydoc_data"}
)


@dataclass(frozen=True)
class BuiltinDoc:
    path: str
    text: str
    split: str  # "train" | "validation"


@dataclass(frozen=True)
class BuiltinCorpus:
    """A materialised built-in corpus: its directory and its shard files per split."""

    name: str
    root: str
    train: tuple[str, ...]
    validation: tuple[str, ...]
    manifest: dict


def default_builtin_root() -> str:
    return os.environ.get("LM_PIPELINE_BUILTIN_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "lm_pipeline", "builtin"
    )


def _unit(salt: str, path: str) -> float:
    """A deterministic number in [0, 1) for a path."""
    return int.from_bytes(hashlib.sha256(f"{salt}:{path}".encode()).digest()[:8], "big") / 2.0**64


def _candidates(root: str) -> Iterator[tuple[str, str, int]]:
    """(relative posix path, absolute path, size) of eligible files, in sorted order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith((".", "test")))
        for fn in sorted(filenames):
            if not fn.endswith(".py") or fn.startswith("test_"):
                continue
            full = os.path.join(dirpath, fn)
            try:
                size = os.path.getsize(full)
            except OSError:
                continue
            if 0 < size <= MAX_FILE_BYTES:
                yield Path(os.path.relpath(full, root)).as_posix(), full, size


def python_stdlib_documents(
    max_bytes: int = 4_000_000, validation_fraction: float = 0.05, stdlib: str | None = None
) -> list[BuiltinDoc]:
    """The selected modules of the standard library, sorted by path, each tagged with its split."""
    root = stdlib or sysconfig.get_paths()["stdlib"]
    cands = sorted(_candidates(root), key=lambda c: (_unit("select", c[0]), c[0]))
    chosen: list[BuiltinDoc] = []
    total = 0
    for rel, full, size in cands:
        if total + size > max_bytes:
            continue
        try:
            with open(full, "rb") as f:
                text = f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip():
            continue
        split = "validation" if _unit("split", rel) < validation_fraction else "train"
        chosen.append(BuiltinDoc(rel, text, split))
        total += size
    chosen.sort(key=lambda d: d.path)
    return chosen


def _shard_lines(docs: list[BuiltinDoc]) -> list[list[bytes]]:
    shards: list[list[bytes]] = []
    cur: list[bytes] = []
    size = 0
    for d in docs:
        line = json.dumps({"text": d.text, "path": d.path}, ensure_ascii=False).encode("utf-8") + b"\n"
        if cur and size + len(line) > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append(line)
        size += len(line)
    if cur:
        shards.append(cur)
    return shards


def _write_corpus(directory: str, layout: dict, files: dict, manifest: dict) -> None:
    """The corpus's JSONL shards and its manifest.json into the local ``directory``."""
    for split, shards in layout.items():
        for fn, lines in zip(files[split], shards, strict=True):
            with open(os.path.join(directory, fn), "wb") as f:
                f.writelines(lines)
    with open(os.path.join(directory, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)

def materialize_builtin(
    name: str,
    root: str | os.PathLike | None = None,
    *,
    max_bytes: int = 4_000_000,
    validation_fraction: float = 0.05,
) -> BuiltinCorpus:
    """Write (or reuse) the JSONL shards of built-in corpus ``name`` under ``root``."""
    if name not in BUILTINS:
        raise ValueError(f"unknown builtin corpus {name!r}; available: {', '.join(BUILTINS)}")
    root = os.fspath(root) if root is not None else default_builtin_root()
    docs = python_stdlib_documents(max_bytes, validation_fraction)
    layout = {split: _shard_lines([d for d in docs if d.split == split]) for split in ("train", "validation")}
    if not layout["train"] or not layout["validation"]:
        raise ValueError(
            f"builtin {name}: the selection has no {'train' if not layout['train'] else 'validation'} documents; raise builtin_max_bytes"
        )
    sha = hashlib.sha256(f"{name}:{LAYOUT_VERSION}".encode())
    for split, shards in layout.items():
        for i, lines in enumerate(shards):
            sha.update(f"\n{split}-{i:05d}\n".encode())
            for line in lines:
                sha.update(line)
    digest = sha.hexdigest()
    files = {
        split: [f"{split}-{i:05d}.jsonl" for i in range(len(shards))] for split, shards in layout.items()
    }
    manifest = {
        "name": name,
        "layout_version": LAYOUT_VERSION,
        "content_sha256": digest,
        "python": sys.version.split()[0],
        "max_bytes": max_bytes,
        "validation_fraction": validation_fraction,
        "documents": {split: [d.path for d in docs if d.split == split] for split in ("train", "validation")},
        "bytes": {
            split: sum(len(line) for lines in shards for line in lines) for split, shards in layout.items()
        },
        "files": files,
    }
    from lm_pipeline import fs

    target = fs.join(root, name, digest[:16])
    complete = fs.join(target, "manifest.json")  # written last: a corpus with it is whole
    if not fs.exists(complete):
        with fs.exclusive_lock(f"{target}.lock"):  # one local writer; object stores: see exclusive_lock
            if not fs.exists(complete):  # not written by the writer this one waited for
                with fs.staged(target, last=("manifest.json",)) as local:  # in place, or uploaded
                    os.makedirs(local, exist_ok=True)
                    _write_corpus(local, layout, files, manifest)
    return BuiltinCorpus(
        name=name,
        root=target,
        train=tuple(fs.join(target, f) for f in files["train"]),
        validation=tuple(fs.join(target, f) for f in files["validation"]),
        manifest=manifest,
    )
