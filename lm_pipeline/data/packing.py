"""Packing: how the token cache's documents become ``seq_len`` rows. Cheap, deterministic, stored.

A layout is derived per (strategy, seq_len) from the cache's document offsets alone and stored
beside the cache, so changing ``seq_len`` never re-tokenizes::

    <cache>/packing/<strategy>-<seq_len>/
      row_ptr.npy       int64 [rows + 1]
      piece_start.npy   int64 [pieces]
      piece_len.npy     int32 [pieces]
      layout.json       strategy, seq_len, counts, the cache identity it was derived from, each
                        file's sha256; written last (atomically), so it marks completion

On a local cache the arrays are memory-mapped when opened: a batch reads the pages of its rows,
and the loader's memory does not grow with the number of rows (on other stores they are read
whole). Deriving a ``greedy`` layout is vectorised but for the next-fit scan, which walks the
pieces in bounded chunks.

Strategies:

``concat``
    Levanter style: all documents concatenated (each ends with EOS) and cut into ``seq_len``
    rows; the last partial row is dropped. Row ``r`` is ``tokens[r * T:(r + 1) * T]``; no arrays
    are stored, and batches carry ``segment_ids=None`` (plain causal attention).
``greedy``
    Whole documents in cache order, next-fit: a document goes into the current row if it fits,
    else it starts a new one.
``first_fit``
    Whole documents in cache order, each into the first (lowest-numbered) row with room for it
    (O(log rows) per document with a max segment tree); denser than ``greedy``.
``single``
    One document per row, padded (a chat source's ``pack: false``; not a ``data.packing`` value).

For ``greedy`` and ``first_fit`` a document longer than ``seq_len`` is first split into pieces
of ``seq_len`` tokens plus a remainder; every piece is placed exactly once. Rows are padded to
``seq_len``; segment ids number the pieces of a row 1, 2, ... (0 = padding) so attention never
crosses documents.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from lm_pipeline.data.cache import TokenCache

__all__ = [
    "STRATEGIES",
    "PackedLayout",
    "RowPlan",
    "build_packing",
    "open_packing",
    "pack_documents",
    "split_pieces",
]

Strategy = Literal["concat", "greedy", "first_fit", "single"]
STRATEGIES: tuple[str, ...] = ("concat", "greedy", "first_fit", "single")
LAYOUT_VERSION = 2  # 2: one .npy file per array (1: layout.npz)


def _check(strategy: str, seq_len: int) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown packing strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")


def _excl_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x), np.int64)
    np.cumsum(x[:-1], out=out[1:])
    return out


def split_pieces(doc_offsets: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Split every document into pieces of at most ``seq_len`` tokens, in document order.

    Returns (piece_start int64: offset in the concatenated tokens, piece_len int64).
    """
    doc_offsets = np.asarray(doc_offsets, np.int64)
    starts, lens = doc_offsets[:-1], np.diff(doc_offsets)
    counts = -(-lens // seq_len)  # ceil; an empty document has no pieces
    doc = np.repeat(np.arange(len(lens)), counts)
    k = np.arange(len(doc), dtype=np.int64) - np.repeat(_excl_cumsum(counts), counts)
    piece_start = starts[doc] + k * seq_len
    piece_len = np.minimum(seq_len, lens[doc] - k * seq_len)
    return piece_start, piece_len


_CHUNK = 1 << 16  # pieces per step of the next-fit scan: bounds its Python temporaries
_DOC_CHUNK = 1 << 16  # documents split into pieces at a time when deriving a greedy layout


def _next_fit(piece_len: np.ndarray, seq_len: int, free: int = 0) -> tuple[np.ndarray, int]:
    """Next fit over ``piece_len``, starting with ``free`` room in the current row: which pieces
    open a new row, and the room left. The scan is sequential; it walks the pieces in chunks so
    that only one chunk's lengths are ever Python ints."""
    opens = np.zeros(len(piece_len), bool)
    for c in range(0, len(piece_len), _CHUNK):
        lens = piece_len[c : c + _CHUNK].tolist()
        heads = []
        for i, n in enumerate(lens):
            if n > free:
                heads.append(i)
                free = seq_len
            free -= n
        opens[c + np.asarray(heads, np.int64)] = True
    return opens, free


def _greedy(doc_offsets: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """The greedy layout, derived a chunk of documents at a time: beyond the result (12 bytes a
    piece, 8 a row) it holds one chunk's temporaries. Pieces stay in document order."""
    counts = -(-np.diff(doc_offsets) // seq_len)
    num_pieces = int(counts.sum())
    del counts
    piece_start = np.empty(num_pieces, np.int64)
    piece_len = np.empty(num_pieces, np.int32)
    heads, free, p = [], 0, 0
    for c in range(0, len(doc_offsets) - 1, _DOC_CHUNK):
        start, length = split_pieces(doc_offsets[c : c + _DOC_CHUNK + 1], seq_len)
        m = len(start)
        piece_start[p : p + m] = start
        piece_len[p : p + m] = length
        opens, free = _next_fit(length, seq_len, free)
        heads.append(p + np.flatnonzero(opens))
        p += m
    heads.append(np.array([num_pieces], np.int64))
    row_ptr = np.concatenate(heads)
    del heads
    return {"row_ptr": row_ptr, "piece_start": piece_start, "piece_len": piece_len}


def _first_fit(lens: list[int], seq_len: int) -> np.ndarray:
    """Row of each piece under first fit. Leaves of a max segment tree hold each row's free space;
    unopened rows (all to the right of the opened ones) hold ``seq_len``, so the leftmost leaf with
    room is the first fitting open row, or else the next new row."""
    n = len(lens)
    size = 1 << max(1, (n - 1).bit_length())
    tree = [seq_len] * (2 * size)
    rows = [0] * n
    for i, need in enumerate(lens):
        j = 1
        while j < size:
            j <<= 1
            if tree[j] < need:
                j += 1
        rows[i] = j - size
        tree[j] -= need
        j >>= 1
        while j:
            a, b = tree[2 * j], tree[2 * j + 1]
            m = a if a > b else b
            if tree[j] == m:
                break
            tree[j] = m
            j >>= 1
    return np.asarray(rows, np.int64)


def pack_documents(doc_offsets: np.ndarray, seq_len: int, strategy: str) -> dict[str, np.ndarray]:
    """The layout arrays for documents given by ``doc_offsets`` (pure function; no I/O).

    Returns ``row_ptr`` int64 [rows + 1] and, row by row, ``piece_start`` int64 / ``piece_len``
    int32: row r holds pieces ``row_ptr[r]:row_ptr[r + 1]`` in order. For ``concat`` the arrays
    are empty and ``row_ptr`` is ``[0, rows]`` (the rows are implicit).
    """
    _check(strategy, seq_len)
    doc_offsets = np.asarray(doc_offsets, np.int64)
    if strategy == "concat":
        rows = int(doc_offsets[-1]) // seq_len
        return {"row_ptr": np.array([0, rows], np.int64), "piece_start": np.zeros(0, np.int64),
                "piece_len": np.zeros(0, np.int32)}
    if strategy == "greedy":
        return _greedy(doc_offsets, seq_len)
    piece_start, piece_len = split_pieces(doc_offsets, seq_len)
    if strategy == "single":  # every piece its own row
        return {"row_ptr": np.arange(len(piece_len) + 1, dtype=np.int64), "piece_start": piece_start,
                "piece_len": piece_len.astype(np.int32)}
    row_of = _first_fit(piece_len.tolist(), seq_len)
    order = np.argsort(row_of, kind="stable")  # by row, placement order within a row
    piece_start, piece_len = piece_start[order], piece_len[order]
    del order
    num_rows = int(row_of.max()) + 1 if len(row_of) else 0
    row_ptr = np.zeros(num_rows + 1, np.int64)
    np.cumsum(np.bincount(row_of, minlength=num_rows), out=row_ptr[1:])
    return {"row_ptr": row_ptr, "piece_start": piece_start, "piece_len": piece_len.astype(np.int32)}


@dataclass(frozen=True)
class RowPlan:
    """How to assemble a batch of rows from the concatenated token stream.

    Row ``i`` holds ``row_len[i]`` tokens from column 0, then padding. Its tokens are the
    concatenation of contiguous *runs* of the stream (adjacent pieces merged), listed row by
    row in ``run_start``/``run_len``; so the concatenation of all runs, in order, fills the
    rows' non-padding positions in row-major order. ``segment_ids``: int32 [B, T] or None.
    """

    run_start: np.ndarray
    run_len: np.ndarray
    row_len: np.ndarray
    segment_ids: np.ndarray | None


@dataclass(frozen=True)
class PackedLayout:
    """A (strategy, seq_len) layout over one token cache (see the module docstring)."""

    strategy: str
    seq_len: int
    row_ptr: np.ndarray
    piece_start: np.ndarray
    piece_len: np.ndarray
    cache_identity: str = ""

    @property
    def num_rows(self) -> int:
        return int(self.row_ptr[-1]) if self.strategy == "concat" else len(self.row_ptr) - 1

    def __len__(self) -> int:
        return self.num_rows

    @property
    def num_tokens(self) -> int:
        """Non-padding tokens in all rows."""
        if self.strategy == "concat":
            return self.num_rows * self.seq_len
        return int(self.piece_len.sum(dtype=np.int64))

    @property
    def fill(self) -> float:
        """Fraction of row positions holding tokens (1.0 for concat)."""
        return self.num_tokens / max(1, self.num_rows * self.seq_len)

    def row_pieces(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """(piece_start, piece_len) of one row."""
        if self.strategy == "concat":
            return np.array([row * self.seq_len], np.int64), np.array([self.seq_len], np.int32)
        a, b = self.row_ptr[row], self.row_ptr[row + 1]
        return self.piece_start[a:b], self.piece_len[a:b]

    def plan(self, rows: np.ndarray) -> RowPlan:
        """Read plan for a batch of rows (vectorized over pieces)."""
        rows = np.asarray(rows, np.int64)
        n, T = len(rows), self.seq_len
        if n and (rows.min() < 0 or rows.max() >= self.num_rows):
            raise IndexError(f"row index out of range [0, {self.num_rows})")
        if self.strategy == "concat":
            return RowPlan(rows * T, np.full(n, T, np.int64), np.full(n, T, np.int64), None)
        a, b = self.row_ptr[rows], self.row_ptr[rows + 1]
        cnt = b - a
        first = _excl_cumsum(cnt)  # index of each row's first piece among the gathered pieces
        total = int(cnt.sum())
        pidx = np.repeat(a - first, cnt) + np.arange(total, dtype=np.int64)
        plen = self.piece_len[pidx].astype(np.int64)
        pstart = self.piece_start[pidx]
        row_len = np.add.reduceat(plen, first) if total else np.zeros(n, np.int64)
        # A piece opens a new run unless it continues the previous piece of the same row.
        new_run = np.ones(total, bool)
        new_run[1:] = pstart[1:] != pstart[:-1] + plen[:-1]
        new_run[first] = True
        heads = np.flatnonzero(new_run)
        run_len = np.add.reduceat(plen, heads) if total else np.zeros(0, np.int64)
        rank = np.arange(total, dtype=np.int64) - np.repeat(first, cnt) + 1
        seg = np.zeros((n, T), np.int32)
        seg[np.arange(T) < row_len[:, None]] = np.repeat(rank, plen)
        return RowPlan(pstart[heads], run_len, row_len, seg)


def _layout_dir(strategy: str, seq_len: int) -> str:
    return f"{strategy}-{seq_len}"


_ARRAYS = ("row_ptr", "piece_start", "piece_len")


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _file_sha256(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except FileNotFoundError:
        return None


def _load(root: Any, key: str, sha256: str) -> np.ndarray | None:
    """One stored layout array, or None if missing or not the recorded bytes. Local files are
    memory-mapped (a batch reads only the pages of its rows); other stores are read whole."""
    if root.local:
        path = root.join(key)
        if _file_sha256(path) != sha256:
            return None
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
        return arr if arr.size else np.load(path, allow_pickle=False)
    blob = root.read(key)
    if blob is None or hashlib.sha256(blob).hexdigest() != sha256:
        return None
    return np.load(io.BytesIO(blob), allow_pickle=False)


def build_packing(cache: TokenCache, seq_len: int, strategy: str) -> PackedLayout:
    """Derive the layout from a complete cache and store it under ``<cache>/packing/``."""
    from lm_pipeline.data.cache import PACKING_DIR, CacheIncompleteError
    from lm_pipeline.data.cache.storage import dumps_json

    _check(strategy, seq_len)
    if not cache.complete:
        raise CacheIncompleteError(f"{cache.location}: packing needs a complete token cache")
    arrays = pack_documents(cache.doc_offsets, seq_len, strategy)
    layout = PackedLayout(strategy, seq_len, cache_identity=cache.identity, **arrays)
    d = _layout_dir(strategy, seq_len)
    root = cache.root()
    meta = {
        "layout_version": LAYOUT_VERSION,
        "strategy": strategy,
        "seq_len": seq_len,
        "num_rows": layout.num_rows,
        "num_pieces": len(layout.piece_len),
        "num_tokens": layout.num_tokens,
        "fill": round(layout.fill, 6),
        "cache_identity": cache.identity,
        "sha256": {},
    }
    # Concurrent builders (several hosts) write identical bytes; each file is replaced atomically.
    for name in _ARRAYS:
        key = f"{PACKING_DIR}/{d}/{name}.npy"
        if root.local:  # straight from the array to the file, no copy in memory
            from lm_pipeline.atomic import atomic_open

            with atomic_open(root.join(key)) as f:
                np.save(f, arrays[name], allow_pickle=False)
            meta["sha256"][name] = _file_sha256(root.join(key))
        else:
            blob = _npy(arrays[name])
            meta["sha256"][name] = hashlib.sha256(blob).hexdigest()
            root.write_atomic(key, blob)
            del blob
    root.write_atomic(f"{PACKING_DIR}/{d}/layout.json", dumps_json(meta))  # last: marks completion
    root.delete(f"{PACKING_DIR}/{d}/layout.npz")  # a version-1 layout's file
    if root.local:  # the stored arrays, memory-mapped, rather than the derivation's copies
        stored = _open_stored(cache, seq_len, strategy, meta)
        if stored is not None:
            return stored
    return layout


def _open_stored(cache: TokenCache, seq_len: int, strategy: str, meta: dict[str, Any]) -> PackedLayout | None:
    from lm_pipeline.data.cache import PACKING_DIR

    d = _layout_dir(strategy, seq_len)
    arrays = {}
    for name in _ARRAYS:
        arr = _load(cache.root(), f"{PACKING_DIR}/{d}/{name}.npy", meta.get("sha256", {}).get(name, ""))
        if arr is None:
            return None
        arrays[name] = arr
    return PackedLayout(strategy, seq_len, cache_identity=cache.identity, **arrays)


def open_packing(cache: TokenCache, seq_len: int, strategy: str, *, create: bool = True) -> PackedLayout:
    """The stored layout for (strategy, seq_len), built if missing or derived from another cache."""
    from lm_pipeline.data.cache import PACKING_DIR

    _check(strategy, seq_len)
    d = _layout_dir(strategy, seq_len)
    root = cache.root()
    meta_bytes = root.read(f"{PACKING_DIR}/{d}/layout.json")
    meta: dict[str, Any] | None = json.loads(meta_bytes) if meta_bytes else None
    if (
        meta is not None
        and meta.get("layout_version") == LAYOUT_VERSION
        and meta.get("cache_identity") == cache.identity
    ):
        stored = _open_stored(cache, seq_len, strategy, meta)
        if stored is not None:
            return stored
    if not create:
        raise FileNotFoundError(f"{cache.location}: no valid packing layout {d}")
    return build_packing(cache, seq_len, strategy)
