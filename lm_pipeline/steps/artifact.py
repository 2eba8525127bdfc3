"""Building one artifact at its address: the cache hit, the builders' lock and the manifest
written last (:func:`build`), shared by every stage (:meth:`lm_pipeline.steps.Pipeline.run`) and
the comparison of experiments (:mod:`lm_pipeline.steps.comparison`)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from lm_pipeline.steps.result import Address, StageResult
from lm_pipeline.store import ArtifactStore, naming_storage_errors

log = logging.getLogger(__name__)

#: A stage's writer: fills the artifact directory at ``path``, returns (summary, manifest extras).
Writer = Callable[[str], tuple[dict[str, Any], dict[str, Any]]]


def _staged(write: Writer, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``write`` into a local directory: ``path`` itself, or one uploaded to ``path`` (an object
    store) after removing what an interrupted attempt uploaded there (no manifest: never complete)."""
    from lm_pipeline import fs

    with fs.staged(path, clear=True) as local:
        summary, extra = write(local)
    if local != path:  # name the artifact's address, not the staging directory
        text = json.dumps([summary, extra], default=str).replace(json.dumps(local)[1:-1], path)
        summary, extra = json.loads(text)
    return summary, extra


def cached(store: ArtifactStore, addr: Address) -> StageResult | None:
    """The artifact at ``addr`` if it is complete (a cache hit), else None. Does no work. Its path
    may lie outside the store (``data.cache_dir``: the store keeps a pointer to it)."""
    t0 = time.perf_counter()
    manifest = store.manifest(addr.stage, addr.fingerprint)
    if manifest is None:
        return None
    art = store.locate(addr.stage, addr.fingerprint)
    store.remember(art)
    return StageResult(addr.stage, addr.fingerprint, art.path, True, manifest, time.perf_counter() - t0)


def build(store: ArtifactStore, addr: Address, write: Writer, *, staged: bool = False,
          follower: str | None = None) -> StageResult:
    """Build the artifact at ``addr`` with ``write`` unless it is complete; commit its manifest
    (config, inputs, code version, summary) last.

    Builders of one address take the store's lock; the second finds the manifest and returns.
    ``staged``: ``write`` writes local files only; on an object-store root it gets a local
    temporary directory, which is uploaded to the artifact's address (after removing what an
    interrupted attempt left there) before the manifest is written; the temporary path is
    replaced by the address in what ``write`` returns. ``follower`` (a process of a multi-process
    build other than the first, named): writes its part without the lock and commits nothing.
    """
    name, fp = addr.stage, addr.fingerprint
    t0 = time.perf_counter()
    hit = cached(store, addr)
    if hit is not None:
        log.info("%s %s: cache hit (%s)", name, fp, hit.path)
        return hit
    art = store.artifact(name, fp)
    with naming_storage_errors(f"{name} {fp}", art.path):
        with contextlib.nullcontext() if follower else store.lock(art):
            hit = cached(store, addr)  # another writer may have finished
            if hit is not None:
                return hit
            log.info("%s %s: building at %s%s", name, fp, art.path, f" ({follower}: process 0 commits it)" if follower else "")
            summary, extra = _staged(write, art.path) if staged else write(art.path)
            info = {"config": addr.config, "inputs": addr.inputs, "code_version": addr.code_version,
                    "summary": summary, "seconds": round(time.perf_counter() - t0, 3), **extra}
            manifest = {"stage": name, "fingerprint": fp, **info} if follower else store.commit(art, info)
    return StageResult(name, fp, art.path, False, manifest, time.perf_counter() - t0)
