"""What the trainer consumes: packed sequences, and batches that are a pure function of the step.

A :class:`SequenceDataset` is any indexable collection of packed training sequences (the token
cache's packed layout, or an in-memory array in tests). :class:`StepBatchSource` turns one into
batches: the batch for step ``k`` depends only on (dataset, seed, k), so a resumed run sees the
same batches as an uninterrupted one and no loader state is saved in checkpoints.

Two row orders (``data.shuffle``):

``epoch``
    Epoch ``e`` visits all ``N`` rows in a seeded permutation of ``range(N)``, new every epoch.
    Step 0 already needs ``N``: the data must be complete.
``era`` (Levanter's era shuffling)
    The first epoch is cut into eras of ``K`` (``era_length``) consecutive rows; era ``b`` holds
    rows ``[b*K, min((b+1)*K, N))`` and is visited in a seeded permutation of its own (seeded by
    (seed, b), not by ``N``). A full era is the same whatever ``N`` turns out to be, so global
    position ``p < floor(N/K)*K`` maps to a row without knowing ``N``, and step ``k`` needs only
    the first ``ceil((k+1)*B/K)*K`` rows: training can run on the committed prefix of a cache
    that is still being built (a :class:`GrowingDataset`). The last era, when ``K`` does not
    divide ``N``, holds the ``N mod K`` rows left over and is permuted once ``N`` is known (the
    data complete). Epochs after the first need ``N`` anyway: they are shuffled whole, exactly as
    in ``epoch`` mode (the same permutation for the same epoch).
"""

from __future__ import annotations

import functools
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np


class LmBatch(NamedTuple):
    """A batch of packed sequences.

    tokens: int32 [B, T] token ids.
    segment_ids: int32 [B, T] or None. Positions with equal ids belong to the same document and
        attend only to each other; 0 marks padding (no loss, attends nowhere). None means plain
        concatenate-and-chunk: causal attention over the whole row, as in Levanter.
    loss_mask: int [B, T] or None. A chat source's rows: 1 on the tokens the loss is taken on (the
        assistant's), 0 elsewhere; position t is trained to predict token t+1 only where
        ``loss_mask[t+1]`` is 1 (:func:`lm_pipeline.train.loss.next_token_targets`). None: every
        token (text).
    """

    tokens: np.ndarray
    segment_ids: np.ndarray | None = None
    loss_mask: np.ndarray | None = None


class SequenceDataset(Protocol):
    """Indexable packed sequences of a fixed length."""

    seq_len: int

    def __len__(self) -> int: ...

    def get_many(self, indices: Sequence[int]) -> LmBatch:
        """Rows ``indices`` stacked in that order."""
        ...


class GrowingDataset(SequenceDataset, Protocol):
    """A :class:`SequenceDataset` whose rows are still being written, as a prefix of the final
    rows (a token cache under construction). ``len()`` is the rows there now."""

    def rows_ready(self, need: int) -> int | None:
        """Block until at least ``need`` rows exist or the data is complete (raising if it never
        will be); the total number of rows once complete, else None (``need`` rows exist)."""
        ...


