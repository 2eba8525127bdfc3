"""Where a token cache lies: its location (local directory or TensorStore kvstore URL), the names
of its files, atomic file replacement, the builder lock, and its zarr3 arrays."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import tensorstore as ts

from lm_pipeline.data.cache.errors import CacheError
from lm_pipeline.fs import as_local, kvstore_spec

__all__ = [
    "ARRAYS",
    "COMPLETE",
    "KNOWN_ENTRIES",
    "LEDGER",
    "LOCK",
    "LOSS_MASK",
    "PACKING_DIR",
    "CacheRoot",
    "create_array",
    "dumps_json",
    "open_array",
    "resized",
]

# Entries of a cache directory (the layout is drawn in the package docstring).
LEDGER = "ledger.json"
COMPLETE = "COMPLETE"
LOCK = ".build.lock"
PACKING_DIR = "packing"
# name -> (dtype, shard (outer chunk) length, inner chunk length). Sharded zarr3: few files,
# and random reads fetch only the 16-32 KiB inner chunks they touch.
ARRAYS: dict[str, tuple[str, int, int]] = {
    "tokens": ("uint32", 1 << 20, 1 << 12),
    "doc_offsets": ("int64", 1 << 17, 1 << 12),
    "doc_bytes": ("int64", 1 << 17, 1 << 12),
}
# A chat source's cache also holds the per-token loss mask (1 = trained on), beside the tokens.
LOSS_MASK = "loss_mask"
MASK_ARRAY: tuple[str, int, int] = ("uint8", 1 << 20, 1 << 12)
# What a cache directory may hold: clearing refuses a directory with anything else in it.
KNOWN_ENTRIES = {LEDGER, COMPLETE, LOCK, PACKING_DIR, LOSS_MASK, *ARRAYS}

# One context for the process: shares the chunk cache and makes memory:// stores visible across
# opens. Cached chunks are revalidated on every read, so readers of a growing cache stay fresh.
_CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 64 << 20}})
_ENV_CREDENTIALS_CONTEXT: ts.Context | None = None


def _context() -> ts.Context:
    """The process's context; with AWS credentials in the environment, a child of it whose S3
    credentials come from those variables only. TensorStore's default AWS chain also reads
    ``~/.aws/config`` and ``~/.aws/credentials`` and logs an error line for each one missing, on
    every S3 access (in every process: Ray workers too), although the credentials it then uses are
    the same variables. Credentials never enter a spec either way."""
    global _ENV_CREDENTIALS_CONTEXT
    if not (os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")):
        return _CONTEXT
    if _ENV_CREDENTIALS_CONTEXT is None:
        _ENV_CREDENTIALS_CONTEXT = ts.Context({"aws_credentials": {"type": "environment"}}, _CONTEXT)
    return _ENV_CREDENTIALS_CONTEXT


def dumps_json(obj: Any) -> bytes:
    """The cache's JSON encoding (sorted keys, one-space indent, no NaN), as UTF-8 bytes."""
    return (json.dumps(obj, indent=1, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")


class CacheRoot:
    """A cache location: a local directory (plain files, fsync'ed renames) or a kvstore URL."""

    def __init__(self, location: str | os.PathLike):
        local = as_local(location)  # plain files where the filesystem is this machine's (mmap, flock, fsync)
        self.local = local is not None
        if local is not None:
            self.path = local
            self._kv = None
        else:
            self.path = os.fspath(location).rstrip("/")
            self._kv = ts.KvStore.open(kvstore_spec(self.path), context=_context()).result()

    def __str__(self) -> str:
        return self.path

    def join(self, *parts: str) -> str:
        return os.path.join(self.path, *parts) if self.local else "/".join([self.path, *parts])

    def sub(self, *parts: str) -> CacheRoot:
        return CacheRoot(self.join(*parts))

    def kvstore(self, name: str) -> Any:
        """TensorStore kvstore spec for the sub-directory ``name``."""
        return kvstore_spec(self.join(name))

    def read(self, key: str) -> bytes | None:
        if self.local:
            try:
                with open(os.path.join(self.path, key), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None
        r = self._kv.read(key).result()
        return r.value if r.state == "value" else None

    def read_json(self, key: str) -> Any:
        data = self.read(key)
        return None if data is None else json.loads(data)

    def write_atomic(self, key: str, data: bytes) -> None:
        """Readers see the old content or the new one, never a mix (temp + rename / one PUT)."""
        if not self.local:
            self._kv.write(key, data).result()
            return
        target = os.path.join(self.path, key)
        directory = os.path.dirname(target)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(target)}.tmp-{uuid.uuid4().hex[:12]}")
        try:
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with contextlib.suppress(OSError):
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def exists(self, key: str) -> bool:
        if self.local:
            return os.path.exists(os.path.join(self.path, key))
        return self.read(key) is not None

    def delete(self, key: str) -> None:
        if self.local:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.path, key))
        else:
            self._kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()

    def delete_tree(self, name: str) -> None:
        if self.local:
            target = os.path.join(self.path, name)
            if os.path.isdir(target):
                shutil.rmtree(target)
            else:
                self.delete(name)
        else:
            self._kv.delete_range(ts.KvStore.KeyRange(name + "/", name + "0")).result()
            self.delete(name)

    def entries(self) -> set[str]:
        """Top-level names present (files and directories)."""
        if self.local:
            return set(os.listdir(self.path)) if os.path.isdir(self.path) else set()
        return {k.decode().split("/", 1)[0] for k in self._kv.list().result()}

    @contextlib.contextmanager
    def build_lock(self) -> Iterator[None]:
        """Exclusive builder lock (local caches only; on object stores the cache is built by the
        one builder of its store address, see :func:`lm_pipeline.fs.exclusive_lock`)."""
        if not self.local:
            yield
            return
        import fcntl

        os.makedirs(self.path, exist_ok=True)
        with open(os.path.join(self.path, LOCK), "a+b") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CacheError(f"{self.path}: another process is building this cache") from None
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _array_spec(root: CacheRoot, name: str) -> dict[str, Any]:
    return {"driver": "zarr3", "kvstore": root.kvstore(name)}


def create_array(root: CacheRoot, name: str) -> ts.TensorStore:
    """Create the empty array ``name`` (one of :data:`ARRAYS`, or the loss mask), replacing any existing one."""
    dtype, outer, inner = MASK_ARRAY if name == LOSS_MASK else ARRAYS[name]
    spec = _array_spec(root, name)
    spec["metadata"] = {
        "shape": [0],
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [outer]}},
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": [inner],
                    "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
                    "index_codecs": [
                        {"name": "bytes", "configuration": {"endian": "little"}},
                        {"name": "crc32c"},
                    ],
                },
            }
        ],
    }
    return ts.open(spec, create=True, delete_existing=True, context=_context()).result()


def open_array(root: CacheRoot, name: str) -> ts.TensorStore:
    """Open the existing array ``name``."""
    return ts.open(_array_spec(root, name), open=True, context=_context()).result()


def resized(arr: ts.TensorStore, n: int) -> ts.TensorStore:
    """``arr`` with length ``n`` (elements); the same handle when it already has it."""
    if arr.shape[0] == n:
        return arr
    return arr.resize(exclusive_max=[n]).result()

