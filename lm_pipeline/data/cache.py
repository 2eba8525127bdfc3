"""The token cache: documents tokenized once, stored in TensorStore, independent of ``seq_len``.

On-disk layout of a cache directory (a local path or any TensorStore kvstore URL such as
``gs://bucket/cache/`` or ``memory://name/``)::

    <cache>/
      ledger.json        committed state (JSON, replaced atomically after every shard group)
      COMPLETE           completion marker, written last and atomically
      tokens/            zarr3 uint32 [num_tokens]     all documents' token ids, concatenated
      doc_offsets/       zarr3 int64  [num_docs + 1]   document i = tokens[offsets[i]:offsets[i+1]]
      doc_bytes/         zarr3 int64  [num_docs]       UTF-8 bytes of document i's text (for bits/byte)
      packing/<strategy>-<seq_len>/   layouts derived by :mod:`lm_pipeline.data.packing`
      .build.lock        (local caches) held by the one running builder

Every document ends with exactly one EOS; what else the tokenizer adds (BOS, ...) is detected
rather than assumed (see :mod:`lm_pipeline.data.encode`).

Building and committing. Shards are tokenized in parallel by worker processes and committed in
order; each shard's ids, offsets and byte counts are written to the arrays *past* the committed
counts (space no reader reads: readers bound every read by the ledger's committed counts) as soon
as it is tokenized, and once a *group* of ``shard_group_size`` shards is written the ledger is
atomically replaced with the new counts. That replacement is the commit: a reader sees whole groups or nothing. A build
killed at any point resumes from the last committed group; the uncommitted tail is overwritten
with identical bytes, so a resumed build ends byte-identical to an uninterrupted one. The output
never depends on the number of workers (commit order is the shard order). When all shards are
committed the ledger is marked complete and then ``COMPLETE`` is written (temp file + rename).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import sys
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import tensorstore as ts

from lm_pipeline.data.encode import (
    TOKEN_DTYPE,
    DocumentEncoder,
    EncodedShard,
    Shard,
    TokenizerInfo,
    tokenizer_fingerprint,
    tokenizer_info,
    worker_encode,
    worker_init,
)
from lm_pipeline.faultpoints import faultpoint

__all__ = [
    "FORMAT_VERSION",
    "CacheError",
    "CacheIncompleteError",
    "CacheMismatchError",
    "CacheNotFoundError",
    "TokenCache",
    "build_cache",
    "open_cache",
    "tokenizer_fingerprint",
]

log = logging.getLogger(__name__)

FORMAT = "lm_pipeline.token_cache"
FORMAT_VERSION = 1
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
_KNOWN_ENTRIES = {LEDGER, COMPLETE, LOCK, PACKING_DIR, *ARRAYS}

# One context for the process: shares the chunk cache and makes memory:// stores visible across
# opens. Cached chunks are revalidated on every read, so readers of a growing cache stay fresh.
_CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 64 << 20}})


class CacheError(RuntimeError):
    """A token cache problem."""


class CacheNotFoundError(CacheError, FileNotFoundError):
    """No cache (no ledger) at the given location."""


class CacheMismatchError(CacheError):
    """The cache was built with another tokenizer, other settings, shards or format version."""


class CacheIncompleteError(CacheError):
    """The cache's build has not finished (no completion marker)."""


# --- storage ---------------------------------------------------------------------------------


