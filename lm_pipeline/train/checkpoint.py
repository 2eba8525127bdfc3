"""Training checkpoints: Orbax/TensorStore array storage, a completion marker, a keep policy.

On-disk layout (``base_path`` is a local path or any URL TensorStore/fsspec can write)::

    <base_path>/
      step-<N>/
        state/             # the train state: Orbax PyTree checkpoint, OCDBT + zarr3 (a few files)
        config.yaml ...    # extra files given by the caller (files or whole directories)
        checkpoint.json    # completion marker, written LAST and atomically
      best/                # keep_best: a complete copy of the best step dir (its own marker)

A directory is a checkpoint only if its ``checkpoint.json`` exists: a directory without it is
never loaded, never counted as the latest, and is removed by the next save of that step (or by
any later save, for older steps).

The state is any pytree of arrays (e.g. ``eqx.filter(train_state, eqx.is_array)``). It is stored
as a flat mapping ``dotted.key.path -> array``, so the container types do not matter on load:
``load`` takes an abstract pytree (``jax.ShapeDtypeStruct`` leaves with ``.sharding``) and
returns that structure with the arrays placed on the requested shardings, whatever the device
count at save time (elastic restore). Restored arrays are bit-identical to the saved ones.

Keep policy (Levanter's): a step ``N >= 1`` is saved as *permanent* if the first ``keep`` rule
whose ``until`` is null or ``>= N`` has ``N % every == 0``; otherwise a *temporary* checkpoint is
saved once ``save_interval`` wall time has passed since the last save. A temporary checkpoint is
deleted after a newer checkpoint is complete. ``force=True`` (end of training) saves a permanent
one. ``keep_last=K`` keeps only the K permanent checkpoints with the largest steps. With
``keep_best``, an eval loss lower than any before forces a save at that step and ``best/`` becomes a
self-contained copy of it (hard links on local disks, server-side copies on object stores).

Saves are asynchronous by default: ``save`` returns once the arrays are in host memory; the write,
the marker and the cleanup finish in a background thread (``wait()`` joins it and re-raises its
errors). In a multi-process run every process calls ``save``/``wait``; Orbax writes each process's
shards, process 0 writes the extra files and, after every process reported its part written,
the marker; ``wait()`` returns on every process only after that.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import math
import os
import re
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from typing import Any, Literal

import jax
import numpy as np

from lm_pipeline import atomic
from lm_pipeline.faultpoints import faultpoint
from lm_pipeline.schema import ConfigError, field

logger = logging.getLogger(__name__)

Kind = Literal["permanent", "temporary"]

MARKER = "checkpoint.json"
STATE_DIR = "state"
BEST_DIR = "best"
FORMAT = "lm_pipeline.checkpoint"
FORMAT_VERSION = 1

_STEP_RE = re.compile(r"^step-(\d+)$")
_DURATION_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd])\s*")
_UNIT_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_\-]")
_MAX_SEARCH_DEPTH = 16
_TIMEOUT_S = 3600

__all__ = [
    "Checkpointer",
    "CheckpointerConfig",
    "IncompleteCheckpointError",
    "KeepPolicy",
    "latest_checkpoint",
    "load",
    "parse_duration",
    "read_metadata",
    "step_dir_name",
]


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """Seconds in a duration string: a number with a unit s/m/h/d, or several ('1h30m').

    Raises ValueError for anything else (including non-positive durations).
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"invalid duration {text!r}")
    pos, total = 0, 0.0
    for m in _DURATION_RE.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
        pos = m.end()
    if pos != len(text):
        raise ValueError(
            f"invalid duration {text!r}: expected a number followed by a unit s, m, h or d "
            "(e.g. '90s', '15m', '1h30m', '2d')"
        )
    if total <= 0:
        raise ValueError(f"invalid duration {text!r}: must be greater than zero")
    return total


@dataclass(frozen=True)
class KeepPolicy:
    """One rule of the permanent-checkpoint policy: every `every` steps, up to step `until`."""

    every: int = field(help="Save a permanent checkpoint when step % every == 0.", semantic=False)
    until: int | None = field(
        None, help="Last step (inclusive) this rule applies to; null = all later steps.", semantic=False
    )

    def validate(self) -> None:
        if self.every < 1:
            raise ConfigError("every", "must be >= 1")
        if self.until is not None and self.until < 1:
            raise ConfigError("until", "must be >= 1 or null")


