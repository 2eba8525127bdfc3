"""One filesystem interface for local paths and fsspec URLs (``gs://``, ``s3://``, ``memory://``, ...).

Callers pass any path or URL and never branch on where it lives; the one place that does is
here. Plain paths and ``file://`` URLs go through :mod:`os` (hard links, ``scandir``, ``flock``),
everything else through fsspec. Writes that readers must never see half-done are in
:mod:`lm_pipeline.atomic`, which builds on this module.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Literal, overload

import fsspec

PathLike = str | os.PathLike

__all__ = [
    "AppendFile",
    "PathLike",
    "access_problem",
    "access_problems",
    "as_local",
    "basename",
    "connect_problem",
    "copy_tree",
    "download_tree",
    "exclusive_lock",
    "exists",
    "file_sizes",
    "forget_copy",
    "get_fs",
    "is_local",
    "is_local_dir",
    "join",
    "kvstore_spec",
    "listdir",
    "local_copy",
    "local_path",
    "makedirs",
    "move",
    "norm",
    "open_binary",
    "parent",
    "put",
    "read_bytes",
    "read_text",
    "remove",
    "resolve",
    "rmtree",
    "scheme",
    "sha256_of",
    "staged",
    "upload_tree",
]

_MISSING = (FileNotFoundError, NotADirectoryError, IsADirectoryError)


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


def is_local_dir(path: PathLike) -> bool:
    """Whether ``path`` is an existing directory on this machine (a local path or ``file://`` URL,
    ``~`` expanded); False for other URLs, which are not looked up (a hub id is never one)."""
    local = as_local(path)
    return local is not None and os.path.isdir(local)


def scheme(path: PathLike) -> str:
    """The URL scheme of ``path``: ``""`` for a plain path, ``"file"`` for a ``file://`` URL, else
    its filesystem's protocol (``"s3"``, ``"gs"``, ``"memory"``, ...; the last one of a chained URL
    such as ``simplecache::s3://...``)."""
    text = os.fspath(path)
    return text.split("://", 1)[0].split("::")[-1] if "://" in text else ""


def norm(path: PathLike) -> str:
    """A canonical spelling: the absolute path of a local path, a URL without trailing ``/``."""
    return local_path(path) if is_local(path) else os.fspath(path).rstrip("/")


#: The package behind each object-store scheme (fsspec names it in its own error otherwise).
_FS_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
                "abfss": "adlfs", "hf": "huggingface_hub"}


def url_problem(url: PathLike) -> str | None:
    """Why ``url`` cannot be opened on this machine (an unknown scheme, or its filesystem package
    missing), in one line with what to do; None when it can (local paths always can). Reads
    nothing: credentials and buckets are checked when the URL is first used."""
    text = os.fspath(url)
    if is_local(text):
        return None
    protocol = scheme(text)
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError:
        package = _FS_PACKAGES.get(protocol, f"the fsspec implementation of {protocol}://")
        return f"{text}: reading {protocol}:// needs the {package} package, which is not installed (pip install {package})"
    except ValueError:
        return (f"{text}: unknown URL scheme {protocol!r}; use a local path or a URL fsspec knows "
                "(s3://, gs://, az://, https://, memory://, ...)")
    return None


def _bucket_of(url: str) -> str:
    return url.split("://", 1)[1].split("/", 1)[0]


