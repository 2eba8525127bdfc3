"""Atomic file writes on local paths and fsspec URLs.

A reader never sees a half-written file: either the old content (or nothing) or the new one.

* Local paths (and ``file://`` URLs): write a hidden temporary file next to the target (same
  filesystem), flush and fsync it, then ``os.replace`` it onto the target and fsync the directory.
* Object stores (``gs://``, ``s3://``, ``memory://``, ...): the content is buffered and uploaded
  with a single object PUT; object stores make an object visible only once the upload completed.

All helpers create missing parent directories. Only the standard library and fsspec are used.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from typing import IO, Any

import fsspec

from lm_pipeline.faultpoints import faultpoint

PathLike = str | os.PathLike

__all__ = [
    "PathLike",
    "atomic_open",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "get_fs",
    "remove_stale_temps",
    "temp_sibling",
    "is_local",
    "join",
    "local_path",
]


def _as_str(path: PathLike) -> str:
    return os.fspath(path)


def is_local(path: PathLike) -> bool:
    """True for plain filesystem paths and ``file://`` URLs."""
    text = _as_str(path)
    return "://" not in text or text.startswith("file://")


def local_path(path: PathLike) -> str:
    """The absolute filesystem path of a local path or ``file://`` URL."""
    text = _as_str(path)
    if text.startswith("file://"):
        text = text[len("file://") :]
    return os.path.abspath(os.path.expanduser(text))


def get_fs(path: PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for ``path`` and the path in that filesystem's terms."""
    if is_local(path):
        return fsspec.filesystem("file"), local_path(path)
    fs, inner = fsspec.core.url_to_fs(_as_str(path))
    return fs, inner


def join(base: PathLike, *parts: str) -> str:
    """Join path components; URLs always use ``/``."""
    text = _as_str(base)
    if is_local(text):
        return os.path.join(local_path(text), *parts)
    out = text.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out


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


def remove_stale_temps(target: str) -> None:
    """Remove :func:`temp_sibling` leftovers of ``target`` (files or directories) that writers
    killed mid-write left behind. Call it only while no other writer of ``target`` runs."""
    pattern = os.path.join(glob.escape(os.path.dirname(target) or "."), f".{glob.escape(os.path.basename(target))}.tmp-*")
    for stale in glob.glob(pattern):
        if os.path.isdir(stale) and not os.path.islink(stale):
            shutil.rmtree(stale, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(stale)


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
    fs, inner = get_fs(path)
    parent = inner.rsplit("/", 1)[0] if "/" in inner else ""
    if parent:
        with contextlib.suppress(Exception):  # object stores have no real directories
            fs.makedirs(parent, exist_ok=True)
    if fault:
        faultpoint(fault)
    fs.pipe_file(inner, data)


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
    if is_local(path):
        target = local_path(path)
        directory = os.path.dirname(target) or "."
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(target)}.tmp-{uuid.uuid4().hex[:12]}")
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
        return
    buf: IO[Any] = io.StringIO() if text else io.BytesIO()
    yield buf
    data = buf.getvalue()
    atomic_write_bytes(path, data.encode(enc) if text else data)
