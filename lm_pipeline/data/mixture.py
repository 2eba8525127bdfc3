"""A mixture of training sources: which component each row of a run comes from, by position.

Rows are counted by their *position* in the run: global batch ``k`` holds positions
``[k * B, (k + 1) * B)`` (``B``: the global batch size). The mixture maps a position to (component,
the component's row) as a pure function of (seed, weights, block size, batch size, the components'
lengths), so batch ``k`` needs no loader state: a resumed run, or another process, computes the
same rows from ``k`` alone.

Blocks (Levanter's "block-deterministic" mixture)
    Each phase of the weights is cut into blocks of ``block_size`` rows, counted from the phase's
    first row. A block holds each component's share of rows exactly: ``int(w / total *
    block_size)`` (rounded down; ``total``: the sum of the phase's weights), and the rows left
    over go to the component with the most rows (the first in ``configs`` order on a tie), as
    Levanter rounds them. Where the rows of a component fall inside the block is a seeded
    permutation of the block, new for every block.

Phases
    A phase given at step ``s`` starts at row ``s * B`` exactly, whatever the block size: blocks
    never straddle a phase boundary. When ``s * B`` is not a multiple of the block size, the
    earlier phase ends with one short block (its rows rounded the same way), and the new phase's
    blocks start at ``s * B``. Levanter requires the boundary to be a multiple of the block size;
    where it is, both give the same blocks.

A component's rows
    The ``j``-th row drawn from a component is row ``j`` of that component's own order: epoch
    ``j // n`` (``n``: its rows), visited in a seeded permutation new every epoch
    (:class:`lm_pipeline.batch.StepBatchSource`'s order, seeded per component), so a component that
    runs out starts again in a new order.

Stop strategies (how long the run is)
    A component *runs out* at the position where it would need its ``n + 1``-th row.
    ``restart``: never ends. ``first_exhausted``: ends at the position where the first component
    runs out (no component repeats a row). ``all_exhausted``: ends where the last one runs out;
    the others restart meanwhile (weights stay fixed, so every block keeps its exact shares). A
    component whose weight drops to 0 before it runs out never runs out. The run has
    ``length // B`` full steps.

The rules for ``train_weights`` (its two shapes, the rounding, the checks) are in
:mod:`lm_pipeline.data.mixture_weights`; :class:`lm_pipeline.data.config.DataConfig` reports
their problems with the config's.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lm_pipeline.batch import LmBatch, SequenceDataset, StepBatchSource, check_process_slice
from lm_pipeline.data.config import MAX_MIXTURE_BLOCK_SIZE, STOP_STRATEGIES
from lm_pipeline.data.mixture_weights import block_counts, schedule_problems, weight_phases

__all__ = ["Mixture", "MixtureBatchSource", "block_counts", "component_seed", "length_problems", "mixture_num_steps",
           "mixture_source", "schedule_problems", "weight_phases"]

if TYPE_CHECKING:
    from lm_pipeline.data.config import DataConfig

_BLOCK_STREAM = 0xB10C  # keys the blocks' permutations apart from every other seeded order


# --- the mixture: position -> (component, draw) ----------------------------------------------------


class Mixture:
    """Which component each position of a run comes from, and how many of that component's rows
    come before it (its *draw*): a pure function of (names, weights, batch size, block size,
    seed). See the module docstring for blocks, phases and rounding.

    Args:
        names: the components, in ``configs`` order (the order breaks rounding ties and lays out
            each block before its permutation).
        train_weights: ``{name: weight}``, or phases ``[(step, {name: weight}), ...]``.
        batch_size: the global batch size: a phase given at step ``s`` starts at row ``s * batch_size``.
        block_size: rows per block.
        seed: seeds every block's permutation.

    ``names`` here are the components with a positive weight in some phase (the others are never
    drawn); component ids index them. Only the block last used is kept (thread-safe).
    """

    def __init__(self, names: Sequence[str], train_weights: Any, *, batch_size: int, block_size: int = 2048,
                 seed: int = 0):
        problems = schedule_problems(train_weights, list(names), block_size)
        if not 1 <= block_size <= MAX_MIXTURE_BLOCK_SIZE:
            problems.append(("mixture_block_size", f"must be between 1 and {MAX_MIXTURE_BLOCK_SIZE}, got {block_size}"))
        if batch_size < 1:
            problems.append(("batch_size", f"must be >= 1, got {batch_size}"))
        if problems:
            raise ValueError("; ".join(f"{where}: {problem}" for where, problem in problems))
        phases, _ = weight_phases(train_weights)
        self.names = tuple(n for n in names if any(w.get(n, 0.0) > 0 for _, w in phases))
        self.batch_size = batch_size
        self.block_size = block_size
        self.seed = seed
        S, C, P = block_size, len(self.names), len(phases)
        self._starts = np.array([step * batch_size for step, _ in phases], np.int64)
        self._counts = np.zeros((P, C), np.int64)  # rows of each component in a full block
        self._before = np.zeros((P, C), np.int64)  # rows of each component in the earlier phases
        self._tail_counts = np.zeros((P, C), np.int64)  # ... in the phase's short last block
        self._full_blocks: list[int | None] = []  # full blocks of each phase (None: the last, unbounded)
        self._tails: list[int] = []  # rows of the phase's short last block (0: none)
        before = np.zeros(C, np.int64)
        for q, (_, weights) in enumerate(phases):
            self._counts[q] = block_counts(weights, self.names, S)
            self._before[q] = before
            if q + 1 < P:
                full, tail = divmod(int(self._starts[q + 1] - self._starts[q]), S)
                if tail:
                    self._tail_counts[q] = block_counts(weights, self.names, tail)
                before = before + full * self._counts[q] + self._tail_counts[q]
            else:
                full, tail = None, 0
            self._full_blocks.append(full)
            self._tails.append(tail)
        self._lock = threading.Lock()
        self._cached: tuple[tuple[int, int], tuple[np.ndarray, np.ndarray]] | None = None

    def phase_starts(self) -> list[int]:
        """The first row of each phase."""
        return self._starts.tolist()

    def block_layout(self, phase: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Block ``block`` of phase ``phase``: for each of its rows, the component and how many of
        that component's rows come before it in the block (read-only arrays)."""
        key = (phase, block)
        with self._lock:
            if self._cached is not None and self._cached[0] == key:
                return self._cached[1]
        if block == self._full_blocks[phase]:  # the short block that ends a phase
            size, counts = self._tails[phase], self._tail_counts[phase]
        else:
            size, counts = self.block_size, self._counts[phase]
        order = np.random.Generator(np.random.PCG64([self.seed, _BLOCK_STREAM, phase, block])).permutation(size)
        ends = np.cumsum(counts)
        component = np.searchsorted(ends, order, side="right")
        # a component's rows of the block are drawn in order of position, so draws increase with
        # position (a run cut where a component runs out holds none of its later draws)
        by_component = np.argsort(component, kind="stable")
        rank = np.empty(size, np.int64)
        rank[by_component] = np.arange(size) - (ends - counts)[component[by_component]]
        component.setflags(write=False)
        rank.setflags(write=False)
        with self._lock:
            self._cached = (key, (component, rank))
        return component, rank

    def assign(self, positions: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each position: (the component's index in :attr:`names`, its draw: how many rows of
        that component come before it in the run)."""
        pos = np.asarray(positions, np.int64)
        if pos.size and pos.min() < 0:
            raise ValueError(f"positions must be >= 0, got {int(pos.min())}")
        phase = np.searchsorted(self._starts, pos, side="right") - 1
        block, offset = np.divmod(pos - self._starts[phase], self.block_size)
        component = np.empty(pos.shape, np.int64)
        draw = np.empty(pos.shape, np.int64)
        key = block * len(self._starts) + phase
        if pos.size and key.min() == key.max():  # the usual case: one block
            groups = [(int(key.flat[0]), slice(None))]
        else:
            groups = [(int(k), key == k) for k in np.unique(key)]
        for k, sel in groups:
            b, q = divmod(k, len(self._starts))
            slots, ranks = self.block_layout(q, b)
            c = slots[offset[sel]]
            component[sel] = c
            draw[sel] = self._before[q, c] + b * self._counts[q, c] + ranks[offset[sel]]
        return component, draw

    def position_of_draw(self, component: int, draw: int) -> int | None:
        """The position of ``component``'s draw number ``draw`` (0-based), or None if the
        component is never drawn that often (its weight drops to 0 before)."""
        P = len(self._starts)
        for q in range(P):
            lo = int(self._before[q, component])
            count = int(self._counts[q, component])
            if q + 1 < P:
                hi = int(self._before[q + 1, component])
            else:
                hi = sys.maxsize if count else lo
            if lo <= draw < hi:
                break
        else:
            return None
        local = draw - lo
        full = self._full_blocks[q]
        if count and (full is None or local < full * count):
            block, rank = divmod(local, count)
        else:  # in the phase's short last block
            block, rank = full, local - full * count
        slots, _ = self.block_layout(q, block)
        slot = int(np.flatnonzero(slots == component)[rank])
        return int(self._starts[q]) + block * self.block_size + slot

    def length(self, lengths: Mapping[str, int], stop_strategy: str) -> tuple[int | None, str | None]:
        """(rows in the run, the component that ends it) for components of ``lengths`` rows each
        (``restart``: ``(None, None)``, no end). See the module docstring."""
        if stop_strategy not in STOP_STRATEGIES:
            raise ValueError(f"stop_strategy must be one of {', '.join(STOP_STRATEGIES)}, got {stop_strategy!r}")
        if stop_strategy == "restart":
            return None, None
        ends = {}
        for c, name in enumerate(self.names):
            at = self.position_of_draw(c, int(lengths[name]))
            if at is not None:
                ends[name] = at
        pick = min if stop_strategy == "first_exhausted" else max
        name = pick(ends, key=ends.__getitem__)
        return ends[name], name


def component_seed(seed: int, name: str) -> int:
    """The seed of component ``name``'s row order: apart from every other component's, and the
    same whatever other components the mixture has."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little")