def access_problem(url: PathLike) -> str | None:
    """Why ``url`` cannot be used (unknown scheme, missing package, missing bucket, no or refused
    credentials), in one line with what to do; None when its bucket can be listed. Local paths
    always can. Lists the bucket once (one request): called before any compute."""
    problem = url_problem(url)
    if problem or is_local(url):
        return problem
    text = os.fspath(url)
    bucket = _bucket_of(text)
    protocol = text.split("://", 1)[0]
    endpoint = _endpoint(protocol)
    if endpoint is not None:  # one quick connection first: offline, the clients retry for a minute
        why = connect_problem(endpoint)
        if why is not None:
            return (f"{text}: cannot reach {endpoint} ({why}); check this machine's network connection (and proxy "
                    "settings), or use a local path")
    try:
        with _quiet(*_CLIENT_LOGGERS):  # the one line below says it; not the clients' retry tracebacks
            store, _ = get_fs(text)
            store.ls(bucket)
    except FileNotFoundError:
        return f"{text}: the bucket {bucket!r} does not exist (or is not visible with these credentials); create it or fix the URL"
    except PermissionError as e:
        first = (str(e).splitlines() or [""])[0][:200]
        return (f"{text}: access to bucket {bucket!r} refused ({first}); check the credentials the standard "
                f"{_CHAIN.get(protocol, 'credential chain')} finds")
    except Exception as e:  # noqa: BLE001 - botocore's NoCredentialsError, google.auth's DefaultCredentialsError, ...
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        kind = type(e).__name__
        if "credential" in kind.lower() or "credential" in first.lower():
            return (f"{text}: no usable credentials ({kind}: {first}); provide them through the standard "
                    f"{_CHAIN.get(protocol, 'credential chain')}")
        return f"{text}: cannot be listed ({kind}: {first})"
    return None


def access_problems(urls: Iterable[PathLike]) -> dict[str, str]:
    """``url -> problem`` (as :func:`access_problem` words it, naming that URL) for each of ``urls``
    that cannot be used; the others are left out. Each bucket is listed once, however many of the
    URLs lie in it; local paths are never checked."""
    buckets: dict[str, str | None] = {}
    out: dict[str, str] = {}
    for url in urls:
        text = os.fspath(url)
        if is_local(text) or text in out:
            continue
        problem = url_problem(text)
        if problem is None:
            bucket = f"{text.split('://', 1)[0]}://{_bucket_of(text)}"
            if bucket not in buckets:
                buckets[bucket] = access_problem(bucket)
            problem = buckets[bucket] and buckets[bucket].replace(bucket, text, 1)
        if problem:
            out[text] = problem
    return out


#: Loggers of the object-store clients: their retries log whole tracebacks.
_CLIENT_LOGGERS = ("gcsfs", "s3fs", "aiobotocore", "botocore", "google.auth", "urllib3")

