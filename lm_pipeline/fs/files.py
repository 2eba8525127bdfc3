"""One file or directory at a time, local or at a URL: read, hash, list, exists, make, remove;
appending to a text file (:class:`AppendFile`); an exclusive lock (:func:`exclusive_lock`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import IO, Literal, overload

import fsspec

from lm_pipeline.fs.paths import (
    PathLike,
    as_local,
    basename,
    forget_listing,
    get_fs,
    is_local,
    local_path,
    norm,
)

_MISSING = (FileNotFoundError, NotADirectoryError, IsADirectoryError)


def is_local_dir(path: PathLike) -> bool:
    """Whether ``path`` is an existing directory on this machine (a local path or ``file://`` URL,
    ``~`` expanded); False for other URLs, which are not looked up (a hub id is never one)."""
    local = as_local(path)
    return local is not None and os.path.isdir(local)


def exists(path: PathLike) -> bool:
    if is_local(path):
        return os.path.exists(local_path(path))
    fs, inner = get_fs(path)
    forget_listing(fs, inner)
    return fs.exists(inner)


@overload
def read_bytes(path: PathLike, *, missing_ok: Literal[True] = ...) -> bytes | None: ...
@overload
def read_bytes(path: PathLike, *, missing_ok: Literal[False]) -> bytes: ...
def read_bytes(path: PathLike, *, missing_ok: bool = True) -> bytes | None:
    """The content of a file, or None if it does not exist (or is a directory); with
    ``missing_ok=False`` a missing file raises FileNotFoundError naming it instead."""
    try:
        if is_local(path):
            with open(local_path(path), "rb") as f:
                return f.read()
        fs, inner = get_fs(path)
        forget_listing(fs, inner)
        return fs.cat_file(inner)
    except _MISSING:
        if not missing_ok:
            raise FileNotFoundError(errno.ENOENT, "no such file", os.fspath(path)) from None
        return None


def sha256_of(path: PathLike) -> str:
    """The hex sha256 of the bytes of the file ``path`` (local or URL), read in 1 MiB blocks."""
    sha = hashlib.sha256()
    with open_binary(path) as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def open_binary(path: PathLike) -> IO[bytes]:
    """A binary file object reading ``path`` from the start, for streaming large files."""
    if is_local(path):
        return open(local_path(path), "rb")  # noqa: SIM115 - the caller closes it
    return fsspec.open(os.fspath(path), "rb").open()


def read_text(path: PathLike, encoding: str = "utf-8") -> str | None:
    """The decoded content of a file, or None if it does not exist. Raises UnicodeDecodeError."""
    data = read_bytes(path)
    return None if data is None else data.decode(encoding)


def listdir(path: PathLike) -> list[tuple[str, bool]]:
    """(name, is_dir) of the children of ``path``; empty if it does not exist."""
    if is_local(path):
        try:
            with os.scandir(local_path(path)) as it:
                return [(e.name, e.is_dir()) for e in it]
        except (FileNotFoundError, NotADirectoryError):
            return []
    fs, inner = get_fs(path)
    try:
        forget_listing(fs, inner)  # another process may have written since the last listing
        entries = fs.ls(inner, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for e in entries:
        name = e["name"].rstrip("/").rsplit("/", 1)[-1]
        if name and e["name"].rstrip("/") != inner.rstrip("/"):
            out.append((name, e.get("type") == "directory"))
    return out


def file_sizes(path: PathLike) -> dict[str, int]:
    """``relative name -> size in bytes`` of every file under the directory ``path``, the names
    ``/``-separated and sorted; empty if it does not exist. Object stores: one listing."""
    if is_local(path):
        root = local_path(path)
        found = {}
        for parent_dir, _, names in os.walk(root):
            for name in names:
                full = os.path.join(parent_dir, name)
                with contextlib.suppress(FileNotFoundError):  # deleted while listed
                    found[os.path.relpath(full, root).replace(os.sep, "/")] = os.path.getsize(full)
        return dict(sorted(found.items()))
    store, inner = get_fs(path)
    inner = inner.rstrip("/")
    forget_listing(store, inner)
    try:
        entries = store.find(inner, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    out = {}
    for name, info in sorted(entries.items()):
        rel = name[len(inner):].lstrip("/")
        if rel and info.get("type", "file") != "directory":
            out[rel] = int(info.get("size") or 0)
    return out


def makedirs(path: PathLike) -> None:
    """Create a directory and its parents (no error if it exists)."""
    if is_local(path):
        os.makedirs(local_path(path), exist_ok=True)
        return
    fs, inner = get_fs(path)
    fs.makedirs(inner, exist_ok=True)


def remove(path: PathLike) -> None:
    """Delete one file; nothing if it does not exist."""
    if is_local(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(local_path(path))
        return
    fs, inner = get_fs(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(inner)


def rmtree(path: PathLike) -> None:
    """Delete a file or a whole directory (a symlink itself, not its target); nothing if absent."""
    if is_local(path):
        target = local_path(path)
        if os.path.islink(target) or os.path.isfile(target):
            os.unlink(target)
        elif os.path.isdir(target):
            shutil.rmtree(target)
        return
    fs, inner = get_fs(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(inner, recursive=True)


class AppendFile:
    """A text file opened for appending, at a local path or a URL.

    Local: the file itself, opened in append mode. Object stores cannot append: lines go to a
    local staging copy (starting from the object's current content) that :meth:`publish`
    uploads whole. :meth:`close` publishes a last time.
    """

    def __init__(self, path: PathLike, encoding: str = "utf-8"):
        self.path = norm(path)
        self._staging_dir: str | None = None
        if is_local(self.path):
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            local = self.path
        else:
            self._staging_dir = tempfile.mkdtemp(prefix="lm-pipeline-append-")
            local = os.path.join(self._staging_dir, basename(self.path))
            with open(local, "w", encoding=encoding) as f:
                f.write(read_text(self.path, encoding) or "")
        self._file: IO[str] = open(local, "a", encoding=encoding)  # noqa: SIM115 - closed in close()

    @property
    def closed(self) -> bool:
        return self._file.closed

    @property
    def local_file(self) -> str:
        """The local file the text goes to: the file itself, or its staging copy (for a writer
        that needs a real file, such as a :class:`logging.FileHandler`)."""
        return self._file.name

    def write(self, text: str) -> None:
        """Append ``text`` and flush it to the operating system."""
        self._file.write(text)
        self._file.flush()

    def publish(self) -> None:
        """Make what was written visible at the URL (one upload); nothing to do for local files."""
        if self._staging_dir is None:
            return
        self._file.flush()
        fs, inner = get_fs(self.path)
        fs.put_file(self._file.name, inner)

    def close(self) -> None:
        """Flush to disk, publish, close; idempotent."""
        if self._file.closed:
            return
        self._file.flush()
        with contextlib.suppress(OSError):
            os.fsync(self._file.fileno())
        self.publish()
        self._file.close()
        if self._staging_dir is not None:
            shutil.rmtree(self._staging_dir, ignore_errors=True)


@contextlib.contextmanager
def exclusive_lock(path: PathLike, timeout: float | None = None) -> Iterator[None]:
    """Hold an exclusive lock on the lock file ``path`` for the block (timeout in seconds).

    Local: ``fcntl.flock``, which the kernel releases if the process dies. Object stores have
    no locks: a no-op there. Writers on object stores rely on the commit rules instead (every
    artifact and checkpoint is marked complete by one object written last, and what is written
    under an address is a function of that address), so a second concurrent writer repeats the
    work but never makes a partial artifact look complete; run one builder per address. Raises TimeoutError if another process holds it past ``timeout``.
    """
    if not is_local(path):
        yield
        return
    target = local_path(path)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o644)
    t0 = time.monotonic()
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if timeout is not None and time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"{target} is locked by another process") from None
                time.sleep(0.1)
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
