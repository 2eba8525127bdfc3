"""Whole directories between places: download, upload (a completion marker last), copy, move; a
local copy of a URL for readers that need this machine's filesystem (:func:`local_copy`), and a
local directory for writers that need one, uploaded when written (:func:`staged`)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator

from lm_pipeline.fs.files import listdir, remove, rmtree
from lm_pipeline.fs.paths import (
    PathLike,
    as_local,
    basename,
    forget_listing,
    get_fs,
    is_local,
    join,
    local_path,
    norm,
)


def download_tree(url: PathLike, local_dir: str) -> str:
    """Copy the directory ``url`` (local or object store) into the local ``local_dir``; returns it."""
    os.makedirs(local_dir, exist_ok=True)
    if is_local(url):
        shutil.copytree(local_path(url), local_dir, dirs_exist_ok=True)
        return local_dir
    store, inner = get_fs(url)
    inner = inner.rstrip("/")
    forget_listing(store, inner)
    for name in store.find(inner):
        rel = name[len(inner):].lstrip("/")
        if not rel:
            continue
        target = os.path.join(local_dir, *rel.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        store.get_file(name, target)
    return local_dir


def upload_tree(local_dir: str, url: PathLike, *, last: tuple[str, ...] = ()) -> None:
    """Copy every file under the local ``local_dir`` to the directory ``url``; the relative names in
    ``last`` are copied after all the others (a completion marker: a reader that sees it sees the
    rest). Local targets are copied with :func:`shutil.copy2`."""
    files = []
    for parent, dirs, names in os.walk(local_dir):
        dirs.sort()
        for name in sorted(names):
            rel = os.path.relpath(os.path.join(parent, name), local_dir).replace(os.sep, "/")
            files.append(rel)
    ordered = [f for f in files if f not in last] + [f for f in last if f in files]
    for rel in ordered:
        src = os.path.join(local_dir, *rel.split("/"))
        put(src, join(url, *rel.split("/")))


def put(source: PathLike, target: PathLike) -> None:
    """Copy a local file or directory ``source`` to ``target`` (a local path or URL)."""
    source = os.fspath(source)
    if is_local(target):
        dest = local_path(target)
        if os.path.isdir(source):
            shutil.copytree(source, dest, dirs_exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copy2(source, dest)
        return
    if os.path.isdir(source):  # file by file: fsspec's recursive put nests into an existing target
        upload_tree(source, target)
        return
    fs, inner = get_fs(target)
    fs.put_file(source, inner)


def copy_tree(src: PathLike, dst: PathLike, *, exclude: tuple[str, ...] = ()) -> None:
    """Copy directory ``src`` into ``dst``, skipping the top-level names in ``exclude``.

    Local to local: hard links where the filesystem allows (no data copied), else copies.
    Otherwise server-side copies within one store."""
    if is_local(src) and is_local(dst):
        _link_tree(local_path(src), local_path(dst), exclude)
        return
    fs, src_inner = get_fs(src)
    _, dst_inner = get_fs(dst)
    for name, is_dir in listdir(src):
        if name not in exclude:
            fs.copy(f"{src_inner}/{name}", f"{dst_inner}/{name}", recursive=is_dir)


def move(src: PathLike, dst: PathLike, *, first: tuple[str, ...] = ()) -> None:
    """Move the directory ``src`` to ``dst`` (not existing yet) within one filesystem.

    Local: one rename (``dst``'s parent made if missing), so ``src`` is never seen half moved.
    Object stores have no renames: the objects are copied, then deleted from ``src``, the
    relative names in ``first`` before the rest (a completion marker: a partly deleted ``src``
    never looks complete)."""
    if is_local(src) and is_local(dst):
        target = local_path(dst)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(local_path(src), target)
        return
    copy_tree(src, dst)
    for name in first:
        remove(join(src, name))
    rmtree(src)


def _link_tree(src: str, dst: str, exclude: tuple[str, ...]) -> None:
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
            except OSError:  # another filesystem, or one without hard links
                shutil.copy2(s, t)


def _downloads_dir() -> str:
    """Where :func:`local_copy` keeps downloads unless told otherwise."""
    return os.path.join(tempfile.gettempdir(), "lm-pipeline-downloads")


def _copy_key(url: str) -> str:
    """The name of a download of ``url``: its last component and a hash of the URL and of the
    sizes and versions (ETag, else modification time) its listing shows, so a rewritten object
    gets a new copy."""
    store, inner = get_fs(url)
    inner = inner.rstrip("/")
    forget_listing(store, inner)
    listing = [(name[len(inner):], info.get("size"),
                next((info[k] for k in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "updated", "created")
                      if info.get(k) is not None), None))
               for name, info in sorted(store.find(inner, detail=True).items())]
    if not listing:
        raise FileNotFoundError(errno.ENOENT, "no such file or directory", url)
    ident = json.dumps([url, listing], default=str)
    return f"{basename(url)}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def local_copy(path: PathLike, *, cache_dir: str | None = None, key: str | Callable[[], str] | None = None) -> str:
    """A local path holding what the file or directory ``path`` holds, for readers that need the
    local filesystem: ``path`` itself when it is local (nothing read, nothing copied); for a URL a
    download under ``cache_dir`` (default ``<tmp>/lm-pipeline-downloads``) named ``key`` (called only for
    URLs; default: from the URL and its listing, see :func:`_copy_key`). Downloaded once: to a
    temporary name, renamed when whole, so a copy found is complete and is reused.
    FileNotFoundError if nothing is at ``path``."""
    local = as_local(path)
    if local is not None:
        return local
    url = norm(path)
    root = cache_dir or _downloads_dir()
    target = os.path.join(root, key() if callable(key) else key or _copy_key(url))
    if os.path.exists(target):
        return target
    os.makedirs(root, exist_ok=True)
    tmp = f"{target}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        store, inner = get_fs(url)
        forget_listing(store, inner)
        if store.isdir(inner):
            download_tree(url, tmp)
        else:
            store.get_file(inner, tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished the same copy first
            if not os.path.exists(target):
                raise
    finally:
        rmtree(tmp)
    return target


def forget_copy(path: PathLike, *, cache_dir: str | None = None, key: str | Callable[[], str] | None = None) -> None:
    """Delete the download :func:`local_copy` made of the URL ``path`` (same ``cache_dir`` and
    ``key``), e.g. one found damaged: the next :func:`local_copy` downloads again. Nothing for a
    local path, whose copy is itself."""
    if as_local(path) is not None:
        return
    name = key() if callable(key) else key or _copy_key(norm(path))
    rmtree(os.path.join(cache_dir or _downloads_dir(), name))


@contextlib.contextmanager
def staged(target: PathLike, *, last: tuple[str, ...] = (), clear: bool = False) -> Iterator[str]:
    """A local directory to write the directory ``target`` into, for writers that need a real one.

    Local ``target``: its own path, written in place (the block creates it as it would without
    staging); nothing is copied. A URL: a fresh temporary directory, uploaded to ``target`` when
    the block exits normally (the relative names in ``last``, e.g. a completion marker, after all
    the others), and deleted in any case; nothing is uploaded after an exception. ``clear``: the
    upload first deletes what is under ``target`` (an interrupted attempt's files), the names in
    ``last`` before the rest, so no old marker ever stands over partial contents."""
    local = as_local(target)
    if local is not None:
        yield local
        return
    url = norm(target)
    tmp = tempfile.mkdtemp(prefix="lm-pipeline-staged-")
    try:
        yield tmp
        if clear:
            for name in last:
                remove(join(url, name))
            rmtree(url)
        upload_tree(tmp, url, last=last)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