class ArrayDataset:
    """A :class:`SequenceDataset` over a flat token array, chunked into ``seq_len`` rows."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        tokens = np.asarray(tokens, dtype=np.int32)
        n = len(tokens) // seq_len
        if n == 0:
            raise ValueError(f"need at least seq_len={seq_len} tokens, got {len(tokens)}")
        self.rows = tokens[: n * seq_len].reshape(n, seq_len)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.rows)

    def get_many(self, indices: Sequence[int]) -> LmBatch:
        return LmBatch(self.rows[np.asarray(indices, dtype=np.int64)])


# Datasets of up to this many rows shuffle with a stored permutation (8 bytes a row, at most
# 8 MiB); larger ones with a keyed bijection computed per position, so the loader's memory does
# not grow with the dataset (a 1 TB corpus at seq_len 2048 has ~10^8 rows: 1 GB per permutation).
MATERIALIZED_PERMUTATION_MAX_ROWS = 1 << 20
_FEISTEL_ROUNDS = 6


_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 arrays (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(_MIX1)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(_MIX2)
    return x ^ (x >> np.uint64(31))


@functools.lru_cache(maxsize=8)
def _feistel_keys(seed: int, epoch: int) -> np.ndarray:
    keys = np.random.Generator(np.random.PCG64([seed, epoch, 0xFE15])).integers(
        0, 1 << 63, _FEISTEL_ROUNDS, dtype=np.uint64)
    keys.setflags(write=False)
    return keys


def _feistel_permute(num_rows: int, seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
    """Rows at ``positions`` of a keyed pseudo-random permutation of ``range(num_rows)``, without
    materializing it: a balanced Feistel network on ``2 * h`` bits (``4**h >= num_rows``; a
    bijection of ``range(4**h)``) and cycle walking (re-apply until the value is below
    ``num_rows``; fewer than 4 rounds of it on average), so it is a bijection of ``range(num_rows)``.
    A batch's few positions are computed with Python integers (numpy's per-call overhead would
    dominate), many with numpy; both give the same rows."""
    h = max(1, ((num_rows - 1).bit_length() + 1) // 2)
    mask = (1 << h) - 1
    keys = _feistel_keys(seed, epoch)
    positions = np.asarray(positions, np.int64)
    if len(positions) <= 256:
        ks, m64, out = [int(k) for k in keys], (1 << 64) - 1, []
        for v in positions.tolist():
            while True:
                left, right = v >> h, v & mask
                for k in ks:
                    x = (right + k) & m64
                    x ^= x >> 30
                    x = (x * _MIX1) & m64
                    x ^= x >> 27
                    x = (x * _MIX2) & m64
                    left, right = right, left ^ ((x ^ (x >> 31)) & mask)
                v = (left << h) | right
                if v < num_rows:
                    break
            out.append(v)
        return np.asarray(out, np.int64)
    x = positions.astype(np.uint64)
    umask = np.uint64(mask)
    todo = np.ones(len(x), bool)
    with np.errstate(over="ignore"):
        while todo.any():
            v = x[todo]
            left, right = v >> np.uint64(h), v & umask
            for k in keys:
                left, right = right, left ^ (_mix64(right + k) & umask)
            v = (left << np.uint64(h)) | right
            x[todo] = v
            todo[todo] = v >= np.uint64(num_rows)
    return x.astype(np.int64)


def epoch_permutation(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """The row order of one epoch: a seeded permutation, different each epoch (materialized; the
    batch source computes only the positions it needs above the threshold)."""
    if num_rows <= MATERIALIZED_PERMUTATION_MAX_ROWS:
        rng = np.random.Generator(np.random.PCG64([seed, epoch, 0x5EED]))
        return rng.permutation(num_rows)
    return _feistel_permute(num_rows, seed, epoch, np.arange(num_rows))


SHUFFLES = ("epoch", "era")


@functools.lru_cache(maxsize=8)
def era_permutation(size: int, seed: int, era: int) -> np.ndarray:
    """The visiting order of era ``era``'s ``size`` rows (offsets in the era): a seeded
    permutation of ``range(size)`` that depends on (seed, era, size) only (read-only array)."""
    perm = np.random.Generator(np.random.PCG64([seed, era, 0xE4A])).permutation(size)
    perm.setflags(write=False)
    return perm


def check_process_slice(batch_size: int, process_index: int, process_count: int) -> None:
    """Each of ``process_count`` processes reads an equal slice of a step's ``batch_size`` rows;
    raises ValueError when ``process_index`` or the division does not fit."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, process_count={process_count})")
    if batch_size % process_count:
        raise ValueError(f"batch_size {batch_size} is not divisible by process_count {process_count}")


