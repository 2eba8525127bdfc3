"""Packing: how the token cache's documents become ``seq_len`` rows. Cheap, deterministic, stored.

A layout is derived per (strategy, seq_len) from the cache's document offsets alone and stored
beside the cache, so changing ``seq_len`` never re-tokenizes::

    <cache>/packing/<strategy>-<seq_len>/
      layout.npz     row_ptr int64 [rows + 1], piece_start int64 [pieces], piece_len int32 [pieces]
      layout.json    strategy, seq_len, counts, the cache identity it was derived from, the
                     sha256 of layout.npz; written last (atomically), so it marks completion

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

Strategy = Literal["concat", "greedy", "first_fit"]
STRATEGIES: tuple[str, ...] = ("concat", "greedy", "first_fit")
LAYOUT_VERSION = 1


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


def _next_fit(lens: list[int], seq_len: int) -> np.ndarray:
    rows = np.empty(len(lens), np.int64)
    row, free = -1, 0
    for i, n in enumerate(lens):
        if n > free:
            row, free = row + 1, seq_len
        free -= n
        rows[i] = row
    return rows


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
    piece_start, piece_len = split_pieces(doc_offsets, seq_len)
    lens = piece_len.tolist()
    row_of = _next_fit(lens, seq_len) if strategy == "greedy" else _first_fit(lens, seq_len)
    order = np.argsort(row_of, kind="stable")  # by row, placement order within a row
    num_rows = int(row_of.max()) + 1 if len(row_of) else 0
    row_ptr = np.zeros(num_rows + 1, np.int64)
    np.cumsum(np.bincount(row_of, minlength=num_rows), out=row_ptr[1:])
    return {"row_ptr": row_ptr, "piece_start": piece_start[order],
            "piece_len": piece_len[order].astype(np.int32)}


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


def build_packing(cache: TokenCache, seq_len: int, strategy: str) -> PackedLayout:
    """Derive the layout from a complete cache and store it under ``<cache>/packing/``."""
    from lm_pipeline.data.cache import PACKING_DIR, CacheIncompleteError
    from lm_pipeline.data.cache.storage import dumps_json

    _check(strategy, seq_len)
    if not cache.complete:
        raise CacheIncompleteError(f"{cache.location}: packing needs a complete token cache")
    arrays = pack_documents(cache.doc_offsets, seq_len, strategy)
    layout = PackedLayout(strategy, seq_len, cache_identity=cache.identity, **arrays)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    blob = buf.getvalue()
    meta = {
        "layout_version": LAYOUT_VERSION,
        "strategy": strategy,
        "seq_len": seq_len,
        "num_rows": layout.num_rows,
        "num_pieces": len(layout.piece_len),
        "num_tokens": layout.num_tokens,
        "fill": round(layout.fill, 6),
        "cache_identity": cache.identity,
        "layout_npz_sha256": hashlib.sha256(blob).hexdigest(),
    }
    d = _layout_dir(strategy, seq_len)
    root = cache.root()
    # Concurrent builders (several hosts) write identical bytes; each file is replaced atomically.
    root.write_atomic(f"{PACKING_DIR}/{d}/layout.npz", blob)
    root.write_atomic(f"{PACKING_DIR}/{d}/layout.json", dumps_json(meta))  # last: marks completion
    return layout


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
        blob = root.read(f"{PACKING_DIR}/{d}/layout.npz")
        if blob is not None and hashlib.sha256(blob).hexdigest() == meta["layout_npz_sha256"]:
            with np.load(io.BytesIO(blob)) as z:
                arrays = {k: z[k] for k in ("row_ptr", "piece_start", "piece_len")}
            return PackedLayout(strategy, seq_len, cache_identity=cache.identity, **arrays)
    if not create:
        raise FileNotFoundError(f"{cache.location}: no valid packing layout {d}")
    return build_packing(cache, seq_len, strategy)
