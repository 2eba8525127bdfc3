"""Bits per byte: which bytes of text the evaluated tokens stand for.

Each predicted token carries the bytes-per-token of its own document (``doc_bytes[d] /
doc_tokens[d]`` from the token cache), so a document predicted in full contributes exactly its
UTF-8 byte count (the definitions are in :mod:`lm_pipeline.eval`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from lm_pipeline.batch import SequenceDataset

__all__ = ["LN2", "ByteCounter", "bits_per_byte", "target_byte_weights", "target_mask"]

LN2 = math.log(2.0)


def bits_per_byte(nats: float, num_bytes: float) -> float:
    """``nats / ln 2 / num_bytes`` (NaN when there are no bytes)."""
    if not num_bytes or not math.isfinite(num_bytes) or num_bytes <= 0:
        return float("nan")
    return float(nats) / LN2 / float(num_bytes)


def _excl_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x), np.int64)
    if len(x) > 1:
        np.cumsum(x[:-1], out=out[1:])
    return out


def _stream_positions(ds: Any, rows: np.ndarray) -> np.ndarray:
    """int64 [n, T]: position in the cache's token stream of each slot of the rows (-1: padding)."""
    layout = ds.layout
    plan = layout.plan(np.asarray(rows, np.int64))
    n, T = len(rows), ds.seq_len
    if plan.segment_ids is None:  # concat: row r is tokens[r*T:(r+1)*T]
        return np.asarray(rows, np.int64)[:, None] * T + np.arange(T, dtype=np.int64)[None]
    run_len = np.asarray(plan.run_len, np.int64)
    total = int(run_len.sum())
    stream = np.repeat(np.asarray(plan.run_start, np.int64), run_len)
    stream += np.arange(total, dtype=np.int64) - np.repeat(_excl_cumsum(run_len), run_len)
    pos = np.full((n, T), -1, np.int64)
    pos[np.arange(T)[None, :] < np.asarray(plan.row_len)[:, None]] = stream
    return pos


class ByteCounter:
    """Bytes-per-token of each document of a cache-backed dataset (see :mod:`lm_pipeline.eval`)."""

    def __init__(self, ds: Any):
        self.ds = ds
        self.kind = "none"
        cache = getattr(ds, "cache", None)
        if cache is not None and hasattr(ds, "layout") and hasattr(cache, "doc_bytes"):
            offsets = np.asarray(cache.doc_offsets, np.int64)
            lengths = np.diff(offsets)
            if getattr(cache, "has_loss_mask", False):  # a chat document's bytes are its masked-in tokens'
                mask = np.asarray(cache.read_loss_mask(0, cache.num_tokens), np.int64)
                lengths = np.add.reduceat(mask, offsets[:-1]) if len(lengths) and len(mask) else lengths * 0
                lengths[np.diff(offsets) == 0] = 0
            self.offsets = offsets
            self.bpt = np.asarray(cache.doc_bytes, np.float64) / np.maximum(lengths, 1)
            self.kind = "documents"
        elif getattr(ds, "bytes_per_token", None) is not None:
            self.const = float(ds.bytes_per_token)
            self.kind = "constant"

    def weights(self, rows: np.ndarray, target_mask: np.ndarray) -> np.ndarray | None:
        """float64 [n, T-1]: bytes of each predicted token (0 where not predicted)."""
        if self.kind == "none":
            return None
        if self.kind == "constant":
            return target_mask * self.const
        pos = _stream_positions(self.ds, rows)[:, 1:]
        doc = np.searchsorted(self.offsets, np.maximum(pos, 0), side="right") - 1
        return np.where(target_mask > 0, self.bpt[np.clip(doc, 0, len(self.bpt) - 1)], 0.0)


def target_byte_weights(ds: SequenceDataset, rows: Sequence[int]) -> np.ndarray | None:
    """Bytes carried by each predicted token of ``rows`` (float64 [n, T-1]), or None when ``ds``
    has no byte information. Summed over all tokens of a document predicted in full, this is
    exactly the document's UTF-8 byte count."""
    rows = np.asarray(rows, np.int64)
    batch = ds.get_many(rows)
    mask = target_mask(batch.tokens, batch.segment_ids)
    if batch.loss_mask is not None:
        mask *= np.asarray(batch.loss_mask)[:, 1:] != 0
    return ByteCounter(ds).weights(rows, mask)


def target_mask(tokens: np.ndarray, segment_ids: np.ndarray | None) -> np.ndarray:
    """float64 [n, T-1]: 1 where token t+1 is predicted from position t (the trainer's mask)."""
    tokens = np.asarray(tokens)
    if segment_ids is None:
        return np.ones((tokens.shape[0], tokens.shape[1] - 1), np.float64)
    s = np.asarray(segment_ids)
    return ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] != 0)).astype(np.float64)