def _default_keep() -> tuple[KeepPolicy, ...]:
    return (KeepPolicy(every=10000),)


@dataclass(frozen=True)
class CheckpointerConfig:
    """Where and when train-state checkpoints are written, and which ones are kept."""

    base_path: str | None = field(
        None,
        help="Directory or URL (gs://, s3://, ...) holding runs; a run's step-<N>/ dirs go to <base_path>/<run id>. "
        "null = the run's address in the artifact store (<store.root>/train_ckpt/<fingerprint>).",
        semantic=False,
    )
    save_interval: str = field(
        "15m",
        help="Wall time between temporary checkpoints: a number with unit s/m/h/d ('90s', '15m', '1h30m').",
        semantic=False,
    )
    keep: tuple[KeepPolicy, ...] = field(
        default_factory=_default_keep,
        help="Permanent checkpoints: rules {every, until}, applied in order; the first rule whose until "
        "is null or >= step decides.",
        semantic=False,
    )
    keep_last: int | None = field(
        None,
        help="Keep only the last K permanent checkpoints (by step); null keeps all of them.",
        semantic=False,
    )
    keep_best: bool = field(
        False,
        help="Keep a copy best/ of the checkpoint with the lowest eval loss; an improving eval forces a save.",
        semantic=False,
    )

    def validate(self) -> None:
        try:
            parse_duration(self.save_interval)
        except ValueError as e:
            raise ConfigError("save_interval", str(e)) from None
        previous: int | None = None
        for i, rule in enumerate(self.keep):
            if rule.until is None and i != len(self.keep) - 1:
                raise ConfigError(f"keep[{i}].until", "only the last keep rule may have no 'until'")
            if rule.until is not None and previous is not None and rule.until <= previous:
                raise ConfigError(f"keep[{i}].until", f"must be greater than the previous rule's until ({previous})")
            previous = rule.until
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError("keep_last", "must be >= 1 or null (keep all permanent checkpoints)")

    @property
    def save_interval_seconds(self) -> float:
        return parse_duration(self.save_interval)

    def is_permanent_step(self, step: int) -> bool:
        """Whether the keep policy asks for a permanent checkpoint at ``step`` (never at step 0)."""
        if step < 1:
            return False
        for rule in self.keep:
            if rule.until is None or step <= rule.until:
                return step % rule.every == 0
        return False


# --------------------------------------------------------------------------------------------
# Filesystem helpers (local paths via os, URLs via fsspec)
# --------------------------------------------------------------------------------------------


class IncompleteCheckpointError(FileNotFoundError):
    """The path is not a complete checkpoint (no completion marker)."""


def _norm(path: str | os.PathLike) -> str:
    text = os.fspath(path)
    return atomic.local_path(text) if atomic.is_local(text) else text.rstrip("/")


def _basename(path: str) -> str:
    return os.path.basename(path) if atomic.is_local(path) else path.rstrip("/").rsplit("/", 1)[-1]


def _exists(path: str) -> bool:
    if atomic.is_local(path):
        return os.path.exists(path)
    fs, inner = atomic.get_fs(path)
    return fs.exists(inner)


