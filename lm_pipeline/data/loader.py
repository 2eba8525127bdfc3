"""The training data loader: cache-backed datasets, step-indexed batches, background prefetch.

* :class:`CacheDataset` is a :class:`~lm_pipeline.batch.SequenceDataset` over a token cache and
  one packing layout. ``get_many(rows)`` turns the rows into token positions with the layout and
  reads them as contiguous runs (adjacent pieces merged; one run per row for ``concat`` and
  ``greedy``) issued together in one ``tensorstore.Batch`` (only the 16 KiB inner chunks touched
  are fetched), then fills ``[B, seq_len]``.
* :class:`~lm_pipeline.batch.StepBatchSource` makes the batch for step ``k`` a pure function of
  (cache, layout, seed, k): a seeded permutation of the rows per epoch, reshuffled every epoch.
  Resuming at step ``k`` needs no loader state.
* Multi-host: every process builds the same source with its own ``process_index`` /
  ``process_count`` (defaults: ``jax.process_index()`` / ``jax.process_count()``, see
  :func:`make_batch_source`); all compute the same global row ids for a step, and each reads only
  its contiguous slice ``[i * B/P, (i + 1) * B/P)``. Together the processes see exactly the
  global batch. With a ``sharding``, :class:`Prefetcher` assembles the global ``jax.Array`` with
  ``jax.make_array_from_process_local_data``, each host contributing its slice.
* :class:`GrowingCacheDataset` reads the committed prefix of a cache that is still being built
  (``concat`` rows only): with ``data.shuffle: era`` the batch for step ``k`` needs only the
  cache's first eras, and ``rows_ready`` polls the ledger until they are committed (or fails in
  one line when the builder stopped or the cache stopped growing). Shards are committed in shard
  order, so the prefix is a prefix of the final cache and the batches are those of the complete one.
* :class:`~lm_pipeline.data.prefetch.Prefetcher` (re-exported here) loads upcoming steps on a
  background thread (``depth`` steps ahead) and
  yields ``(step, batch)`` in order from any start step; its :class:`PrefetchStats` record how
  long the consumer (the training loop, i.e. the device) waited for data.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from lm_pipeline.batch import LmBatch, SequenceDataset, StepBatchSource
from lm_pipeline.data.cache import (
    CacheError,
    CacheNotFoundError,
    CacheStalledError,
    TokenCache,
    open_cache,
)
from lm_pipeline.data.packing import PackedLayout, open_packing
from lm_pipeline.data.prefetch import Prefetcher, PrefetchStats  # noqa: F401  (re-exported)

__all__ = [
    "CacheDataset",
    "GrowingCacheDataset",
    "PrefetchStats",
    "Prefetcher",
    "make_batch_source",
    "open_dataset",
]


class CacheDataset:
    """Packed ``seq_len`` rows of a token cache (a :class:`SequenceDataset`).

    Args:
        cache: an open :class:`TokenCache` (complete), or its location.
        seq_len: row length.
        packing: ``concat``, ``greedy`` or ``first_fit`` (see :mod:`lm_pipeline.data.packing`);
            the layout is loaded from beside the cache, or derived and stored there. A chat
            source's cache packs its own way, whatever is given: whole conversations, ``greedy``
            (``chat_pack`` true) or one per row (``single``, ``chat_pack`` false); its batches
            carry the loss mask (:attr:`LmBatch.loss_mask`).
        chat_pack: the chat source's ``pack`` (not in the cache: runs that differ in it share
            the cache); None: true (or what a cache built before it left the ledger recorded).
        pad_id: token id of padding positions (greedy/first_fit); default: the cache's EOS.
    """

    def __init__(
        self,
        cache: TokenCache | str | os.PathLike,
        seq_len: int,
        packing: str = "concat",
        *,
        layout: PackedLayout | None = None,
        pad_id: int | None = None,
        chat_pack: bool | None = None,
    ):
        if not isinstance(cache, TokenCache):
            cache = open_cache(cache)
        self.cache = cache
        self.seq_len = int(seq_len)
        if cache.chat is not None:  # conversations are never cut and concatenated
            pack = cache.chat.get("pack", True) if chat_pack is None else chat_pack
            packing = "greedy" if pack else "single"
        self.packing = packing
        self.layout = layout if layout is not None else open_packing(cache, self.seq_len, packing)
        if (self.layout.strategy, self.layout.seq_len) != (packing, self.seq_len):
            raise ValueError(f"layout is {self.layout.strategy}-{self.layout.seq_len}, not {packing}-{seq_len}")
        self.pad_id = cache.eos_id if pad_id is None else int(pad_id)
        self._tokens = cache.tokens
        self._mask = cache.array("loss_mask") if cache.has_loss_mask else None
        self._masked_tokens: int | None = None

    @property
    def has_segments(self) -> bool:
        """Whether batches carry segment ids (every packing but ``concat``)."""
        return self.packing != "concat"

    @property
    def has_loss_mask(self) -> bool:
        """Whether batches carry a loss mask (a chat source's cache)."""
        return self._mask is not None

    def __len__(self) -> int:
        return self.layout.num_rows

    def __repr__(self) -> str:
        return f"CacheDataset({self.cache.location!r}, seq_len={self.seq_len}, packing={self.packing!r}, rows={len(self)})"

    @property
    def num_bytes(self) -> int:
        """UTF-8 bytes of the cache's text (for bits-per-byte)."""
        return self.cache.num_bytes

    @property
    def bytes_per_token(self) -> float:
        """The cache's text bytes per token (EOS and other added tokens included); a chat cache's
        per trained-on token (its bytes are the assistant's text, see :mod:`lm_pipeline.data.chat`)."""
        if self._mask is not None:
            if self._masked_tokens is None:
                self._masked_tokens = int(np.asarray(self._mask.read().result(), np.int64).sum())
            return self.cache.num_bytes / max(1, self._masked_tokens)
        return self.cache.num_bytes / max(1, self.cache.num_tokens)

    def read_runs(self, starts: np.ndarray, lengths: np.ndarray, array: Any = None) -> np.ndarray:
        """Concatenation of ``tokens[s:s + n]`` for each run (of ``array`` instead when given: the
        loss mask); all reads issued as one TensorStore batch."""
        if len(starts) == 0:
            return np.zeros(0, np.uint32)
        tokens = self._tokens if array is None else array
        with ts.Batch() as batch:
            futures = [tokens[s : s + n].read(batch=batch) for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)]
        parts = [f.result() for f in futures]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def get_many(self, indices: Sequence[int]) -> LmBatch:
        plan = self.layout.plan(np.asarray(indices, np.int64))
        values = self.read_runs(plan.run_start, plan.run_len)
        n, T = len(plan.row_len), self.seq_len
        if plan.segment_ids is None:  # concat: full rows
            return LmBatch(values.reshape(n, T).astype(np.int32), None)
        filled = np.arange(T) < plan.row_len[:, None]
        tokens = np.full((n, T), self.pad_id, np.int32)
        tokens[filled] = values
        if self._mask is None:
            return LmBatch(tokens, plan.segment_ids)
        mask = np.zeros((n, T), np.int32)  # padding is never trained on
        mask[filled] = self.read_runs(plan.run_start, plan.run_len, self._mask)
        return LmBatch(tokens, plan.segment_ids, mask)