# --- the batch source ------------------------------------------------------------------------------


class MixtureBatchSource:
    """Batches of a mixture, indexed by step: ``batch(k)`` is a pure function of (seed, k,
    weights, the components' data), like :class:`lm_pipeline.batch.StepBatchSource`'s, and used the
    same way by the training loop.

    Args:
        datasets: each component's packed rows, in ``configs`` order; components without a
            positive weight may be left out.
        train_weights: ``{name: weight}`` or phases ``[(step, {name: weight}), ...]``.
        batch_size: the global batch size.
        seed: the run's seed (the blocks' and, per component, the rows' orders).
        block_size / stop_strategy: ``data.mixture_block_size`` / ``data.stop_strategy``.
        process_index / process_count: this process's contiguous slice
            ``[i * B/P, (i + 1) * B/P)`` of the global batch; it reads only its own rows.
        shuffle / era_length: each component's row order (``data.shuffle`` / ``data.era_length``).
    """

    def __init__(
        self,
        datasets: Mapping[str, SequenceDataset],
        train_weights: Any,
        batch_size: int,
        seed: int,
        *,
        block_size: int = 2048,
        stop_strategy: str = "restart",
        process_index: int = 0,
        process_count: int = 1,
        shuffle: str = "epoch",
        era_length: int = 4096,
    ):
        check_process_slice(batch_size, process_index, process_count)
        if stop_strategy not in STOP_STRATEGIES:
            raise ValueError(f"stop_strategy must be one of {', '.join(STOP_STRATEGIES)}, got {stop_strategy!r}")
        self.mixture = Mixture(list(datasets), train_weights, batch_size=batch_size, block_size=block_size, seed=seed)
        self.datasets = [datasets[n] for n in self.mixture.names]
        seq_lens = {n: datasets[n].seq_len for n in self.mixture.names}
        if len(set(seq_lens.values())) > 1:
            raise ValueError(f"the components are packed to different seq_len: {seq_lens}")
        self._orders = [StepBatchSource(ds, 1, component_seed(seed, n), shuffle=shuffle, era_length=era_length)
                        for n, ds in zip(self.mixture.names, self.datasets, strict=True)]
        self.batch_size = batch_size
        self.seed = seed
        self.stop_strategy = stop_strategy
        self.process_index = process_index
        self.process_count = process_count
        self._length: tuple[int | None, str | None] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The components drawn from (index = component id)."""
        return self.mixture.names

    @property
    def seq_len(self) -> int:
        return self.datasets[0].seq_len

    @property
    def local_batch_size(self) -> int:
        return self.batch_size // self.process_count

    def _rows(self, c: int) -> int:
        ds = self.datasets[c]
        rows_ready = getattr(ds, "rows_ready", None)  # a cache still being written: its final size
        return int(rows_ready(sys.maxsize)) if rows_ready is not None else len(ds)

    def length(self) -> tuple[int | None, str | None]:
        """(rows in the run, the component that ends it); ``(None, None)`` under ``restart``."""
        if self._length is None:
            lengths = {} if self.stop_strategy == "restart" else {n: self._rows(c) for c, n in enumerate(self.names)}
            self._length = self.mixture.length(lengths, self.stop_strategy)
        return self._length

    @property
    def num_steps(self) -> int | None:
        """Full steps in the run (None: no end, ``restart``)."""
        rows, _ = self.length()
        return None if rows is None else rows // self.batch_size

    def rows_at(self, positions: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(component id, the row in that component's dataset) of each position of the run."""
        component, draw = self.mixture.assign(positions)
        rows = np.empty_like(draw)
        for c in np.unique(component).tolist():
            sel = component == c
            rows[sel] = self._orders[c].rows_at(draw[sel])
        return component, rows

    def _check_step(self, step: int) -> None:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.stop_strategy != "restart" and step >= self.num_steps:
            rows, name = self.length()
            raise IndexError(f"step {step} is past the mixture's end: with stop_strategy {self.stop_strategy} it "
                             f"has {self.num_steps} steps ({rows} rows; component {name!r} runs out at row {rows})")

    def global_rows(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(component ids, rows) of the whole global batch of ``step``."""
        self._check_step(step)
        start = step * self.batch_size
        return self.rows_at(np.arange(start, start + self.batch_size, dtype=np.int64))

    def local_rows(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(component ids, rows) of this process's slice of the global batch of ``step``."""
        self._check_step(step)
        start = step * self.batch_size + self.process_index * self.local_batch_size
        return self.rows_at(np.arange(start, start + self.local_batch_size, dtype=np.int64))

    def _mixed_kinds(self) -> tuple[bool, bool]:
        """(segment ids, loss mask): whether every batch carries them because some component's
        rows do while others' do not (a chat component, packed whole with a loss mask, beside
        concat text). Datasets that do not say (no ``has_segments``/``has_loss_mask``) never mix."""
        def says(name: str) -> list[bool]:
            return [bool(getattr(d, name)) for d in self.datasets if hasattr(d, name)]

        seg, mask = says("has_segments"), says("has_loss_mask")
        return any(seg) and not all(seg), any(mask) and not all(mask)

    def batch(self, step: int) -> LmBatch:
        """This process's slice of the global batch for ``step`` (reads only those rows).

        When components differ (chat rows beside concat text rows), rows without segment ids get
        one segment over the whole row (the same causal attention and targets as none), rows
        without a loss mask a mask of ones (every token trained on), so every batch has one shape."""
        component, rows = self.local_rows(step)
        fill_seg, fill_mask = self._mixed_kinds()
        tokens = segments = masks = None
        for c in np.unique(component).tolist():
            sel = np.flatnonzero(component == c)
            part = self.datasets[c].get_many(rows[sel])
            seg, mask = part.segment_ids, part.loss_mask
            if fill_seg and seg is None:
                seg = np.ones(part.tokens.shape, np.int32)
            if fill_mask and mask is None:
                mask = np.ones(part.tokens.shape, np.int32)
            if tokens is None:
                tokens = np.empty((len(rows), *part.tokens.shape[1:]), part.tokens.dtype)
                if seg is not None:
                    segments = np.empty((len(rows), *seg.shape[1:]), np.int32)
                if mask is not None:
                    masks = np.empty((len(rows), *mask.shape[1:]), np.int32)
            if (seg is None) != (segments is None):
                raise ValueError("the components differ in packing: some rows have segment ids, some not")
            if (mask is None) != (masks is None):
                raise ValueError("the components differ in loss masks: some rows have one, some not")
            tokens[sel] = part.tokens
            if segments is not None:
                segments[sel] = seg
            if masks is not None:
                masks[sel] = mask
        return LmBatch(tokens, segments, masks)


def mixture_source(cfg: DataConfig, datasets: Mapping[str, SequenceDataset], batch_size: int, seed: int, *,
                   process_index: int | None = None, process_count: int | None = None) -> MixtureBatchSource:
    """The :class:`MixtureBatchSource` of data section ``cfg``'s mixture over its components'
    packed rows (``datasets[name]``), for this process (defaults from ``jax.process_index/count``)."""
    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    ordered = {name: datasets[name] for name in cfg.configs if name in datasets}
    # a component never drawn (weight 0 throughout: one with validation sets only) has no rows here
    phases = [(step, {n: w for n, w in weights.items() if n in ordered or w > 0})
              for step, weights in weight_phases(cfg.train_weights)[0]]
    return MixtureBatchSource(ordered, phases, batch_size, seed, block_size=cfg.mixture_block_size,
                              stop_strategy=cfg.stop_strategy, process_index=process_index,
                              process_count=process_count, shuffle=cfg.shuffle, era_length=cfg.era_length)


def length_problems(trainer: Any) -> list[tuple[str, str]]:
    """(field, problem) of a run length that has no meaning over a mixture: one in epochs."""
    out = []
    if trainer.num_train_steps is None and trainer.train_tokens is None and trainer.num_epochs is not None:
        out.append(("trainer.num_epochs", "a mixture's length is given by num_train_steps or train_tokens (and "
                    "data.stop_strategy), not in epochs of its components; give num_train_steps"))
    if trainer.max_epochs is not None:
        out.append(("trainer.max_epochs", "does not apply to a mixture (its end is data.stop_strategy); remove it"))
    return out


def mixture_num_steps(source: MixtureBatchSource, trainer: Any, seq_len: int) -> int:
    """A mixed run's steps: ``trainer.num_train_steps`` (or ``train_tokens``), cut where the
    mixture ends under its stop strategy. Epochs have no meaning over a mixture (refused)."""
    from lm_pipeline.schema import ConfigError

    for where, problem in length_problems(trainer):
        raise ConfigError(where, problem)
    steps = trainer.resolve_num_steps(None, seq_len)
    end = source.num_steps
    if end is not None and end < steps:
        _, name = source.length()
        if end == 0:
            raise ConfigError("data.stop_strategy", f"{source.stop_strategy}: component {name!r} runs out before "
                              "the first batch is full; use restart or more data")
        import logging

        logging.getLogger(__name__).info("mixture: stop_strategy %s ends the run at step %d (component %r runs out), "
                                         "before num_train_steps %d", source.stop_strategy, end, name, steps)
        return end
    return steps
