"""Finding checkpoints: the latest complete ``step-N`` dir under a path, and a dir's metadata."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

from lm_pipeline import fs
from lm_pipeline.train.checkpoint.marker import BEST_DIR, MARKER, STEP_RE, read_marker, require_marker

logger = logging.getLogger(__name__)

__all__ = ["latest_checkpoint", "read_metadata"]

_MAX_SEARCH_DEPTH = 16


def _walk_step_dirs(root: str, depth: int = 0) -> Iterator[tuple[int, str, dict]]:
    """(step, dir, marker) of complete ``step-N`` dirs below ``root``; does not descend into
    checkpoint dirs."""
    if depth > _MAX_SEARCH_DEPTH:
        return
    entries = sorted(fs.listdir(root))
    if depth > 0 and any(name == MARKER and not is_dir for name, is_dir in entries):
        return  # some other complete checkpoint dir (best/, a copy): not a step-N
    for name, is_dir in entries:
        if not is_dir or name.startswith(".") or name == BEST_DIR or ".orbax-checkpoint-tmp" in name:
            continue
        child = fs.join(root, name)
        m = STEP_RE.match(name)
        if m:
            marker = read_marker(child)
            if marker is not None:
                yield int(m.group(1)), child, marker
            continue
        yield from _walk_step_dirs(child, depth + 1)


def latest_checkpoint(path: str | os.PathLike) -> str | None:
    """The complete ``step-N`` dir with the largest N found recursively under ``path``.

    ``path`` may itself be a complete checkpoint dir (returned as is). Directories without a
    completion marker are ignored. Ties (same N in several sub-directories) go to the newest.
    Returns None if there is none.
    """
    root = fs.norm(path)
    if read_marker(root) is not None:
        return root
    if STEP_RE.match(fs.basename(root)):
        if fs.exists(root):
            logger.warning("checkpoint: %s is an incomplete checkpoint (no %s); ignoring it", root, MARKER)
        return None
    best: tuple[int, float, str] | None = None
    for step, child, marker in _walk_step_dirs(root):
        key = (step, float(marker.get("unix_time", 0.0)), child)
        if best is None or key > best:
            best = key
    return None if best is None else best[2]


def read_metadata(path: str | os.PathLike) -> dict:
    """The completion marker of a checkpoint dir (step, kind, timestamp, versions, metadata, ...)."""
    return require_marker(fs.norm(path))