#: How long a reader waits for a cache under construction to commit more rows before it decides
#: that the builder died (seconds); ``$LM_PIPELINE_CACHE_STALL_S`` overrides it.
STALL_TIMEOUT_S = 600.0


def _concat_layout(rows: int, seq_len: int, identity: str) -> PackedLayout:
    return PackedLayout("concat", seq_len, np.array([0, rows], np.int64), np.zeros(0, np.int64),
                        np.zeros(0, np.int32), cache_identity=identity)


class GrowingCacheDataset:
    """``concat`` rows of a token cache that may still be being built (a
    :class:`~lm_pipeline.batch.GrowingDataset`).

    It reads the ledger's committed prefix: row ``r`` is ``tokens[r * T:(r + 1) * T]`` for
    ``r < committed_tokens // T``. The builder commits whole shards in shard order (the ledger
    records each shard's token start; :class:`~lm_pipeline.data.cache.writer.Committer` refuses
    anything else), so every committed prefix is a prefix of the final cache and these rows are
    the complete cache's rows. ``greedy`` / ``first_fit`` rows are derived from the whole cache:
    refused.

    Args:
        location: the cache directory (it may not exist yet).
        seq_len: row length.
        packing: must be ``concat``.
        expected_tokenizer_fingerprint: checked as by :func:`open_cache` once the ledger exists.
        poll_s: seconds between reads of the ledger while waiting.
        stall_timeout_s: waiting fails when no new rows were committed for this long (default
            :data:`STALL_TIMEOUT_S`, or ``$LM_PIPELINE_CACHE_STALL_S``).
        builder_alive: optional; returns False once the builder has stopped, so that waiting
            fails at once instead of after ``stall_timeout_s`` (e.g. a builder thread's ``is_alive``).
    """

    def __init__(
        self,
        location: str | os.PathLike,
        seq_len: int,
        packing: str = "concat",
        *,
        expected_tokenizer_fingerprint: str | None = None,
        poll_s: float = 0.5,
        stall_timeout_s: float | None = None,
        builder_alive: Callable[[], bool] | None = None,
    ):
        if packing != "concat":
            from lm_pipeline.schema import ConfigError

            raise ConfigError("data.packing", f"is {packing}, but training on a token cache still being built "
                              "(data.shuffle: era) reads packing: concat only (greedy and first_fit rows are "
                              "derived from the whole cache); set data.packing: concat or build the cache first "
                              "(lm-pipeline cache)")
        self.location = os.fspath(location)
        self.seq_len = int(seq_len)
        self.packing = packing
        self.expected_tokenizer_fingerprint = expected_tokenizer_fingerprint
        self.poll_s = float(poll_s)
        if stall_timeout_s is None:
            raw = os.environ.get("LM_PIPELINE_CACHE_STALL_S", "")
            try:
                stall_timeout_s = float(raw) if raw.strip() else STALL_TIMEOUT_S
            except ValueError:
                raise ValueError(f"LM_PIPELINE_CACHE_STALL_S={raw!r}: expected a number of seconds") from None
        self.stall_timeout_s = float(stall_timeout_s)
        self.builder_alive = builder_alive
        self._lock = threading.Lock()  # guards the snapshot
        self._wait_lock = threading.Lock()  # one waiter polls at a time
        self._cache: TokenCache | None = None
        self._data: CacheDataset | None = None
        self._rows = 0
        self._closed = threading.Event()
        self._refresh()

    # -- the snapshot ---------------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        return self._cache is not None and self._cache.complete

    @property
    def cache(self) -> TokenCache | None:
        """The latest snapshot of the cache (None before its ledger exists)."""
        return self._cache

    def _refresh(self) -> None:
        """Read the ledger again; a newer snapshot replaces the current one."""
        if self.complete:
            return
        try:
            cache = open_cache(self.location, self.expected_tokenizer_fingerprint, require_complete=False)
        except CacheNotFoundError:  # the builder has not started this cache yet
            return
        old = self._cache
        if old is not None:
            if cache.identity == old.identity:
                return
            n = len(old.shards)
            if cache.num_tokens < old.num_tokens or cache.shards[:n] != old.shards:
                raise CacheError(f"token cache {self.location} was rebuilt while training read it (its committed "
                                 "shards are no longer a prefix of what was read); restart the run")
        rows = cache.num_tokens // self.seq_len
        data = CacheDataset(cache, self.seq_len, "concat", layout=_concat_layout(rows, self.seq_len, cache.identity))
        with self._lock:
            self._cache, self._data, self._rows = cache, data, rows

    def _state(self) -> str:
        c = self._cache
        if c is None:
            return "no ledger yet"
        return (f"{c.ledger['committed']['shards']} of {c.ledger['plan']['num_shards']} shards committed, "
                f"{self._rows} rows of {self.seq_len} tokens")

    def rows_ready(self, need: int) -> int | None:
        """Block until at least ``need`` rows are committed or the cache is complete: the number
        of rows once complete, else None. Raises :class:`CacheStalledError` (one line) when the
        builder stopped, or nothing new was committed for ``stall_timeout_s``, before that."""
        if not self.complete and self._rows >= need:  # enough rows already: no ledger read per step
            return None
        with self._wait_lock:
            last_key, last_change = None, time.monotonic()
            while True:
                self._refresh()
                if self.complete:
                    return self._rows
                if self._rows >= need:
                    return None
                c = self._cache
                key = None if c is None else (c.num_tokens, c.ledger["committed"]["shards"])
                now = time.monotonic()
                if key != last_key:
                    last_key, last_change = key, now
                if self.builder_alive is not None:
                    if not self.builder_alive():
                        self._refresh()  # it may have finished between the two reads
                        if self.complete or self._rows >= need:
                            continue
                        raise CacheStalledError(
                            f"token cache {self.location}: its builder stopped before committing the {need} rows "
                            f"training needs ({self._state()}); see the builder's error, then rerun (the build "
                            "resumes)")
                    last_change = now  # a live builder may spend long on one shard group: no timeout
                elif now - last_change > self.stall_timeout_s:
                    raise CacheStalledError(
                        f"token cache {self.location}: nothing new committed for {self.stall_timeout_s:g} s while "
                        f"training waits for {need} rows ({self._state()}); its builder seems to have died: "
                        "rebuild it (lm-pipeline cache resumes the build) and rerun")
                if self._closed.wait(self.poll_s):
                    raise CacheError(f"token cache {self.location}: stopped waiting for {need} rows (closed)")

    def close(self) -> None:
        """Stop waiting: a pending or later :meth:`rows_ready` that would wait raises instead (so a
        prefetch thread does not outlive a run that stopped)."""
        self._closed.set()

    def wait_complete(self) -> TokenCache:
        """Block until the cache is complete (as :meth:`rows_ready`); the complete cache."""
        self.rows_ready(sys.maxsize)
        assert self._cache is not None
        return self._cache

    # -- SequenceDataset ------------------------------------------------------------------------

    def __len__(self) -> int:
        """Rows committed so far (all rows once complete)."""
        return self._rows

    def __repr__(self) -> str:
        return f"GrowingCacheDataset({self.location!r}, seq_len={self.seq_len}, {self._state()})"

    @property
    def num_bytes(self) -> int:
        return self._cache.num_bytes if self._cache is not None else 0

    @property
    def bytes_per_token(self) -> float:
        c = self._cache
        return c.num_bytes / max(1, c.num_tokens) if c is not None else 0.0

    def get_many(self, indices: Sequence[int]) -> LmBatch:
        with self._lock:
            data, rows = self._data, self._rows
        idx = np.asarray(indices, np.int64)
        if data is None or (len(idx) and int(idx.max()) >= rows):
            raise IndexError(f"rows up to {int(idx.max()) if len(idx) else 0} asked of {self.location}, which has "
                             f"{rows} committed rows (call rows_ready first)")
        return data.get_many(idx)


def open_dataset(
    cache_dir: str | os.PathLike,
    seq_len: int,
    packing: str = "concat",
    *,
    expected_tokenizer_fingerprint: str | None = None,
    chat_pack: bool | None = None,
    **open_kwargs: Any,
) -> CacheDataset:
    """Open a complete cache (checked as by :func:`open_cache`) and return its packed dataset
    (``chat_pack``: a chat source's ``pack``, see :class:`CacheDataset`)."""
    cache = open_cache(cache_dir, expected_tokenizer_fingerprint, **open_kwargs)
    return CacheDataset(cache, seq_len, packing, chat_pack=chat_pack)


def make_batch_source(
    dataset: SequenceDataset,
    batch_size: int,
    seed: int,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
    shuffle: str = "epoch",
    era_length: int = 4096,
) -> StepBatchSource:
    """A :class:`StepBatchSource` for this process (defaults from ``jax.process_index/count``)."""
    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    return StepBatchSource(dataset, batch_size, seed, process_index=process_index, process_count=process_count,
                           shuffle=shuffle, era_length=era_length)
