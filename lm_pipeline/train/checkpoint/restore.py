"""Elastic restore: a checkpoint dir into the structure, shapes and shardings the caller asks for.

Arrays are placed on the target shardings whatever the device count at save time; same dtypes
restore bit-exactly. A part of the state (``subtree``, e.g. only the model) can be loaded alone.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import jax
import numpy as np

from lm_pipeline import fs
from lm_pipeline.train.checkpoint.commit import log_on_primary
from lm_pipeline.train.checkpoint.flatten import flat_keys, join_key, new_pytree_handler, target_sharding
from lm_pipeline.train.checkpoint.marker import STATE_DIR, require_marker

logger = logging.getLogger(__name__)

__all__ = ["load"]


def load(
    path: str | os.PathLike,
    abstract_state: Any,
    *,
    subtree: str | None = None,
    strict: bool = True,
) -> Any:
    """Restore a checkpoint dir into the structure, shapes and shardings of ``abstract_state``.

    Args:
        path: a complete checkpoint dir (``.../step-N`` or ``.../best``).
        abstract_state: a pytree whose leaves have ``shape``, ``dtype`` and ``sharding``
            (``jax.ShapeDtypeStruct(..., sharding=...)`` or concrete ``jax.Array``s). Arrays are
            placed on these shardings, whatever the device layout at save time. A differing dtype
            casts; same dtypes restore bit-exactly.
        subtree: load only the saved leaves under this dotted key prefix (e.g. ``"model"`` to load
            the model of a train state); ``abstract_state`` then describes that subtree.
        strict: with ``subtree=None``, fail if the checkpoint holds arrays the target lacks.
    """
    t0 = time.perf_counter()
    path = fs.norm(path)
    marker = require_marker(path)
    saved: dict[str, dict] = marker.get("state", {}).get("arrays", {})
    keys, leaves, treedef = flat_keys(abstract_state)
    full = [join_key(subtree, k) for k in keys]
    wanted = dict(zip(full, leaves, strict=True))  # keys are unique: flat_keys checks
    extra = _check_compatible(path, saved, wanted, strict=strict and not subtree)
    restored: dict[str, Any] = {}
    if full:
        from lm_pipeline.train.checkpoint.remote import local_copy

        # Object stores: Orbax reads a local copy (downloaded once, see .remote).
        state_dir = fs.join(local_copy(path, marker), marker.get("state", {}).get("dir", STATE_DIR))
        restored = _restore_arrays(state_dir, wanted, partial=bool(extra))
    out = jax.tree_util.tree_unflatten(treedef, [restored[k] for k in full])
    log_on_primary(
        logger,
        "checkpoint: loaded step %d from %s (%d arrays%s) in %.2fs",
        marker["step"], path, len(full), f", subtree {subtree!r}" if subtree else "", time.perf_counter() - t0,
    )
    return out


def _check_compatible(path: str, saved: dict[str, dict], wanted: dict[str, Any], *, strict: bool) -> list[str]:
    """Raise unless every wanted key is saved with its shape (and, if ``strict``, nothing else
    is saved); returns the saved keys that are not wanted."""
    missing = [k for k in wanted if k not in saved]
    if missing:
        raise ValueError(
            f"checkpoint {path} lacks {len(missing)} array(s) the target expects, e.g. {missing[:5]}; "
            f"it holds {len(saved)}, e.g. {sorted(saved)[:5]}"
        )
    bad_shapes = [
        f"{k}: saved {tuple(saved[k]['shape'])}, expected {tuple(leaf.shape)}"
        for k, leaf in wanted.items()
        if tuple(saved[k]["shape"]) != tuple(leaf.shape)
    ]
    if bad_shapes:
        raise ValueError(f"checkpoint {path} has arrays of other shapes: {bad_shapes[:5]}")
    extra = sorted(set(saved) - set(wanted))
    if extra and strict:
        raise ValueError(
            f"checkpoint {path} holds {len(extra)} array(s) the target lacks, e.g. {extra[:5]}; "
            "pass strict=False (or subtree=...) to load a part of it"
        )
    return extra


def _restore_arrays(state_dir: str, wanted: dict[str, Any], *, partial: bool) -> dict[str, Any]:
    """Read the arrays ``wanted`` (dotted key -> abstract leaf) from an Orbax ``state/`` dir onto
    the leaves' shardings, cast to their dtypes."""
    import orbax.checkpoint as ocp

    target, restore_args = {}, {}
    for k, leaf in wanted.items():
        sharding = target_sharding(k, leaf)
        shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
        target[k] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        restore_args[k] = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype)
    with ocp.Checkpointer(new_pytree_handler()) as ckptr:
        return ckptr.restore(
            state_dir, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=partial)
        )