class StepBatchSource:
    """Batches indexed by step: ``batch(k)`` is a pure function of (dataset, seed, k).

    Rows are visited in the order ``shuffle`` names (``epoch`` or ``era``, see the module
    docstring); an epoch boundary inside a batch continues with the next epoch's order. With
    ``process_count > 1`` each process gets the contiguous slice
    ``[process_index * B/P, (process_index + 1) * B/P)`` of the global batch, so together the
    processes see exactly the global batch; each process reads only its own rows. Safe to call
    from several threads (e.g. a prefetcher's).

    The dataset may be a :class:`GrowingDataset` (rows still being written): ``batch(k)`` then
    waits until the rows step ``k`` needs exist (``era``: its eras; ``epoch``: all of them).
    """

    _PERMS_KEPT = 2  # an epoch boundary needs two permutations at once

    def __init__(
        self,
        dataset: SequenceDataset,
        batch_size: int,
        seed: int,
        *,
        process_index: int = 0,
        process_count: int = 1,
        shuffle: str = "epoch",
        era_length: int = 4096,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        check_process_slice(batch_size, process_index, process_count)
        if shuffle not in SHUFFLES:
            raise ValueError(f"shuffle must be one of {', '.join(SHUFFLES)}, got {shuffle!r}")
        if era_length < 1:
            raise ValueError(f"era_length must be >= 1, got {era_length}")
        self._rows_ready = getattr(dataset, "rows_ready", None)  # a GrowingDataset
        if self._rows_ready is None and len(dataset) == 0:
            raise ValueError("the dataset has no rows (is seq_len longer than the data?)")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.process_index = process_index
        self.process_count = process_count
        self.shuffle = shuffle
        self.era_length = era_length
        self._perm_cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._perm_lock = threading.Lock()

    @property
    def seq_len(self) -> int:
        return self.dataset.seq_len

    @property
    def local_batch_size(self) -> int:
        return self.batch_size // self.process_count

    def _perm(self, epoch: int, n: int) -> np.ndarray:
        with self._perm_lock:
            perm = self._perm_cache.get(epoch)
            if perm is None:
                perm = epoch_permutation(n, self.seed, epoch)
                self._perm_cache[epoch] = perm
                while len(self._perm_cache) > self._PERMS_KEPT:  # at most 2 x 8 MiB
                    self._perm_cache.popitem(last=False)
            else:
                self._perm_cache.move_to_end(epoch)
            return perm

    def rows_needed(self, step: int) -> int | None:
        """Rows step ``step`` needs to exist, or None when it needs them all (the total)."""
        return self._rows_needed_below((step + 1) * self.batch_size)

    def _rows_needed_below(self, end: int) -> int | None:
        """Rows the positions below ``end`` need to exist, or None when they need them all."""
        if self.shuffle == "era":
            return -(-end // self.era_length) * self.era_length
        return None

    def _total(self, end: int) -> int | None:
        """The number of rows, or None while the data is incomplete but holds what the positions
        below ``end`` need."""
        if self._rows_ready is None:
            return len(self.dataset)
        need = self._rows_needed_below(end)
        total = self._rows_ready(sys.maxsize if need is None else need)
        if total == 0:
            raise ValueError("the dataset has no rows (is seq_len longer than the data?)")
        return total

    def _epoch_rows(self, epoch: int, offsets: np.ndarray, n: int) -> np.ndarray:
        """Rows at ``offsets`` of epoch ``epoch``'s permutation of all ``n`` rows."""
        if n <= MATERIALIZED_PERMUTATION_MAX_ROWS:
            return self._perm(epoch, n)[offsets]
        return _feistel_permute(n, self.seed, epoch, offsets)  # computed per position: no O(rows) array

    def _era_rows(self, positions: np.ndarray, n: int | None) -> np.ndarray:
        """Rows at first-epoch ``positions`` in era order (``n``: the total, None if unknown, when
        every position lies in a full era)."""
        K = self.era_length
        eras, offsets = np.divmod(positions, K)
        out = np.empty_like(positions)
        for b in np.unique(eras).tolist():
            sel = eras == b
            size = K if n is None else min(K, n - b * K)
            if size <= MATERIALIZED_PERMUTATION_MAX_ROWS:
                out[sel] = b * K + era_permutation(size, self.seed, b)[offsets[sel]]
            else:  # keyed apart from every epoch's permutation
                out[sel] = b * K + _feistel_permute(size, self.seed, (1 << 40) + b, offsets[sel])
        return out

    def global_indices(self, step: int) -> np.ndarray:
        """Dataset row ids of the whole global batch for ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        start = step * self.batch_size
        return self.rows_at(np.arange(start, start + self.batch_size, dtype=np.int64))

    def rows_at(self, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """Dataset row ids at ``positions`` of the run's row order, any non-negative positions in
        any order: position ``p`` is the row global batch ``p // batch_size`` holds at
        ``p % batch_size`` (so ``global_indices(k)`` is ``rows_at(range(k * B, (k + 1) * B))``)."""
        flat = np.asarray(positions, dtype=np.int64)
        if flat.size == 0:
            return flat.copy()
        if flat.min() < 0:
            raise ValueError(f"positions must be >= 0, got {int(flat.min())}")
        n = self._total(int(flat.max()) + 1)
        if n is None:  # era order on a growing dataset: all positions lie in full, committed eras
            return self._era_rows(flat, None)
        epochs, offsets = np.divmod(flat, n)
        out = np.empty_like(flat)
        for e in np.unique(epochs).tolist():
            sel = epochs == e
            if e == 0 and self.shuffle == "era":
                out[sel] = self._era_rows(offsets[sel], n)
            else:
                out[sel] = self._epoch_rows(e, offsets[sel], n)
        return out

    def local_indices(self, step: int) -> np.ndarray:
        """Dataset row ids of this process's slice of the global batch for ``step``."""
        lo = self.process_index * self.local_batch_size
        return self.global_indices(step)[lo : lo + self.local_batch_size]

    def batch(self, step: int) -> LmBatch:
        """This process's slice of the global batch for ``step`` (reads only those rows)."""
        return self.dataset.get_many(self.local_indices(step))


def device_put_batch(batch: LmBatch, sharding, global_rows: int | None = None) -> LmBatch:
    """This process's rows of a batch placed on devices with ``sharding`` (int32 arrays).

    One process: ``jax.device_put``. Several processes: ``jax.make_array_from_process_local_data``,
    each contributing its slice of the global batch (``global_rows`` rows in all; default
    inferred by JAX from the slices).
    """
    import jax

    def put(x: np.ndarray | None):
        if x is None:
            return None
        x = np.asarray(x, np.int32)
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        shape = (global_rows, *x.shape[1:]) if global_rows else None
        return jax.make_array_from_process_local_data(sharding, x, shape)

    return LmBatch(put(batch.tokens), put(batch.segment_ids), put(batch.loss_mask))

