"""Which checkpoints stay on disk: pruning by the keep policy, and the ``best/`` copy."""

from __future__ import annotations

from lm_pipeline import atomic, fs
from lm_pipeline.train.checkpoint.marker import (
    BEST_DIR,
    MARKER,
    STEP_RE,
    delete_checkpoint,
    read_marker,
    write_marker,
)

__all__ = ["materialize_best", "prune"]


def prune(base_path: str, new_step: int, new_path: str, keep_last: int | None) -> list[str]:
    """Delete, under ``base_path``, the temporary and incomplete step dirs older than
    ``new_step`` and the permanent ones beyond the last ``keep_last`` (counting ``new_path``).

    Call only after ``new_path`` is complete. Returns what was removed, for the log."""
    removed: list[str] = []
    permanent: list[tuple[int, str]] = []
    for name, is_dir in fs.listdir(base_path):
        m = STEP_RE.match(name)
        if not is_dir or not m:
            continue
        step, child = int(m.group(1)), fs.join(base_path, name)
        if child == new_path:
            continue
        marker = read_marker(child)
        if marker is None or marker.get("kind") == "temporary":
            if step < new_step:
                delete_checkpoint(child)
                removed.append(f"{name} ({'incomplete' if marker is None else 'temporary'})")
        else:
            permanent.append((step, child))
    if keep_last is not None:
        new_marker = read_marker(new_path)
        n_keep = keep_last - (1 if new_marker and new_marker.get("kind") == "permanent" else 0)
        permanent.sort()
        doomed = permanent[: max(len(permanent) - max(n_keep, 0), 0)]
        for _step, child in doomed:
            delete_checkpoint(child)
            removed.append(f"{fs.basename(child)} (permanent, keep_last={keep_last})")
    return removed


def materialize_best(base_path: str, step_path: str, marker: dict) -> None:
    """Make ``<base_path>/best`` a self-contained copy of the complete ``step_path`` whose marker
    is ``marker`` (hard links on local disks, server-side copies on object stores; marker last)."""
    best_marker = dict(marker, best_of=fs.basename(step_path))
    with atomic.replace_dir(fs.join(base_path, BEST_DIR), clear=delete_checkpoint) as staging:
        fs.copy_tree(step_path, staging, exclude=(MARKER,))
        write_marker(staging, best_marker)
