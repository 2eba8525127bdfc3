"""The completion marker: a step dir is a checkpoint only once its ``checkpoint.json`` exists.

Layout of one checkpoint dir (``<base_path>/step-<N>/`` or ``<base_path>/best/``)::

    state/             # the train state: Orbax PyTree checkpoint, OCDBT + zarr3 (a few files);
                       # multi-process runs on an object store: zarr3, a chunk file per shard
    config.yaml ...    # extra files given by the caller (files or whole directories)
    checkpoint.json    # completion marker, written LAST and atomically

The marker records the step, kind (``permanent``/``temporary``), eval loss, completion time,
the saved arrays (dotted key -> shape, dtype), the extra files, the process and device counts,
library versions and the caller's metadata. A directory without it is never loaded, never
counted as the latest, and is removed by the next save of that step (or any later save).
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import re
import sys
import time
from collections.abc import Mapping
from importlib import metadata as importlib_metadata
from typing import Any, Literal

import jax
import numpy as np

from lm_pipeline import atomic, fs

logger = logging.getLogger(__name__)

__all__ = [
    "BEST_DIR",
    "FORMAT",
    "FORMAT_VERSION",
    "MARKER",
    "STATE_DIR",
    "STEP_RE",
    "IncompleteCheckpointError",
    "Kind",
    "delete_checkpoint",
    "new_marker",
    "read_marker",
    "require_marker",
    "stamp_complete",
    "step_dir_name",
    "write_marker",
]

Kind = Literal["permanent", "temporary"]

MARKER = "checkpoint.json"
STATE_DIR = "state"
BEST_DIR = "best"
FORMAT = "lm_pipeline.checkpoint"
FORMAT_VERSION = 1
STEP_RE = re.compile(r"^step-(\d+)$")


class IncompleteCheckpointError(FileNotFoundError):
    """The path is not a complete checkpoint (no completion marker)."""


def step_dir_name(step: int) -> str:
    """The name of step ``step``'s checkpoint dir: ``step-<N>``."""
    return f"step-{int(step)}"


def read_marker(step_dir: str) -> dict | None:
    """The marker of a complete checkpoint dir; None if absent or unreadable (logged)."""
    data = fs.read_bytes(fs.join(step_dir, MARKER))
    if data is None:
        return None
    try:
        marker = json.loads(data)
    except ValueError:
        logger.warning("checkpoint: ignoring %s: unreadable %s", step_dir, MARKER)
        return None
    if not isinstance(marker, dict) or not isinstance(marker.get("step"), int):
        logger.warning("checkpoint: ignoring %s: %s lacks a step", step_dir, MARKER)
        return None
    return marker


def require_marker(path: str) -> dict:
    """The marker of ``path``; raises :class:`IncompleteCheckpointError` saying why there is none."""
    marker = read_marker(path)
    if marker is None:
        what = "does not exist" if not fs.exists(path) else f"has no {MARKER} (interrupted or still being written)"
        raise IncompleteCheckpointError(
            f"{path} is not a complete checkpoint: it {what}. "
            "Use latest_checkpoint(<dir>) to find the latest complete one."
        )
    return marker


def write_marker(step_dir: str, marker: dict) -> None:
    """Write the marker atomically: from now on ``step_dir`` is a complete checkpoint."""
    # Looked up on the module at call time: tests observe every marker write through it.
    atomic.atomic_write_json(fs.join(step_dir, MARKER), marker, fault="checkpoint.marker_tmp_written")


def delete_checkpoint(path: str) -> None:
    """Delete a checkpoint dir, its marker first so that a half-deleted dir never looks complete."""
    fs.remove(fs.join(path, MARKER))
    fs.rmtree(path)


def new_marker(
    step: int,
    kind: Kind,
    *,
    eval_loss: float | None,
    arrays: Mapping[str, dict],
    extra_files: list[str],
    metadata: Mapping[str, Any],
) -> dict:
    """The marker of a checkpoint being written; :func:`stamp_complete` sets its time.

    ``arrays``: dotted key -> ``{"shape": [...], "dtype": str}`` of the saved state (empty: no
    ``state/`` dir); ``extra_files``: names inside the step dir."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "kind": kind,
        "timestamp": None,  # set when complete
        "unix_time": None,
        "eval_loss": eval_loss,
        "state": {
            "dir": STATE_DIR if arrays else None,
            "format": "orbax-pytree-ocdbt-zarr3",
            "num_arrays": len(arrays),
            "bytes": int(sum(int(np.prod(a["shape"])) * np.dtype(a["dtype"]).itemsize for a in arrays.values())),
            "arrays": dict(arrays),
        },
        "extra_files": sorted(extra_files),
        "num_processes": jax.process_count(),
        "num_devices": jax.device_count(),
        "versions": _library_versions(),
        "metadata": dict(metadata),
    }


def stamp_complete(marker: dict) -> None:
    """Set the marker's completion time (``unix_time`` in seconds and an ISO ``timestamp``, UTC)."""
    now = time.time()
    marker["unix_time"] = now
    marker["timestamp"] = datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat()


@functools.cache
def _library_versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for dist in ("lm-pipeline", "jax", "jaxlib", "equinox", "optax", "orbax-checkpoint", "tensorstore", "numpy"):
        try:
            out[dist] = importlib_metadata.version(dist)
        except importlib_metadata.PackageNotFoundError:
            pass
    return out
