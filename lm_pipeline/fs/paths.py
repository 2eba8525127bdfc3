"""Where a path lives and path arithmetic: the one place that tells a local path (a plain path or a
``file://`` URL, handled by :mod:`os`) from an fsspec URL (``gs://``, ``s3://``, ``memory://``, ...)."""

from __future__ import annotations

import contextlib
import os

import fsspec

PathLike = str | os.PathLike


def is_local(path: PathLike) -> bool:
    """True for plain filesystem paths and ``file://`` URLs."""
    text = os.fspath(path)
    return "://" not in text or text.startswith("file://")


def local_path(path: PathLike) -> str:
    """The absolute filesystem path of a local path or ``file://`` URL."""
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://") :]
    return os.path.abspath(os.path.expanduser(text))


def as_local(path: PathLike) -> str | None:
    """The absolute filesystem path of ``path`` if it is local, else None (for tools that only
    write local files)."""
    return local_path(path) if is_local(path) else None


def scheme(path: PathLike) -> str:
    """The URL scheme of ``path``: ``""`` for a plain path, ``"file"`` for a ``file://`` URL, else
    its filesystem's protocol (``"s3"``, ``"gs"``, ``"memory"``, ...; the last one of a chained URL
    such as ``simplecache::s3://...``)."""
    text = os.fspath(path)
    return text.split("://", 1)[0].split("::")[-1] if "://" in text else ""


def norm(path: PathLike) -> str:
    """A canonical spelling: the absolute path of a local path, a URL without trailing ``/``."""
    return local_path(path) if is_local(path) else os.fspath(path).rstrip("/")


def get_fs(path: PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for ``path`` and the path in that filesystem's terms."""
    if is_local(path):
        return fsspec.filesystem("file"), local_path(path)
    return fsspec.core.url_to_fs(os.fspath(path))


def join(base: PathLike, *parts: str) -> str:
    """Join path components; URLs always use ``/``."""
    text = os.fspath(base)
    if is_local(text):
        return os.path.join(local_path(text), *parts)
    out = text.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out


def basename(path: PathLike) -> str:
    """The last component of a path or URL (a trailing ``/`` ignored on URLs)."""
    text = os.fspath(path)
    return os.path.basename(text) if is_local(text) else text.rstrip("/").rsplit("/", 1)[-1]


def parent(path: PathLike) -> str:
    """The directory holding ``path``: the absolute parent of a local path, a URL without its last
    component (a trailing ``/`` ignored). The top (``/``, ``s3://bucket``) is its own parent."""
    text = os.fspath(path)
    if is_local(text):
        return os.path.dirname(local_path(text))
    protocol, rest = text.rstrip("/").split("://", 1)
    return f"{protocol}://{rest.rsplit('/', 1)[0]}" if "/" in rest else f"{protocol}://{rest}"


def resolve(base_dir: PathLike, ref: str) -> str:
    """``ref`` read from the directory ``base_dir`` (a local path or URL), as a reference in a file
    is: a URL stays what it is, anything else is joined to ``base_dir`` (:func:`join`: an absolute
    path stays absolute under a local ``base_dir``)."""
    return ref if scheme(ref) else join(base_dir, ref)


def forget_listing(store: fsspec.AbstractFileSystem, inner: str) -> None:
    """Forget what fsspec's listing cache holds about ``inner`` (and its parents): another process
    may have written it since, and s3fs answers reads of a path in a cached listing from the cache
    (a manifest written elsewhere would stay invisible)."""
    with contextlib.suppress(Exception):
        store.invalidate_cache(inner)