def _dumps(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")


class _Root:
    """A cache location: a local directory (plain files, fsync'ed renames) or a kvstore URL."""

    def __init__(self, location: str | os.PathLike):
        text = os.fspath(location)
        self.local = "://" not in text or text.startswith("file://")
        if self.local:
            self.path = os.path.abspath(text[len("file://") :] if text.startswith("file://") else text)
            self._kv = None
        else:
            self.path = text.rstrip("/")
            self._kv = ts.KvStore.open(self.path + "/", context=_CONTEXT).result()

    def __str__(self) -> str:
        return self.path

    def join(self, *parts: str) -> str:
        return os.path.join(self.path, *parts) if self.local else "/".join([self.path, *parts])

    def sub(self, *parts: str) -> _Root:
        return _Root(self.join(*parts))

    def kvstore(self, name: str) -> Any:
        """TensorStore kvstore spec for the sub-directory ``name``."""
        if self.local:
            return {"driver": "file", "path": os.path.join(self.path, name) + "/"}
        return f"{self.path}/{name}/"

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
        """Exclusive builder lock (local caches only; object stores rely on the caller)."""
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


def _array_spec(root: _Root, name: str) -> dict[str, Any]:
    return {"driver": "zarr3", "kvstore": root.kvstore(name)}


def _create_array(root: _Root, name: str) -> ts.TensorStore:
    dtype, outer, inner = ARRAYS[name]
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
    return ts.open(spec, create=True, delete_existing=True, context=_CONTEXT).result()


def _open_array(root: _Root, name: str) -> ts.TensorStore:
    return ts.open(_array_spec(root, name), open=True, context=_CONTEXT).result()


def _resized(arr: ts.TensorStore, n: int) -> ts.TensorStore:
    if arr.shape[0] == n:
        return arr
    return arr.resize(exclusive_max=[n]).result()


# --- ledger ----------------------------------------------------------------------------------


def _plan(shards: Sequence[Shard]) -> dict[str, Any]:
    h = hashlib.sha256()
    for s in shards:
        h.update(json.dumps([s.name, s.fingerprint]).encode("utf-8"))
        h.update(b"\n")
    return {"num_shards": len(shards), "fingerprint": h.hexdigest()}


def _new_ledger(info: TokenizerInfo, plan: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tokenizer": {"fingerprint": info.fingerprint},
        "settings": info.settings(),
        "plan": plan,
        "committed": {"shards": 0, "docs": 0, "tokens": 0, "bytes": 0},
        "shards": [],
        "complete": False,
    }


def _format_problem(ledger: Mapping[str, Any]) -> str | None:
    if ledger.get("format") != FORMAT:
        return f"not a token cache ledger (format {ledger.get('format')!r})"
    if ledger.get("format_version") != FORMAT_VERSION:
        return (
            f"cache format version {ledger.get('format_version')!r} but this code reads version "
            f"{FORMAT_VERSION}; rebuild the cache"
        )
    return None


def _settings_problem(ledger: Mapping[str, Any], settings: Mapping[str, Any]) -> str | None:
    have = ledger.get("settings", {})
    diffs = [f"{k}: cache has {have.get(k)!r}, expected {v!r}" for k, v in settings.items() if have.get(k) != v]
    return "settings differ (" + "; ".join(diffs) + ")" if diffs else None


def _incompatibility(ledger: Mapping[str, Any], info: TokenizerInfo, plan: Mapping[str, Any]) -> str | None:
    problem = _format_problem(ledger)
    if problem:
        return problem
    have = ledger["tokenizer"]["fingerprint"]
    if have != info.fingerprint:
        return f"built with tokenizer {have[:16]}…, not {info.fingerprint[:16]}… ({info.path})"
    problem = _settings_problem(ledger, info.settings())
    if problem:
        return problem
    if ledger["plan"] != plan:
        return (
            f"built from other shards ({ledger['plan']['num_shards']} shards, plan {ledger['plan']['fingerprint'][:16]}…; "
            f"now {plan['num_shards']} shards, plan {plan['fingerprint'][:16]}…)"
        )
    return None


# --- fault injection (tests) -----------------------------------------------------------------


# --- building --------------------------------------------------------------------------------


def _resolve_workers(num_workers: int) -> int:
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0 (0 = all cores), got {num_workers}")
    if num_workers:
        return num_workers
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _ordered_map(
    fn: Callable[[Any], Any], items: Sequence[Any], workers: int, init: Callable[..., None], initargs: tuple
) -> Iterator[Any]:
    """``map(fn, items)`` over a process pool, in order, with a bounded window of work in flight."""
    ctx = multiprocessing.get_context("spawn")  # never fork a process that runs TensorStore threads
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=init, initargs=initargs) as pool:
        window = max(2 * workers, 2)
        pending: deque = deque()
        it = iter(items)
        try:
            for item in it:
                pending.append(pool.submit(fn, item))
                if len(pending) >= window:
                    break
            while pending:
                result = pending.popleft().result()
                for item in it:
                    pending.append(pool.submit(fn, item))
                    break
                yield result
        finally:
            for f in pending:
                f.cancel()