#: Seconds a reachability check waits for a connection (name lookup included).
CONNECT_TIMEOUT_S = 3.0


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """Only CRITICAL records of the loggers ``names`` during the block."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _endpoint(protocol: str) -> str | None:
    """The endpoint the client of ``protocol`` talks to (from the standard variables), or None when not
    known here. Computed without creating the client: a GCS client looks for credentials first,
    which takes a quarter of a minute offline."""
    if protocol in ("gs", "gcs"):
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
        if emulator and emulator != "default":
            return emulator if emulator.startswith(("http://", "https://")) else f"http://{emulator}"
        return "https://storage.googleapis.com"
    if protocol in ("s3", "s3a"):
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        return s3_endpoint() or (f"https://s3.{region}.amazonaws.com" if region else "https://s3.amazonaws.com")
    return None


def _proxy_for(url: str) -> str | None:
    """The proxy the standard variables route ``url`` through, if any."""
    import urllib.request

    host = url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
    if urllib.request.proxy_bypass_environment(host):
        return None
    return urllib.request.getproxies_environment().get(url.split("://", 1)[0].lower())


def connect_problem(url: str, timeout: float = CONNECT_TIMEOUT_S) -> str | None:
    """Why no TCP connection to the host of the http(s) ``url`` (or to the proxy the standard
    variables name for it) opens within ``timeout`` seconds, name lookup included: one line
    ('cannot resolve storage.googleapis.com: ...'); None when one does. Sends nothing."""
    import socket
    import threading
    import urllib.parse

    target = _proxy_for(url) or url
    parts = urllib.parse.urlsplit(target if "://" in target else f"http://{target}")
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return f"invalid port in {target}"
    where = f"{host}:{port}" + (f" (the proxy for {url})" if target != url else "")
    result: list[str | None] = []

    def attempt() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                result.append(None)
        except socket.gaierror as e:
            result.append(f"cannot resolve {host}: {e.strerror or e}")
        except TimeoutError:
            result.append(f"no answer from {where} within {timeout:g} s")
        except OSError as e:
            result.append(f"cannot connect to {where}: {e.strerror or e}")

    thread = threading.Thread(target=attempt, name="lm-pipeline-connect-check", daemon=True)
    thread.start()
    thread.join(timeout)  # a name lookup has no timeout of its own
    if not result:
        return f"no answer from {where} within {timeout:g} s"
    return result[0]


#: Where each object store's client looks for credentials (named in error messages).
_CHAIN = {
    "s3": "AWS chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE and ~/.aws, instance or pod role)",
    "s3a": "AWS chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE and ~/.aws, instance or pod role)",
    "gs": "Google chain (GOOGLE_APPLICATION_CREDENTIALS, gcloud auth application-default login, the metadata server)",
    "gcs": "Google chain (GOOGLE_APPLICATION_CREDENTIALS, gcloud auth application-default login, the metadata server)",
}


def s3_endpoint() -> str | None:
    """The S3 endpoint of an S3-compatible store, from the standard variables (``AWS_ENDPOINT_URL_S3``,
    then ``AWS_ENDPOINT_URL``; s3fs's ``FSSPEC_S3_ENDPOINT_URL`` too); None: AWS itself."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "FSSPEC_S3_ENDPOINT_URL"):
        value = os.environ.get(name)
        if value:
            return value
    return None


def kvstore_spec(url: PathLike) -> dict | str:
    """A TensorStore kvstore spec for a directory ``url`` (ending in ``/``).

    Local paths: the ``file`` driver. ``s3://``: the ``s3`` driver with the endpoint and region of
    the standard AWS variables (TensorStore does not read the endpoint variables itself);
    credentials stay with TensorStore's own AWS chain and never enter the spec. Other URLs are
    passed as TensorStore URLs (``gs://`` reads Google's application default credentials)."""
    text = os.fspath(url)
    if is_local(text):
        return {"driver": "file", "path": local_path(text).rstrip("/") + "/"}
    protocol, rest = text.split("://", 1)
    if protocol in ("s3", "s3a"):
        bucket, _, path = rest.partition("/")
        spec: dict = {"driver": "s3", "bucket": bucket, "path": path.strip("/") + "/" if path.strip("/") else ""}
        endpoint = s3_endpoint()
        if endpoint:
            spec["endpoint"] = endpoint
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            spec["aws_region"] = region
        return spec
    if protocol == "gcs":
        text = "gs://" + rest
    return text.rstrip("/") + "/"


def download_tree(url: PathLike, local_dir: str) -> str:
    """Copy the directory ``url`` (local or object store) into the local ``local_dir``; returns it."""
    os.makedirs(local_dir, exist_ok=True)
    if is_local(url):
        shutil.copytree(local_path(url), local_dir, dirs_exist_ok=True)
        return local_dir
    store, inner = get_fs(url)
    inner = inner.rstrip("/")
    _fresh(store, inner)
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


def _fresh(store: fsspec.AbstractFileSystem, inner: str) -> None:
    """Forget what fsspec's listing cache holds about ``inner`` (and its parents): another process
    may have written it since, and s3fs answers reads of a path in a cached listing from the cache
    (a manifest written elsewhere would stay invisible)."""
    with contextlib.suppress(Exception):
        store.invalidate_cache(inner)


def exists(path: PathLike) -> bool:
    if is_local(path):
        return os.path.exists(local_path(path))
    fs, inner = get_fs(path)
    _fresh(fs, inner)
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
        _fresh(fs, inner)
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
        _fresh(fs, inner)  # another process may have written since the last listing
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
    _fresh(store, inner)
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


def _downloads_dir() -> str:
    """Where :func:`local_copy` keeps downloads unless told otherwise."""
    return os.path.join(tempfile.gettempdir(), "lm-pipeline-downloads")


def _copy_key(url: str) -> str:
    """The name of a download of ``url``: its last component and a hash of the URL and of the
    sizes and versions (ETag, else modification time) its listing shows, so a rewritten object
    gets a new copy."""
    store, inner = get_fs(url)
    inner = inner.rstrip("/")
    _fresh(store, inner)
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
        _fresh(store, inner)
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
