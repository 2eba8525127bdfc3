"""Checkpoints on object stores (``s3://``, ``gs://``, ...): staged writes, local read copies.

Orbax writes a checkpoint's arrays into a local staging directory; once they are complete they
are uploaded under ``<run>/step-<N>/``, the per-file sizes and sha256 are recorded in the marker,
and the marker (``checkpoint.json``, one PUT) is uploaded last. In a multi-process run every
process stages into its own directory (no filesystem is shared, the processes may be on different
hosts): Orbax runs with every process as its own primary and without OCDBT (zarr3, one chunk file
per shard), so no process needs another's files; process 0 uploads everything it wrote (its
chunks and the checkpoint's metadata), every other process only its own chunk files and its
``array_metadatas/process_<i>``, and reports their sizes and sha256 to process 0, which writes the
marker after every process's part is on the store (:mod:`.commit`). A process killed at any moment of
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
import tempfile

from lm_pipeline import fs
from lm_pipeline.faultpoints import faultpoint
from lm_pipeline.train.checkpoint.marker import require_marker

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

    Object stores: downloaded once into :func:`cache_root` (:func:`lm_pipeline.fs.local_copy`),
    under a name made from the URL and its marker. The caller verifies it against the marker
    before trusting it."""
    return fs.local_copy(path, cache_dir=cache_root(),
                         key=lambda: _key(fs.norm(path), marker if marker is not None else require_marker(path)))


def forget_copy(path: str, marker: dict) -> None:
    """Drop the local copy of the object-store checkpoint ``path`` (e.g. found damaged); nothing
    for a local checkpoint."""
    fs.forget_copy(path, cache_dir=cache_root(), key=lambda: _key(fs.norm(path), marker))


def staging_dir(url: str, counter: int, process_index: int = 0) -> str:
    """The local directory Orbax writes a checkpoint of ``url`` into before it is uploaded, under
    :func:`cache_root`: one per process (processes on one host never share it)."""
    key = hashlib.sha256(f"{fs.norm(url)}#{counter}".encode()).hexdigest()[:16]
    return os.path.join(cache_root(), "staging", f"{key}-p{int(process_index)}")


# What a process other than 0 writes (its own parts) and what every process writes but only
# process 0 uploads (the checkpoint's metadata, the same on every process or process 0's to keep).
_CHUNK = re.compile(r"^[^/]+/c(?:/|$)")  # zarr3 chunk files of one array: <key>/c/<i>/<j>...
_SHARED = re.compile(r"^(?:_METADATA|_CHECKPOINT_METADATA|_sharding|commit_success\.txt|[^/]+/zarr\.json)$")


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


def upload_state(staging: str, name: str, url: str, process_index: int = 0) -> dict[str, dict]:
    """Upload what this process's Orbax wrote under ``staging/<name>`` to ``url`` file by file;
    returns ``{"<name>/<rel>": {"size", "sha256"}}`` of the uploaded bytes.

    Process 0 uploads every file; another process (its own staging dir) only its parts: chunk
    files and ``array_metadatas/process_<i>``, the rest being process 0's copy of the metadata. A
    file of an unexpected kind on another process is an error (never silently left out). A fault
    point between the files (``checkpoint.upload_partial``) lets tests kill the upload."""
    local_dir = _written_dir(staging, name)
    files = []
    for parent, dirs, names in os.walk(local_dir):
        dirs.sort()
        for n in sorted(names):
            rel = os.path.relpath(os.path.join(parent, n), local_dir).replace(os.sep, "/")
            if process_index == 0 or _CHUNK.match(rel) or rel == f"array_metadatas/process_{process_index}":
                files.append(rel)
            elif not (_SHARED.match(rel) or rel.startswith("array_metadatas/")):
                raise RuntimeError(
                    f"checkpoint: process {process_index} wrote {rel} under {local_dir}, a file of a kind it "
                    "does not upload (neither a chunk nor metadata process 0 writes); refusing an incomplete upload")
    out: dict[str, dict] = {}
    for i, rel in enumerate(files):
        local = os.path.join(local_dir, *rel.split("/"))
        out[f"{name}/{rel}"] = {"size": os.path.getsize(local), "sha256": fs.sha256_of(local)}
        fs.put(local, fs.join(url, *rel.split("/")))
        if i == (len(files) - 1) // 2:
            faultpoint("checkpoint.upload_partial")  # some array files uploaded, not all (one of two)
    return out