class _Committer:
    """Appends shards to the arrays past the committed counts; commits groups through the ledger.

    Each shard's arrays are written as soon as it is tokenized (so the builder holds at most the
    in-flight shards in memory, not a whole group); readers see them only after :meth:`commit`.
    """

    def __init__(self, root: _Root, ledger: dict[str, Any], arrays: dict[str, ts.TensorStore]):
        self.root = root
        self.ledger = ledger
        self.arrays = arrays
        c = ledger["committed"]
        self.docs, self.tokens, self.bytes = c["docs"], c["tokens"], c["bytes"]
        self.staged: list[dict[str, Any]] = []

    def append(self, shard: Shard, part: EncodedShard) -> None:
        d0, t0 = self.docs, self.tokens
        n, m = len(part.doc_lengths), len(part.tokens)
        d1, t1 = d0 + n, t0 + m
        a = self.arrays
        a["tokens"] = _resized(a["tokens"], t1)
        a["doc_offsets"] = _resized(a["doc_offsets"], d1 + 1)
        a["doc_bytes"] = _resized(a["doc_bytes"], d1)
        futures = []
        if m:
            futures.append(a["tokens"][t0:t1].write(part.tokens.astype(TOKEN_DTYPE, copy=False)))
        if n:
            futures.append(a["doc_offsets"][d0 + 1 : d1 + 1].write(t0 + np.cumsum(part.doc_lengths)))
            futures.append(a["doc_bytes"][d0:d1].write(part.doc_bytes))
        for f in futures:
            f.result()
        b = int(part.doc_bytes.sum())
        self.staged.append({"name": shard.name, "fingerprint": shard.fingerprint, "doc_start": d0, "docs": n,
                            "token_start": t0, "tokens": m, "bytes": b})
        self.docs, self.tokens, self.bytes = d1, t1, self.bytes + b

    def commit(self) -> None:
        """Make the appended shards visible: one atomic ledger replacement."""
        faultpoint("token_cache.before_commit")  # shards appended to the arrays, ledger not yet replaced
        self.ledger["shards"].extend(self.staged)
        self.ledger["committed"] = {
            "shards": self.ledger["committed"]["shards"] + len(self.staged),
            "docs": self.docs,
            "tokens": self.tokens,
            "bytes": self.bytes,
        }
        self.staged = []
        self.root.write_atomic(LEDGER, _dumps(self.ledger))  # the commit point
        faultpoint("token_cache.after_commit")


def _clear(root: _Root) -> None:
    """Remove a cache's files: the marker first, then the ledger, then the data."""
    unknown = root.entries() - _KNOWN_ENTRIES
    unknown = {e for e in unknown if not e.startswith(".")}
    if unknown:
        raise CacheError(
            f"{root}: refusing to delete a directory that holds other files too: {sorted(unknown)[:5]}"
        )
    root.delete(COMPLETE)
    root.delete(LEDGER)
    for name in (PACKING_DIR, *ARRAYS):
        root.delete_tree(name)


