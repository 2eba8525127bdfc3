"""Checkpoints on object stores (``s3://``, ``gs://``, ...): staged writes, local read copies.

Orbax writes a checkpoint's arrays into a local staging directory; once they are complete they
are uploaded under ``<run>/step-<N>/``, the per-file sizes and sha256 are recorded in the marker,
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
import shutil
import tempfile
import uuid

from lm_pipeline import fs
from lm_pipeline.faultpoints import faultpoint
from lm_pipeline.train.checkpoint.marker import MARKER, require_marker

__all__ = ["CACHE_ENV", "cache_root", "local_copy", "upload_state"]

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


def upload_state(local_dir: str, url: str) -> None:
    """Upload the staged arrays ``local_dir`` to ``url`` file by file. A fault point between the
    files (``checkpoint.upload_partial``) lets tests kill the upload half-way."""
    files = []
    for parent, dirs, names in os.walk(local_dir):
        dirs.sort()
        files.extend(os.path.join(parent, n) for n in sorted(names))
    for i, src in enumerate(files):
        rel = os.path.relpath(src, local_dir).replace(os.sep, "/")
        fs.put(src, fs.join(url, *rel.split("/")))
        if i == len(files) // 2:
            faultpoint("checkpoint.upload_partial")  # some array files uploaded, not all
