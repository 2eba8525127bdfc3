"""Atomic writes on local paths and fsspec URLs: a reader sees the old content (or nothing) or
the new content, never a half-written file.

* Local paths (and ``file://`` URLs): write a hidden temporary file next to the target (same
  filesystem), flush and fsync it, then ``os.replace`` it onto the target and fsync the directory.
* Object stores (``gs://``, ``s3://``, ``memory://``, ...): the content is buffered and uploaded
  with a single object PUT; object stores make an object visible only once the upload completed.

All writers create missing parent directories. Non-atomic operations (reads, listings,
removal, copies) are in :mod:`lm_pipeline.fs`.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from typing import IO, Any

from lm_pipeline import fs
from lm_pipeline.faultpoints import faultpoint

# Path helpers live in lm_pipeline.fs; re-exported here for callers not yet moved to it.
from lm_pipeline.fs import PathLike, get_fs, is_local, join, local_path

__all__ = [
    "PathLike",
    "atomic_open",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "get_fs",
    "is_local",
    "join",
    "local_path",
    "remove_stale_temps",
    "remove_stale_temps_under",
    "replace_dir",
    "temp_sibling",
]


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms that cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_sibling(target: str) -> str:
    """A fresh temporary name beside local ``target`` (``.<name>.tmp-<random>``), for a file or
    directory that is written whole and then renamed onto ``target``."""
    return os.path.join(os.path.dirname(target) or ".", f".{os.path.basename(target)}.tmp-{uuid.uuid4().hex[:12]}")


def remove_stale_temps(target: PathLike) -> None:
    """Remove :func:`temp_sibling` leftovers of ``target`` (files or directories) that writers
    killed mid-write left behind. Call it only while no other writer of ``target`` runs.
    Nothing to do on object stores (their writes leave no temporary objects)."""
    if not is_local(target):
        return
    target = local_path(target)
    pattern = os.path.join(glob.escape(os.path.dirname(target) or "."), f".{glob.escape(os.path.basename(target))}.tmp-*")
    for stale in glob.glob(pattern):
        if os.path.isdir(stale) and not os.path.islink(stale):
            shutil.rmtree(stale, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(stale)


def remove_stale_temps_under(directory: PathLike) -> list[str]:
    """Remove every :func:`temp_sibling` leftover (``.<name>.tmp-<hex>``) anywhere under local
    ``directory``; returns what was removed. Call it only while no writer of that tree runs
    (e.g. holding the artifact's build lock, after the payload is written)."""
    if not is_local(directory):
        return []
    root = local_path(directory)
    pattern = re.compile(r"^\..+\.tmp-[0-9a-f]{12}$")
    removed = []
    for parent, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            if pattern.match(name):
                stale = os.path.join(parent, name)
                if os.path.isdir(stale) and not os.path.islink(stale):
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(stale)
                removed.append(stale)
        dirs[:] = [d for d in dirs if not pattern.match(d)]
    return removed


def _local_write(target: str, data: bytes, fault: str | None = None) -> None:
    directory = os.path.dirname(target) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = temp_sibling(target)
    try:
        with open(tmp, "xb") as f:  # "x": never clobber; permissions follow the umask
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if fault:
            faultpoint(fault)  # the temporary file is complete, the target not yet replaced
        os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None and e.errno is not None:  # name the file
            raise OSError(e.errno, e.strerror, target) from e
        raise
    _fsync_dir(directory)


def atomic_write_bytes(path: PathLike, data: bytes, *, fault: str | None = None) -> None:
    """Write ``data`` to ``path`` atomically (local: temp + rename; object stores: one PUT).

    ``fault``: a :mod:`lm_pipeline.faultpoints` name passed between the temporary file and the
    rename (tests crash there: inside the write)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"atomic_write_bytes expects bytes, got {type(data).__name__}")
    data = bytes(data)
    if is_local(path):
        _local_write(local_path(path), data, fault)
        return
    store, inner = get_fs(path)
    parent = inner.rsplit("/", 1)[0] if "/" in inner else ""
    if parent:
        with contextlib.suppress(Exception):  # object stores have no real directories
            store.makedirs(parent, exist_ok=True)
    if fault:
        faultpoint(fault)
    store.pipe_file(inner, data)


def atomic_write_text(path: PathLike, text: str, encoding: str = "utf-8", *, fault: str | None = None) -> None:
    """Write ``text`` to ``path`` atomically."""
    atomic_write_bytes(path, text.encode(encoding), fault=fault)


def atomic_write_json(path: PathLike, obj: Any, *, indent: int | None = 2, sort_keys: bool = False,
                      fault: str | None = None) -> None:
    """Serialize ``obj`` as JSON (strict: no NaN/Infinity) and write it atomically, newline-terminated."""
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, allow_nan=False)
    atomic_write_text(path, text + "\n", fault=fault)


@contextlib.contextmanager
def atomic_open(path: PathLike, mode: str = "wb", encoding: str | None = None) -> Iterator[IO[Any]]:
    """Open ``path`` for writing; the content becomes visible only if the block exits normally.

    ``mode`` is ``"wb"`` or ``"w"`` (text, default encoding utf-8). On an exception nothing is
    written and the target keeps its previous content.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open supports modes 'w' and 'wb', got {mode!r}")
    text = mode == "w"
    enc = encoding or "utf-8"
    if not is_local(path):  # buffered, then one PUT
        buf: IO[Any] = io.StringIO() if text else io.BytesIO()
        yield buf
        data = buf.getvalue()
        atomic_write_bytes(path, data.encode(enc) if text else data)
        return
    target = local_path(path)
    directory = os.path.dirname(target) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = temp_sibling(target)
    f = open(tmp, "x" if text else "xb", **({"encoding": enc} if text else {}))  # noqa: SIM115
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, target)
    except BaseException:
        f.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


@contextlib.contextmanager
def replace_dir(target: PathLike, *, clear: Callable[[str], None] = fs.rmtree) -> Iterator[str]:
    """Build a directory at the yielded path; when the block exits normally it replaces ``target``.

    Local: the yielded path is a temporary sibling that is renamed onto ``target`` (the previous
    ``target`` renamed away, then deleted), so readers see the old directory or the new one, and
    leftovers of a killed writer are removed first. Object stores have no directory renames:
    ``target`` is emptied with ``clear`` and the block writes in place; the caller marks it
    complete last (e.g. a marker file) so a partial directory is recognisable.
    """
    if not is_local(target):
        clear(os.fspath(target))
        yield os.fspath(target)
        return
    final = local_path(target)
    remove_stale_temps(final)
    tmp = temp_sibling(final)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = temp_sibling(final)
    if os.path.lexists(final):
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final) or ".")
    fs.rmtree(old)
