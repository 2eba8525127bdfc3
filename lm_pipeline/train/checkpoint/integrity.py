"""Checkpoint integrity: what a complete checkpoint holds, checked before it is trusted.

At save, once every part is written and before the completion marker, the marker records each
file of the step dir with its size and sha256 (``marker["files"]``). Before a run resumes from a
checkpoint, :func:`verify` compares the dir with that record: a missing, truncated or altered
file makes it *damaged*. :func:`move_aside` then renames the dir into ``<parent>/.damaged/``
(never deletes it: the bytes stay for inspection) so the run resumes from the newest intact one.

On object stores the record is made from the staged local copy of what was uploaded (files
written straight to the bucket are read back and hashed); verifying downloads the checkpoint into
the local cache (:mod:`.remote`) and checks that copy, and moving aside copies the objects under
``.damaged/`` and deletes the originals, the marker first.
"""

from __future__ import annotations

import datetime
import os

from lm_pipeline import fs
from lm_pipeline.train.checkpoint.marker import MARKER

__all__ = ["DAMAGED_DIR", "file_digests", "move_aside", "verify"]

#: Where damaged checkpoints are moved, beside the step dirs (hidden: discovery skips it).
DAMAGED_DIR = ".damaged"


def file_digests(step_dir: str, staged: str | None = None, uploaded: dict[str, dict] | None = None
                 ) -> dict[str, dict]:
    """Relative path -> ``{"size", "sha256"}`` of every file of a step dir (the marker excluded).

    On an object store the files are listed there (their sizes as stored) and their hashes taken
    from ``uploaded`` (relative path -> size, sha256 of the bytes a process uploaded) where the
    size matches, else hashed from ``staged``, a local directory with the same layout holding what
    was uploaded, where it has the file with that size, else read back. A local step dir: its
    files, hashed."""
    out: dict[str, dict] = {}
    for rel, size in fs.file_sizes(step_dir).items():
        if rel == MARKER:
            continue
        local = os.path.join(staged, *rel.split("/")) if staged else None
        known = (uploaded or {}).get(rel)
        if known is not None and known.get("size") == size:
            digest = known["sha256"]  # hashed from the local bytes by the process that uploaded them
        elif local and os.path.isfile(local) and os.path.getsize(local) == size:
            digest = fs.sha256_of(local)  # the bytes that were uploaded
        else:
            digest = fs.sha256_of(fs.join(step_dir, rel))
        out[rel] = {"size": size, "sha256": digest}
    return out


def verify(step_dir: str, marker: dict) -> list[str]:
    """What is wrong with a complete checkpoint's files against its marker's record (empty:
    intact, or nothing recorded to check against)."""
    recorded: dict[str, dict] = marker.get("files") or {}
    if not recorded:
        return []
    from lm_pipeline.train.checkpoint.remote import forget_copy, local_copy

    root = local_copy(step_dir, marker)  # the dir itself; an object store's: its local copy
    problems = []
    for rel, want in sorted(recorded.items()):
        full = os.path.join(root, *rel.split("/"))
        if not os.path.isfile(full):
            problems.append(f"{rel} is missing")
            continue
        size = os.path.getsize(full)
        if size != want.get("size"):
            problems.append(f"{rel} has {size} bytes, {want.get('size')} were written")
        elif fs.sha256_of(full) != want.get("sha256"):
            problems.append(f"{rel} has changed since it was written (sha256 differs)")
    if problems:
        forget_copy(step_dir, marker)  # a damaged download is not kept (a local dir is left as it is)
    return problems


def move_aside(step_dir: str) -> str:
    """Rename a damaged checkpoint dir to ``<parent>/.damaged/<name>-<UTC time>``; returns the new
    path. Its marker goes with it, so it is never found as a checkpoint again. On object stores:
    copied there, then the original's marker deleted first and the rest after."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    step = fs.norm(step_dir)
    target = fs.join(fs.parent(step), DAMAGED_DIR, f"{fs.basename(step)}-{stamp}")
    fs.move(step, target, first=(MARKER,))  # local: one rename; object stores: the marker deleted first
    return target