def _read_bytes(path: str) -> bytes | None:
    try:
        if atomic.is_local(path):
            with open(path, "rb") as f:
                return f.read()
        fs, inner = atomic.get_fs(path)
        return fs.cat_file(inner)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def _listdir(path: str) -> list[tuple[str, bool]]:
    """(name, is_dir) of the children of ``path``; empty if it does not exist."""
    if atomic.is_local(path):
        try:
            with os.scandir(path) as it:
                return [(e.name, e.is_dir()) for e in it]
        except (FileNotFoundError, NotADirectoryError):
            return []
    fs, inner = atomic.get_fs(path)
    try:
        fs.invalidate_cache(inner)
        entries = fs.ls(inner, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for e in entries:
        name = e["name"].rstrip("/").rsplit("/", 1)[-1]
        if name and e["name"].rstrip("/") != inner.rstrip("/"):
            out.append((name, e.get("type") == "directory"))
    return out


def _makedirs(path: str) -> None:
    if atomic.is_local(path):
        os.makedirs(path, exist_ok=True)
    else:
        fs, inner = atomic.get_fs(path)
        fs.makedirs(inner, exist_ok=True)


def _rmtree(path: str) -> None:
    if atomic.is_local(path):
        if os.path.islink(path) or os.path.isfile(path):
            os.unlink(path)
        elif os.path.isdir(path):
            shutil.rmtree(path)
        return
    fs, inner = atomic.get_fs(path)
    try:
        fs.rm(inner, recursive=True)
    except FileNotFoundError:
        pass


def _delete_checkpoint(path: str) -> None:
    """Remove the marker first so that a half-deleted directory never looks complete."""
    marker = atomic.join(path, MARKER)
    if atomic.is_local(path):
        try:
            os.unlink(marker)
        except FileNotFoundError:
            pass
    else:
        fs, inner = atomic.get_fs(marker)
        try:
            fs.rm_file(inner)
        except FileNotFoundError:
            pass
    _rmtree(path)


def _copy_tree(src: str, dst: str, *, exclude: tuple[str, ...] = ()) -> None:
    """Copy a directory: hard links where possible on local disks, server-side copies on stores."""
    if atomic.is_local(src) and atomic.is_local(dst):
        os.makedirs(dst, exist_ok=True)
        for root, dirs, files in os.walk(src):
            rel = os.path.relpath(root, src)
            target_root = dst if rel == "." else os.path.join(dst, rel)
            os.makedirs(target_root, exist_ok=True)
            for d in dirs:
                os.makedirs(os.path.join(target_root, d), exist_ok=True)
            for name in files:
                if rel == "." and name in exclude:
                    continue
                s, t = os.path.join(root, name), os.path.join(target_root, name)
                try:
                    os.link(s, t)
                except OSError:
                    shutil.copy2(s, t)
        return
    fs, src_inner = atomic.get_fs(src)
    _, dst_inner = atomic.get_fs(dst)
    for name, is_dir in _listdir(src):
        if name in exclude:
            continue
        fs.copy(f"{src_inner}/{name}", f"{dst_inner}/{name}", recursive=is_dir)


def _put_local(source: str, target: str) -> None:
    """Copy a local file or directory to ``target`` (local path or URL)."""
    if atomic.is_local(target):
        if os.path.isdir(source):
            shutil.copytree(source, target, dirs_exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(source, target)
        return
    fs, inner = atomic.get_fs(target)
    fs.put(source, inner, recursive=os.path.isdir(source))


def step_dir_name(step: int) -> str:
    return f"step-{int(step)}"


def _read_marker(step_dir: str) -> dict | None:
    data = _read_bytes(atomic.join(step_dir, MARKER))
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


def _require_marker(path: str) -> dict:
    marker = _read_marker(path)
    if marker is None:
        what = "does not exist" if not _exists(path) else f"has no {MARKER} (interrupted or still being written)"
        raise IncompleteCheckpointError(
            f"{path} is not a complete checkpoint: it {what}. "
            "Use latest_checkpoint(<dir>) to find the latest complete one."
        )
    return marker


# --------------------------------------------------------------------------------------------
# Discovery and metadata
# --------------------------------------------------------------------------------------------


def _walk_step_dirs(root: str, depth: int = 0) -> Iterator[tuple[int, str, dict]]:
    """Complete ``step-N`` dirs below ``root``; does not descend into checkpoint dirs."""
    if depth > _MAX_SEARCH_DEPTH:
        return
    entries = sorted(_listdir(root))
    if depth > 0 and any(name == MARKER and not is_dir for name, is_dir in entries):
        return  # some other complete checkpoint dir (best/, a copy): not a step-N
    for name, is_dir in entries:
        if not is_dir or name.startswith(".") or name == BEST_DIR or ".orbax-checkpoint-tmp" in name:
            continue
        child = atomic.join(root, name)
        m = _STEP_RE.match(name)
        if m:
            marker = _read_marker(child)
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
    root = _norm(path)
    if _read_marker(root) is not None:
        return root
    if _STEP_RE.match(_basename(root)):
        if _exists(root):
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
    return _require_marker(_norm(path))


@functools.cache
def _library_versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for dist in ("lm-pipeline", "jax", "jaxlib", "equinox", "optax", "orbax-checkpoint", "tensorstore", "numpy"):
        try:
            out[dist] = importlib_metadata.version(dist)
        except importlib_metadata.PackageNotFoundError:
            pass
    return out


# --------------------------------------------------------------------------------------------
# State flattening
# --------------------------------------------------------------------------------------------


def _key_part(entry: Any) -> str:
    tu = jax.tree_util
    if isinstance(entry, tu.DictKey):
        text = str(entry.key)
    elif isinstance(entry, tu.GetAttrKey):
        text = entry.name
    elif isinstance(entry, tu.SequenceKey):
        text = str(entry.idx)
    elif isinstance(entry, tu.FlattenedIndexKey):
        text = str(entry.key)
    else:
        text = str(entry)
    return _KEY_UNSAFE.sub("_", text) or "_"


def _join_key(prefix: str | None, key: str) -> str:
    """Full saved key of a leaf: ``prefix.key``; a lone root leaf is ``prefix`` (or ``value``)."""
    if not prefix:
        return key or "value"
    return f"{prefix}.{key}" if key else prefix


def _flat_keys(tree: Any) -> tuple[list[str], list[Any], Any]:
    """Dotted keys ("" for a lone root leaf), leaves and treedef of a pytree; errors on collisions."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    keys = [".".join(_key_part(e) for e in path) for path, _ in with_path]
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        dups = sorted({k for k in keys if k in seen or seen.add(k)})
        raise ValueError(f"state pytree has leaves whose key paths collide after sanitizing: {dups[:5]}")
    return keys, [leaf for _, leaf in with_path], treedef


def _is_prng_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _prepare_state(state: Any) -> tuple[dict[str, Any], dict[str, dict]]:
    keys, leaves, _ = _flat_keys(state)
    flat: dict[str, Any] = {}
    info: dict[str, dict] = {}
    for key, leaf in zip(map(functools.partial(_join_key, None), keys), leaves, strict=True):
        if _is_prng_key(leaf):
            raise TypeError(
                f"state leaf {key!r} is a typed PRNG key array; store jax.random.key_data(key) (uint32) instead"
            )
        if isinstance(leaf, (bool, int, float, np.generic)):
            leaf = np.asarray(leaf)
        if not isinstance(leaf, (jax.Array, np.ndarray)):
            raise TypeError(
                f"state leaf {key!r} is a {type(leaf).__name__}, not an array; "
                "pass only arrays (e.g. eqx.filter(state, eqx.is_array))"
            )
        flat[key] = leaf
        info[key] = {"shape": [int(d) for d in leaf.shape], "dtype": str(np.dtype(leaf.dtype))}
    return flat, info


def _target_sharding(key: str, leaf: Any) -> Any:
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
        return sharding
    if jax.process_count() > 1:
        raise ValueError(f"abstract leaf {key!r} has no sharding; multi-process restores need one on every leaf")
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _new_pytree_handler() -> Any:
    import orbax.checkpoint as ocp

    return ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)


# --------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------


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
    import orbax.checkpoint as ocp

    t0 = time.perf_counter()
    path = _norm(path)
    marker = _require_marker(path)
    saved: dict[str, dict] = marker.get("state", {}).get("arrays", {})
    keys, leaves, treedef = _flat_keys(abstract_state)
    full = [_join_key(subtree, k) for k in keys]

    missing = [k for k in full if k not in saved]
    if missing:
        raise ValueError(
            f"checkpoint {path} lacks {len(missing)} array(s) the target expects, e.g. {missing[:5]}; "
            f"it holds {len(saved)}, e.g. {sorted(saved)[:5]}"
        )
    bad_shapes = [
        f"{k}: saved {tuple(saved[k]['shape'])}, expected {tuple(leaf.shape)}"
        for k, leaf in zip(full, leaves, strict=True)
        if tuple(saved[k]["shape"]) != tuple(leaf.shape)
    ]
    if bad_shapes:
        raise ValueError(f"checkpoint {path} has arrays of other shapes: {bad_shapes[:5]}")
    extra = sorted(set(saved) - set(full))
    if extra and strict and not subtree:
        raise ValueError(
            f"checkpoint {path} holds {len(extra)} array(s) the target lacks, e.g. {extra[:5]}; "
            "pass strict=False (or subtree=...) to load a part of it"
        )

    restored: dict[str, Any] = {}
    if full:
        target, restore_args = {}, {}
        for k, leaf in zip(full, leaves, strict=True):
            sharding = _target_sharding(k, leaf)
            shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
            target[k] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
            restore_args[k] = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype)
        with ocp.Checkpointer(_new_pytree_handler()) as ckptr:
            restored = ckptr.restore(
                atomic.join(path, marker.get("state", {}).get("dir", STATE_DIR)),
                args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=bool(extra)),
            )
    out = jax.tree_util.tree_unflatten(treedef, [restored[k] for k in full])
    _log(
        "checkpoint: loaded step %d from %s (%d arrays%s) in %.2fs",
        marker["step"], path, len(full), f", subtree {subtree!r}" if subtree else "", time.perf_counter() - t0,
    )
    return out


def _kv_client() -> Any:
    """The jax.distributed coordination client (key-value store), as Orbax also uses it."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("multi-process checkpointing needs jax.distributed.initialize()")
    return client


def _status(error: BaseException | None) -> str:
    return "ok" if error is None else f"error: {type(error).__name__}: {error}"[:2000]


def _log(msg: str, *args: Any) -> None:
    logger.log(logging.INFO if jax.process_index() == 0 else logging.DEBUG, msg, *args)


# --------------------------------------------------------------------------------------------
# Checkpointer
# --------------------------------------------------------------------------------------------


ExtraFile = str | bytes | os.PathLike


def _check_extra_files(extra_files: Mapping[str, ExtraFile] | None) -> dict[str, ExtraFile]:
    out: dict[str, ExtraFile] = {}
    for name, value in (extra_files or {}).items():
        parts = name.replace("\\", "/").strip("/").split("/")
        if not name or os.path.isabs(name) or "://" in name or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"extra file name {name!r} must be a relative path inside the checkpoint dir")
        if parts[0] == MARKER or parts[0] == STATE_DIR or parts[0].startswith(STATE_DIR + "."):
            raise ValueError(f"extra file name {name!r} is reserved")
        if isinstance(value, os.PathLike):
            if not os.path.exists(value):
                raise FileNotFoundError(f"extra file {name!r}: source {os.fspath(value)!r} does not exist")
        elif not isinstance(value, (str, bytes)):
            raise TypeError(
                f"extra file {name!r}: expected str/bytes content or a pathlib.Path source, got {type(value).__name__}"
            )
        out["/".join(parts)] = value
    return out


@dataclasses.dataclass
class _Pending:
    step: int
    path: str
    thread: threading.Thread | None
    error: BaseException | None = None


class Checkpointer:
    """Saves train-state checkpoints by the keep policy; loads them back (see module docstring).

    Args:
        config: the policy and location.
        base_path_override: write here instead of ``config.base_path`` (e.g. a run-specific dir).
        clock: wall clock in seconds for ``save_interval`` (injectable for tests).
        async_save: return from ``save`` once the arrays are copied to host memory; the write,
            the marker and the cleanup of older checkpoints finish in the background (``wait()``).

    All processes of a multi-process run must call ``maybe_save``/``save``/``wait`` together with
    the same arguments; Orbax coordinates the array writes, and process 0 writes the extra files
    and the marker once every process finished its part.
    """

    def __init__(
        self,
        config: CheckpointerConfig,
        base_path_override: str | os.PathLike | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        async_save: bool = True,
    ):
        config.validate()
        self.config = config
        base = base_path_override if base_path_override is not None else config.base_path
        if base is None:
            raise ValueError("Checkpointer needs a directory: set checkpointer.base_path or pass base_path_override")
        self.base_path = _norm(base)
        self._clock = clock
        self._interval = config.save_interval_seconds
        self._async = async_save
        self._last_save_time = clock()
        self._orbax: Any = None
        self._pending: _Pending | None = None
        self._counter = 0
        self._best_loss: float | None = None
        self._best_loaded = False
        self._prev_status_key: str | None = None

    # ---------------------------------------------------------------- policy

    def maybe_save(
        self,
        step: int,
        state: Any,
        *,
        force: bool = False,
        extra_files: Mapping[str, ExtraFile] | None = None,
        metadata: Mapping[str, Any] | None = None,
        eval_loss: float | None = None,
    ) -> str | None:
        """Save if the policy asks for it at ``step``; returns the checkpoint dir or None.

        Call after step ``step`` has been applied. Permanent: ``force`` or the keep rules;
        temporary: ``save_interval`` elapsed since the last save, or (``keep_best``) an
        ``eval_loss`` lower than any before.
        """
        step = int(step)
        kind: Kind | None = None
        if force or self.config.is_permanent_step(step):
            kind = "permanent"
        elif self._clock() - self._last_save_time >= self._interval or self._improves_best(eval_loss):
            kind = "temporary"
        if kind is None:
            return None
        return self.save(step, state, kind, extra_files=extra_files, metadata=metadata, eval_loss=eval_loss)

    def _improves_best(self, eval_loss: float | None) -> bool:
        if not self.config.keep_best or eval_loss is None or not math.isfinite(float(eval_loss)):
            return False
        if not self._best_loaded:
            marker = _read_marker(atomic.join(self.base_path, BEST_DIR))
            loss = marker.get("eval_loss") if marker else None
            self._best_loss = float(loss) if isinstance(loss, (int, float)) else None
            self._best_loaded = True
        return self._best_loss is None or float(eval_loss) < self._best_loss

    # ---------------------------------------------------------------- save

    def save(
        self,
        step: int,
        state: Any,
        kind: Kind = "permanent",
        *,
        extra_files: Mapping[str, ExtraFile] | None = None,
        metadata: Mapping[str, Any] | None = None,
        eval_loss: float | None = None,
    ) -> str:
        """Write a checkpoint of ``state`` at ``step`` now; returns its dir ``<base>/step-<N>``.

        ``extra_files`` maps names inside the step dir to content (str/bytes) or to a local
        file/directory to copy (``pathlib.Path``). ``metadata`` (JSON-able) goes into the marker.
        If a complete checkpoint of this step exists, it is kept (a temporary one is promoted to
        permanent if asked) and no arrays are written.
        """
        import orbax.checkpoint as ocp

        if kind not in ("permanent", "temporary"):
            raise ValueError(f"kind must be 'permanent' or 'temporary', got {kind!r}")
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        extras = _check_extra_files(extra_files)
        user_meta = dict(metadata or {})
        json.dumps(user_meta, allow_nan=False)  # fail now, not in the background
        self.wait()
        t0 = time.perf_counter()
        self._last_save_time = self._clock()
        self._counter += 1
        loss = None if eval_loss is None else float(eval_loss)
        update_best = self._improves_best(loss)
        if update_best:
            self._best_loss = loss
        primary = jax.process_index() == 0
        path = atomic.join(self.base_path, step_dir_name(step))

        existing = _read_marker(path)
        if existing is not None:
            if primary:
                self._reuse_existing(path, existing, kind, loss, update_best)
            ocp.multihost.sync_global_processes(f"lm_pipeline_checkpoint_reuse_{step}_{self._counter}")
            return path

        flat, arrays = _prepare_state(state)
        if primary:
            if _exists(path):
                logger.warning("checkpoint: removing incomplete %s before saving step %d", path, step)
                _rmtree(path)
            _makedirs(path)
            for name, value in extras.items():
                target = atomic.join(path, *name.split("/"))
                if isinstance(value, os.PathLike):
                    _put_local(os.fspath(value), target)
                else:
                    atomic.atomic_write_bytes(target, value.encode() if isinstance(value, str) else value)
        ocp.multihost.sync_global_processes(f"lm_pipeline_checkpoint_prepare_{step}_{self._counter}")

        faultpoint("checkpoint.before_arrays")  # the step dir and its extra files exist
        if flat:
            if self._orbax is None:
                self._orbax = ocp.AsyncCheckpointer(_new_pytree_handler(), timeout_secs=_TIMEOUT_S)
            self._orbax.save(atomic.join(path, STATE_DIR), args=ocp.args.PyTreeSave(flat))
        blocking = time.perf_counter() - t0

        marker = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": step,
            "kind": kind,
            "timestamp": None,  # set when complete
            "unix_time": None,
            "eval_loss": loss,
            "state": {
                "dir": STATE_DIR if flat else None,
                "format": "orbax-pytree-ocdbt-zarr3",
                "num_arrays": len(arrays),
                "bytes": int(sum(int(np.prod(a["shape"])) * np.dtype(a["dtype"]).itemsize for a in arrays.values())),
                "arrays": arrays,
            },
            "extra_files": sorted(extras),
            "num_processes": jax.process_count(),
            "num_devices": jax.device_count(),
            "versions": _library_versions(),
            "metadata": user_meta,
        }
        sync_key = f"lm_pipeline_checkpoint_{step}_{self._counter}"

        def finalize() -> None:
            nproc, pid = jax.process_count(), jax.process_index()
            local_error: BaseException | None = None
            try:
                if flat:
                    self._orbax.wait_until_finished()
            except BaseException as e:
                local_error = e
            removed: list[str] = []
            if not primary:
                # Tell process 0 this process's part is written, then wait for its verdict so that
                # after wait() every process sees the same checkpoints (marker, cleanup).
                client = _kv_client()
                client.key_value_set(f"{sync_key}_written_{pid}", _status(local_error))
                status = client.blocking_key_value_get(f"{sync_key}_status", _TIMEOUT_S * 1000)
                if local_error is not None:
                    raise local_error
                if status != "ok":
                    raise RuntimeError(f"checkpoint {path} was not completed by process 0: {status}")
            else:
                status = "error: unknown"
                try:
                    if local_error is not None:
                        raise local_error
                    if nproc > 1:  # barrier: every process has written its arrays
                        client = _kv_client()
                        failed = []
                        for other in range(1, nproc):
                            key = f"{sync_key}_written_{other}"
                            got = client.blocking_key_value_get(key, _TIMEOUT_S * 1000)
                            client.key_value_delete(key)
                            if got != "ok":
                                failed.append(f"process {other}: {got}")
                        if failed:
                            raise RuntimeError(f"checkpoint {path}: {'; '.join(failed[:5])}")
                    now = time.time()
                    marker["unix_time"] = now
                    marker["timestamp"] = datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat()
                    faultpoint("checkpoint.before_marker")  # arrays written, marker not yet
                    self._write_marker(path, marker)
                    if update_best:
                        self._materialize_best(path, marker)
                    removed = self._prune(step, path)
                    status = "ok"
                except BaseException as e:
                    status = _status(e)
                    raise
                finally:
                    if nproc > 1:
                        client = _kv_client()
                        client.key_value_set(f"{sync_key}_status", status)
                        if self._prev_status_key:  # every process has read it (they all passed save())
                            client.key_value_delete(self._prev_status_key)
                        self._prev_status_key = f"{sync_key}_status"
            _log(
                "checkpoint: saved step %d (%s) to %s in %.2fs (training blocked %.2fs)%s",
                step, kind, path, time.perf_counter() - t0, blocking,
                f"; removed {', '.join(removed)}" if removed else "",
            )

        if not self._async:
            finalize()
            return path
        pending = _Pending(step=step, path=path, thread=None)

        def run() -> None:
            try:
                finalize()
            except BaseException as e:  # surfaced by wait()
                pending.error = e
                logger.exception("checkpoint: saving step %d to %s failed", step, path)

        pending.thread = threading.Thread(target=run, name=f"checkpoint-step-{step}", daemon=False)
        self._pending = pending
        pending.thread.start()
        return path

    def wait(self) -> None:
        """Block until the last save is complete (marker written, old checkpoints cleaned up)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.thread is not None:
            pending.thread.join()
        if pending.error is not None:
            raise RuntimeError(f"checkpoint save of step {pending.step} to {pending.path} failed") from pending.error

    def close(self) -> None:
        """Wait for the last save and release Orbax's resources."""
        try:
            self.wait()
        finally:
            if self._orbax is not None:
                self._orbax.close()
                self._orbax = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------- load / discovery

    def latest_checkpoint(self, path: str | os.PathLike | None = None) -> str | None:
        """See :func:`latest_checkpoint`; defaults to this checkpointer's base path."""
        return latest_checkpoint(self.base_path if path is None else path)

    def load(self, path: str | os.PathLike, abstract_state: Any, **kwargs: Any) -> Any:
        """See :func:`load`. Waits for an in-flight save first."""
        self.wait()
        return load(path, abstract_state, **kwargs)

    def read_metadata(self, path: str | os.PathLike) -> dict:
        return read_metadata(path)

    # ---------------------------------------------------------------- internals (process 0)

    def _write_marker(self, path: str, marker: dict) -> None:
        atomic.atomic_write_json(atomic.join(path, MARKER), marker, fault="checkpoint.marker_tmp_written")

    def _reuse_existing(self, path: str, marker: dict, kind: Kind, loss: float | None, update_best: bool) -> None:
        changed = []
        if kind == "permanent" and marker.get("kind") != "permanent":
            marker["kind"] = "permanent"
            changed.append("promoted to permanent")
        if loss is not None and marker.get("eval_loss") is None:
            marker["eval_loss"] = loss
            changed.append("eval_loss recorded")
        if changed:
            self._write_marker(path, marker)
        if update_best:
            self._materialize_best(path, marker)
            changed.append("copied to best/")
        removed = self._prune(marker["step"], path)
        if removed:
            changed.append(f"removed {', '.join(removed)}")
        _log("checkpoint: step %d already complete at %s%s", marker["step"], path,
             f" ({', '.join(changed)})" if changed else "")

    def _materialize_best(self, step_path: str, marker: dict) -> None:
        """Make ``<base>/best`` a complete copy of ``step_path`` (marker last)."""
        best = atomic.join(self.base_path, BEST_DIR)
        best_marker = dict(marker, best_of=_basename(step_path))
        if atomic.is_local(best):
            for name, _ in _listdir(self.base_path):  # leftovers of an interrupted swap
                if name.startswith((".best.tmp-", ".best.old-")):
                    _rmtree(atomic.join(self.base_path, name))
            token = uuid.uuid4().hex[:8]
            tmp = atomic.join(self.base_path, f".best.tmp-{token}")
            old = atomic.join(self.base_path, f".best.old-{token}")
            _copy_tree(step_path, tmp, exclude=(MARKER,))
            self._write_marker(tmp, best_marker)
            if os.path.lexists(best):
                os.rename(best, old)
            os.rename(tmp, best)
            _rmtree(old)
        else:  # object stores have no directory renames: replace in place, marker last
            _delete_checkpoint(best)
            _copy_tree(step_path, best, exclude=(MARKER,))
            self._write_marker(best, best_marker)

    def _prune(self, new_step: int, new_path: str) -> list[str]:
        """Delete older temporary/incomplete dirs and permanent ones beyond keep_last."""
        removed: list[str] = []
        permanent: list[tuple[int, str]] = []
        for name, is_dir in _listdir(self.base_path):
            m = _STEP_RE.match(name)
            if not is_dir or not m:
                continue
            step, child = int(m.group(1)), atomic.join(self.base_path, name)
            if child == new_path:
                continue
            marker = _read_marker(child)
            if marker is None or marker.get("kind") == "temporary":
                if step < new_step:
                    _delete_checkpoint(child)
                    removed.append(f"{name} ({'incomplete' if marker is None else 'temporary'})")
            else:
                permanent.append((step, child))
        if self.config.keep_last is not None:
            new_marker = _read_marker(new_path)
            n_keep = self.config.keep_last - (1 if new_marker and new_marker.get("kind") == "permanent" else 0)
            permanent.sort()
            doomed = permanent[: max(len(permanent) - max(n_keep, 0), 0)]
            for _step, child in doomed:
                _delete_checkpoint(child)
                removed.append(f"{_basename(child)} (permanent, keep_last={self.config.keep_last})")
        return removed