def build_cache(
    out_dir: str | os.PathLike,
    shards: Iterable[Shard],
    tokenizer_dir: str | os.PathLike,
    *,
    num_workers: int = 0,
    shard_group_size: int = 8,
    progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenize ``shards`` into a token cache at ``out_dir``; return the final ledger.

    Args:
        out_dir: a local directory or a TensorStore kvstore URL (``gs://...``, ``memory://...``).
        shards: picklable objects with ``.name``, ``.fingerprint`` and ``.iter_texts()``; their
            order is the documents' order in the cache.
        tokenizer_dir: directory with ``tokenizer.json`` and ``tokenizer_config.json`` (eos_token).
        num_workers: tokenizer processes; 0 = all cores; 1 = tokenize in this process. Workers
            are started with ``spawn`` (never ``fork``: TensorStore runs threads), so a script
            that builds with several workers needs the ``if __name__ == "__main__":`` guard.
        shard_group_size: shards per commit (the unit of resumption).
        progress: show a progress bar.
        overwrite: replace an existing cache that was built from other inputs (by default that
            raises :class:`CacheMismatchError`).

    Idempotent: a complete cache with the same inputs is returned untouched; an interrupted one
    is resumed from its last committed group.
    """
    shards = list(shards)
    if shard_group_size < 1:
        raise ValueError(f"shard_group_size must be >= 1, got {shard_group_size}")
    workers = _resolve_workers(num_workers)
    tokenizer_dir = os.fspath(tokenizer_dir)
    root = _Root(out_dir)
    info = tokenizer_info(tokenizer_dir)
    plan = _plan(shards)
    with root.build_lock():
        ledger = root.read_json(LEDGER)
        if ledger is not None:
            problem = _incompatibility(ledger, info, plan)
            if problem and not overwrite:
                raise CacheMismatchError(
                    f"{root}: the existing token cache does not match this build: {problem}. "
                    "Use another directory or pass overwrite=True."
                )
            if problem:
                log.warning("%s: replacing the token cache (%s)", root, problem)
                ledger = None
            elif ledger["complete"] and root.exists(COMPLETE):
                return ledger
        if ledger is None:
            _clear(root)  # also removes leftovers of a build that died before its first ledger
            arrays = {name: _create_array(root, name) for name in ARRAYS}
            arrays["doc_offsets"] = _resized(arrays["doc_offsets"], 1)
            arrays["doc_offsets"][0:1].write(np.zeros(1, np.int64)).result()
            ledger = _new_ledger(info, plan)
            root.write_atomic(LEDGER, _dumps(ledger))
        else:
            arrays = {name: _open_array(root, name) for name in ARRAYS}
        _build(root, ledger, arrays, shards, tokenizer_dir, info, workers, shard_group_size, progress)
        _finalize(root, ledger, arrays)
    return ledger


def _build(
    root: _Root,
    ledger: dict[str, Any],
    arrays: dict[str, ts.TensorStore],
    shards: list[Shard],
    tokenizer_dir: str,
    info: TokenizerInfo,
    workers: int,
    group_size: int,
    progress: bool,
) -> None:
    done = ledger["committed"]["shards"]
    todo = shards[done:]
    if not todo:
        return
    if done:
        log.info("%s: resuming the token cache build at shard %d of %d", root, done, len(shards))
    workers = min(workers, len(todo))
    if workers <= 1:
        encoder = DocumentEncoder(tokenizer_dir, info)
        results: Iterator[EncodedShard] = map(encoder.encode_shard, todo)
    else:
        results = _ordered_map(worker_encode, todo, workers, worker_init, (tokenizer_dir, info))
    committer = _Committer(root, ledger, arrays)
    from tqdm.auto import tqdm

    bar = tqdm(total=len(shards), initial=done, desc="tokenize", unit="shard", disable=None if progress else True,
               dynamic_ncols=True, file=sys.stderr)
    try:
        for i, part in enumerate(results):
            committer.append(todo[i], part)
            if len(committer.staged) == group_size or i + 1 == len(todo):
                n = len(committer.staged)
                committer.commit()
                bar.update(n)
                bar.set_postfix(tokens=ledger["committed"]["tokens"], refresh=False)
    finally:
        bar.close()
        if hasattr(results, "close"):
            results.close()  # shuts the pool down on errors too


def _finalize(root: _Root, ledger: dict[str, Any], arrays: dict[str, ts.TensorStore]) -> None:
    c = ledger["committed"]
    # Exact final shapes (an interrupted run may have left a longer, uncommitted tail).
    arrays["tokens"] = _resized(arrays["tokens"], c["tokens"])
    arrays["doc_offsets"] = _resized(arrays["doc_offsets"], c["docs"] + 1)
    arrays["doc_bytes"] = _resized(arrays["doc_bytes"], c["docs"])
    ledger["complete"] = True
    data = _dumps(ledger)
    root.write_atomic(LEDGER, data)
    faultpoint("token_cache.before_complete")  # ledger says complete, the marker is not there yet
    marker = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "ledger_sha256": hashlib.sha256(data).hexdigest(),
        **c,
    }
    root.write_atomic(COMPLETE, _dumps(marker))  # last, atomically


# --- reading ---------------------------------------------------------------------------------


class TokenCache:
    """A read-only view of a token cache, bounded by the ledger's committed counts.

    For a cache still being built, the view is a snapshot: it never reads past the rows that
    were committed when it was opened; :meth:`refresh` takes a newer snapshot.
    """

    def __init__(self, location: str | os.PathLike, ledger: dict[str, Any], marker: dict[str, Any] | None,
                 ledger_bytes: bytes):
        self.location = os.fspath(location)
        self._root = _Root(location)
        self.ledger = ledger
        self.marker = marker
        self._ledger_sha = hashlib.sha256(ledger_bytes).hexdigest()
        self._arrays: dict[str, ts.TensorStore] = {}
        self._offsets: np.ndarray | None = None
        self._doc_bytes: np.ndarray | None = None

    def __repr__(self) -> str:
        state = "complete" if self.complete else "partial"
        return f"TokenCache({self.location!r}, {state}, docs={self.num_docs}, tokens={self.num_tokens})"

    # identity and sizes
    @property
    def complete(self) -> bool:
        return self.marker is not None

    @property
    def identity(self) -> str:
        """sha256 of the ledger: changes whenever the cache's content could."""
        return self._ledger_sha

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.ledger["tokenizer"]["fingerprint"]

    @property
    def settings(self) -> dict[str, Any]:
        return self.ledger["settings"]

    @property
    def eos_id(self) -> int:
        return int(self.settings["eos_id"])

    @property
    def num_docs(self) -> int:
        return int(self.ledger["committed"]["docs"])

    @property
    def num_tokens(self) -> int:
        return int(self.ledger["committed"]["tokens"])

    @property
    def num_bytes(self) -> int:
        """UTF-8 bytes of all committed documents' text."""
        return int(self.ledger["committed"]["bytes"])

    @property
    def shards(self) -> list[dict[str, Any]]:
        return self.ledger["shards"]

    def root(self) -> _Root:
        return self._root

    # arrays
    def array(self, name: str) -> ts.TensorStore:
        """The TensorStore array ``name``, restricted to the committed extent."""
        arr = self._arrays.get(name)
        if arr is None:
            n = {"tokens": self.num_tokens, "doc_offsets": self.num_docs + 1, "doc_bytes": self.num_docs}[name]
            arr = _open_array(self._root, name)[:n]
            self._arrays[name] = arr
        return arr

    @property
    def tokens(self) -> ts.TensorStore:
        return self.array("tokens")

    @property
    def doc_offsets(self) -> np.ndarray:
        """int64 [num_docs + 1]; document i is ``tokens[offsets[i]:offsets[i + 1]]``."""
        if self._offsets is None:
            self._offsets = self.array("doc_offsets").read().result()
        return self._offsets

    @property
    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.doc_offsets)

    @property
    def doc_bytes(self) -> np.ndarray:
        """int64 [num_docs]: UTF-8 byte count of each document's text."""
        if self._doc_bytes is None:
            self._doc_bytes = self.array("doc_bytes").read().result()
        return self._doc_bytes

    def read_tokens(self, start: int, stop: int) -> np.ndarray:
        return self.tokens[start:stop].read().result()

    def doc(self, i: int) -> np.ndarray:
        off = self.doc_offsets
        return self.read_tokens(int(off[i]), int(off[i + 1]))

    def refresh(self) -> TokenCache:
        """A new snapshot (for a cache that is still being built)."""
        return open_cache(self.location, require_complete=False)


def open_cache(
    cache_dir: str | os.PathLike,
    expected_tokenizer_fingerprint: str | None = None,
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    shards: Sequence[Shard] | None = None,
    expected_settings: Mapping[str, Any] | None = None,
    require_complete: bool = True,
) -> TokenCache:
    """Open a token cache, checking it against what the caller expects.

    Raises :class:`CacheMismatchError` (never a warning) if the ledger's format version, tokenizer
    fingerprint (``expected_tokenizer_fingerprint``, or that of ``tokenizer_dir``), tokenization
    settings (those of ``tokenizer_dir``, and ``expected_settings``) or shard list (``shards``)
    disagree; :class:`CacheIncompleteError` if the build has not finished and ``require_complete``;
    :class:`CacheNotFoundError` if there is no cache.
    """
    root = _Root(cache_dir)
    for _ in range(5):  # the builder may finalize between our two reads: re-read on a mismatch
        data = root.read(LEDGER)
        if data is None:
            raise CacheNotFoundError(f"{root}: no token cache here ({LEDGER} is missing)")
        marker = root.read_json(COMPLETE)
        if marker is None or marker.get("ledger_sha256") == hashlib.sha256(data).hexdigest():
            break
    ledger = json.loads(data)
    where = f"token cache {root}"
    problem = _format_problem(ledger)
    if problem:
        raise CacheMismatchError(f"{where}: {problem}")
    have = ledger["tokenizer"]["fingerprint"]
    if expected_tokenizer_fingerprint is not None and have != expected_tokenizer_fingerprint:
        raise CacheMismatchError(
            f"{where} was built with tokenizer {have[:16]}…, but tokenizer {expected_tokenizer_fingerprint[:16]}… "
            "was expected; rebuild the cache for this tokenizer"
        )
    if tokenizer_dir is not None:
        info = tokenizer_info(os.fspath(tokenizer_dir))
        if info.fingerprint != have:
            raise CacheMismatchError(
                f"{where} was built with tokenizer {have[:16]}…, but {tokenizer_dir} is {info.fingerprint[:16]}…; "
                "rebuild the cache for this tokenizer"
            )
        problem = _settings_problem(ledger, info.settings())
        if problem:
            raise CacheMismatchError(f"{where}: tokenization {problem}")
    if expected_settings:
        problem = _settings_problem(ledger, expected_settings)
        if problem:
            raise CacheMismatchError(f"{where}: {problem}")
    if shards is not None:
        plan = _plan(list(shards))
        if ledger["plan"] != plan:
            raise CacheMismatchError(
                f"{where} was built from other shards ({ledger['plan']['num_shards']} shards) than given "
                f"({plan['num_shards']} shards)"
            )
    if marker is not None and marker.get("ledger_sha256") != hashlib.sha256(data).hexdigest():
        raise CacheError(f"{where}: {COMPLETE} does not match {LEDGER}; the cache is corrupt, rebuild it")
    if marker is None and require_complete:
        c = ledger["committed"]
        raise CacheIncompleteError(
            f"{where} is incomplete ({c['shards']} of {ledger['plan']['num_shards']} shards committed); "
            "finish it with build_cache (it resumes) or open with require_complete=False"
        )
    return TokenCache(cache_dir, ledger, marker, data)
