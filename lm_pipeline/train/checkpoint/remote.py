"""Checkpoints on object stores (``s3://``, ``gs://``, ...): staged writes, local read copies.

Orbax writes a checkpoint's arrays into a local staging directory (the same path on every
process; each process of a multi-process run uploads the parts it wrote); once they are complete
they are uploaded under ``<run>/step-<N>/``, the per-file sizes and sha256 are recorded in the marker,
and the marker (``checkpoint.json``, one PUT) is uploaded last. A process killed at any moment of
the upload leaves a ``step-<N>/`` without a marker, which discovery ignores and the next save of
that step replaces: a partial upload is never read as a checkpoint.

Reading downloads a complete checkpoint into a local cache
(``$LM_PIPELINE_CHECKPOINT_CACHE``, default ``<tmp>/lm-pipeline-checkpoints``), keyed by the URL
and its marker (a rewritten checkpoint gets a new copy); the copy is verified against the
marker's record before it is used (:func:`lm_pipeline.train.checkpoint.integrity.verify`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid

from lm_pipeline import fs
from lm_pipeline.faultpoints import faultpoint
from lm_pipeline.train.checkpoint.marker import MARKER, require_marker

__all__ = ["CACHE_ENV", "cache_root", "forget_copy", "local_copy", "staging_dir", "upload_state"]

CACHE_ENV = "LM_PIPELINE_CHECKPOINT_CACHE"


def cache_root() -> str:
    """Where local copies of object-store checkpoints are kept."""
    return os.environ.get(CACHE_ENV) or os.path.join(tempfile.gettempdir(), "lm-pipeline-checkpoints")


def _key(url: str, marker: dict) -> str:
    ident = json.dumps([url, marker.get("unix_time"), marker.get("files")], sort_keys=True, default=str)
    return f"{fs.basename(url)}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def local_copy(path: str, marker: dict | None = None) -> str:
    """A local directory holding the complete checkpoint at ``path`` (itself when local).

    Object stores: downloaded once into :func:`cache_root` (to a temporary name, renamed when
    whole). The caller verifies it against the marker before trusting it."""
    if fs.is_local(path):
        return fs.local_path(path)
    marker = marker if marker is not None else require_marker(path)
    target = os.path.join(cache_root(), _key(fs.norm(path), marker))
    if os.path.isfile(os.path.join(target, MARKER)):
        return target
    os.makedirs(cache_root(), exist_ok=True)
    tmp = f"{target}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        fs.download_tree(path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished the same copy first
            if not os.path.isfile(os.path.join(target, MARKER)):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def forget_copy(path: str, marker: dict) -> None:
    """Drop the local copy of the object-store checkpoint ``path`` (e.g. found damaged)."""
    if not fs.is_local(path):
        shutil.rmtree(os.path.join(cache_root(), _key(fs.norm(path), marker)), ignore_errors=True)


def staging_dir(url: str, counter: int) -> str:
    """The local directory Orbax writes a checkpoint of ``url`` into before it is uploaded: the
    same path on every process of a run (Orbax's processes agree on one directory), under
    :func:`cache_root`."""
    key = hashlib.sha256(f"{fs.norm(url)}#{counter}".encode()).hexdigest()[:16]
    return os.path.join(cache_root(), "staging", key)


_OWNER = re.compile(r"(?:^|/)(?:ocdbt\.)?process_(\d+)(?:/|$)")


def _written_dir(staging: str, name: str) -> str:
    """Orbax's output under ``staging``: ``<name>`` once finalized (the primary's host), else the
    newest ``<name>.orbax-checkpoint-tmp-*`` (another host: the primary renamed only its own)."""
    final = os.path.join(staging, name)
    if os.path.isdir(final):
        return final
    tmps = [os.path.join(staging, d) for d in os.listdir(staging) if d.startswith(f"{name}.orbax-checkpoint-tmp")]
    if not tmps:
        raise FileNotFoundError(f"no {name}/ written under {staging}")
    return max(tmps, key=os.path.getmtime)


def upload_state(staging: str, name: str, url: str, process_index: int = 0, process_count: int = 1) -> None:
    """Upload what Orbax wrote under ``staging/<name>`` to ``url`` file by file. With several
    processes each uploads the files it wrote (``process_<i>`` parts); process 0 the rest. A
    fault point between the files (``checkpoint.upload_partial``) lets tests kill the upload."""
    local_dir = _written_dir(staging, name)
    files = []
    for parent, dirs, names in os.walk(local_dir):
        dirs.sort()
        for n in sorted(names):
            rel = os.path.relpath(os.path.join(parent, n), local_dir).replace(os.sep, "/")
            owner = _OWNER.search(rel)
            mine = (int(owner.group(1)) if owner else 0) == process_index
            if process_count == 1 or mine:
                files.append(rel)
    for i, rel in enumerate(files):
        fs.put(os.path.join(local_dir, *rel.split("/")), fs.join(url, *rel.split("/")))
        if i == len(files) // 2:
            faultpoint("checkpoint.upload_partial")  # some array files uploaded, not all
