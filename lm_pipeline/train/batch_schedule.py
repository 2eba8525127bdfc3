"""Levanter's batch-size schedule: ``trainer.train_batch_size`` as a list of ``{start, value}``.

A schedule gives the global batch size per range of steps::

    train_batch_size:
      - {start: 0, value: 64}     # steps 0..63: 64 rows
      - {start: 64, value: 128}   # steps 64..255: 128 rows
      - {start: 256, value: 64}   # from step 256 on: 64 rows

What it means here, as in Levanter:

- Step ``k`` reads the rows at the run's positions ``[offset(k), offset(k) + size(k))``, where
  ``offset(k)`` is the sum of the batch sizes of the steps before ``k``. The row at a position is
  the one a fixed-batch run reads at that position (the row order does not depend on the batch
  size), so no row is skipped or read twice across a boundary, and the batch of step ``k`` stays a
  pure function of (data, seed, schedule, k): a resumed run reads what an uninterrupted one would.
- The learning-rate schedule stays by step; a mixture's phases (``train_weights`` given at step
  ``s``) start at row ``offset(s)``.
- Each distinct batch size has its own compiled train step (its micro-batch split), not each step.

A plain integer is the one-entry schedule; configs that give one keep their fingerprints. Imports
no JAX (configs are validated without it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lm_pipeline.batch import LmBatch, StepBatchSource
from lm_pipeline.data.mixture import MixtureBatchSource, weight_phases
from lm_pipeline.schema import field


@dataclass(frozen=True)
class BatchStep:
    """One entry of a batch-size schedule (Levanter's ``ScheduleStep``)."""

    start: int = field(help="The first step of this batch size (the first entry starts at 0).")
    value: int = field(help="The global batch size in sequences from that step on.")


def schedule_problems(value: Any, key: str = "train_batch_size") -> list[tuple[str, str]]:
    """(field, problem) for each thing wrong with the raw list form of a schedule ``value``: entries
    that are not ``{start, value}`` mappings of integers, a first start other than 0, starts that
    do not strictly increase, sizes below 1. Empty when it is a valid schedule."""
    if not isinstance(value, (list, tuple)):
        return []
    value = [{"start": e.start, "value": e.value} if isinstance(e, BatchStep) else e for e in value]
    if not value:
        return [(key, "a batch-size schedule needs at least one entry, e.g. [{start: 0, value: 64}]; "
                 "or give one batch size")]
    out: list[tuple[str, str]] = []
    previous = None
    for i, entry in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(entry, Mapping):
            out.append((where, f"expected a mapping {{start: STEP, value: BATCH_SIZE}}, got {entry!r}"))
            previous = None
            continue
        extra = sorted(str(k) for k in entry if k not in ("start", "value"))
        if extra:
            out.append((f"{where}.{extra[0]}", "unknown key; an entry of a batch-size schedule has start and value"))
        start, size = entry.get("start"), entry.get("value")
        start_ok = _is_int(start)
        if "start" not in entry:
            out.append((f"{where}.start", "is required (the first step of this batch size)"))
        elif not start_ok:
            out.append((f"{where}.start", f"expected an integer step, got {start!r}"))
        elif i == 0 and start != 0:
            out.append((f"{where}.start", f"the first entry starts at step 0, got {start}"))
        elif previous is not None and start <= previous:
            out.append((f"{where}.start", f"starts must strictly increase: step {start} follows step {previous}"))
        previous = start if start_ok else None
        if "value" not in entry:
            out.append((f"{where}.value", "is required (the global batch size from that step on)"))
        elif not _is_int(size) or size < 1:
            out.append((f"{where}.value", f"expected a batch size >= 1 (an integer), got {size!r}"))
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def normalize_schedule(value: Any) -> Any:
    """A valid raw schedule in canonical form: a one-entry list is its batch size (an integer:
    the same run as that plain batch size), a longer list a tuple of :class:`BatchStep`. Anything
    else is returned unchanged (the field's own check reports it)."""
    if not isinstance(value, (list, tuple)) or schedule_problems(value):
        return value
    entries = tuple(e if isinstance(e, BatchStep) else BatchStep(int(e["start"]), int(e["value"])) for e in value)
    return entries[0].value if len(entries) == 1 else entries


class BatchSchedule:
    """The batch size and data offset of every step of a run.

    ``spec``: one batch size, or :class:`BatchStep` entries (first start 0, starts increasing).
    """

    def __init__(self, spec: int | Sequence[BatchStep]):
        if isinstance(spec, int):
            spec = (BatchStep(0, spec),)
        steps = tuple(spec)
        if not steps or steps[0].start != 0 or any(b.start <= a.start for a, b in zip(steps, steps[1:], strict=False)):
            raise ValueError(f"a batch-size schedule starts at step 0 and its starts increase, got {steps}")
        if any(s.value < 1 for s in steps):
            raise ValueError(f"batch sizes must be >= 1, got {steps}")
        self.steps = steps
        self._starts = np.array([s.start for s in steps], np.int64)
        self._sizes = np.array([s.value for s in steps], np.int64)
        lengths = np.diff(self._starts)  # steps in each bounded segment
        self._offsets = np.concatenate([[0], np.cumsum(lengths * self._sizes[:-1])]).astype(np.int64)

    @property
    def is_constant(self) -> bool:
        return len(self.distinct_sizes) == 1

    @property
    def distinct_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({int(s) for s in self._sizes}))

    @property
    def max_size(self) -> int:
        return int(self._sizes.max())

    def _segment(self, step: int) -> int:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return int(np.searchsorted(self._starts, step, side="right")) - 1

    def batch_size_at(self, step: int) -> int:
        """The global batch size of step ``step``."""
        return int(self._sizes[self._segment(step)])

    def offset_at(self, step: int) -> int:
        """Rows read by the steps before ``step``: the first position step ``step`` reads."""
        q = self._segment(step)
        return int(self._offsets[q] + (step - self._starts[q]) * self._sizes[q])

    def positions(self, step: int) -> np.ndarray:
        """The run's positions step ``step`` reads."""
        lo = self.offset_at(step)
        return np.arange(lo, lo + self.batch_size_at(step), dtype=np.int64)

    def steps_to_reach(self, rows: float) -> int:
        """The fewest steps whose rows add up to at least ``rows`` (a token budget or epochs as steps)."""
        if rows <= 0:
            return 0
        last = len(self.steps) - 1
        for q in range(last + 1):
            end = self._offsets[q + 1] if q < last else None
            if end is None or rows <= end:
                return int(self._starts[q]) + int(np.ceil((rows - self._offsets[q]) / self._sizes[q] - 1e-9))
        raise AssertionError("unreachable")

    def full_steps_within(self, rows: int) -> int:
        """The most steps whose rows all lie below ``rows`` (a mixture that ends at ``rows``)."""
        last = len(self.steps) - 1
        for q in range(last + 1):
            end = self._offsets[q + 1] if q < last else None
            if end is None or rows < end:
                return int(self._starts[q]) + max(0, (rows - int(self._offsets[q])) // int(self._sizes[q]))
        raise AssertionError("unreachable")

    def __repr__(self) -> str:
        return "BatchSchedule(" + ", ".join(f"{s.start}:{s.value}" for s in self.steps) + ")"


def check_processes(schedule: BatchSchedule, process_count: int) -> None:
    """ValueError when a batch size of ``schedule`` cannot be split evenly over ``process_count``."""
    for size in schedule.distinct_sizes:
        if size % process_count:
            raise ValueError(f"batch size {size} of the schedule is not divisible by process_count {process_count}")


def local_positions(schedule: BatchSchedule, step: int, process_index: int, process_count: int) -> np.ndarray:
    """Process ``process_index``'s contiguous slice of the positions step ``step`` reads."""
    pos = schedule.positions(step)
    per = len(pos) // process_count
    return pos[process_index * per:(process_index + 1) * per]


class ScheduledBatchSource:
    """Batches of a batch-size schedule over one dataset, indexed by step: step ``k`` reads the
    rows at positions ``schedule.positions(k)`` of ``order``'s row order (a
    :class:`lm_pipeline.batch.StepBatchSource`, whose ``rows_at`` does not depend on its batch
    size); with ``process_count > 1`` each process reads its contiguous slice. Used by the training
    loop like a ``StepBatchSource`` (``batch(step)``, ``seq_len``)."""

    def __init__(self, order: StepBatchSource, schedule: BatchSchedule, *, process_index: int = 0,
                 process_count: int = 1):
        check_processes(schedule, process_count)
        self.order = order
        self.schedule = schedule
        self.process_index = process_index
        self.process_count = process_count

    @property
    def seq_len(self) -> int:
        return self.order.seq_len

    def global_indices(self, step: int) -> np.ndarray:
        """The rows of the whole global batch of ``step``."""
        return self.order.rows_at(self.schedule.positions(step))

    def local_indices(self, step: int) -> np.ndarray:
        """The rows of this process's slice of the global batch of ``step``."""
        return self.order.rows_at(local_positions(self.schedule, step, self.process_index, self.process_count))

    def batch(self, step: int) -> LmBatch:
        """This process's slice of the global batch for ``step`` (reads only those rows)."""
        return self.order.dataset.get_many(self.local_indices(step))


class ScheduledMixtureSource(MixtureBatchSource):
    """A mixture's batches under a batch-size schedule: the mixture's draw by position (built with
    batch size 1, its phases given at their rows), step ``k`` reading positions
    ``schedule.positions(k)``; reading and mixing the components' rows is the mixture's own
    (:meth:`MixtureBatchSource.batch` over :meth:`local_rows`). Made by :func:`scheduled_mixture`."""

    def __init__(self, datasets: Mapping[str, Any], phases: Any, schedule: BatchSchedule, seed: int, *,
                 process_index: int = 0, process_count: int = 1, **kwargs: Any):
        check_processes(schedule, process_count)
        super().__init__(datasets, phases, 1, seed, **kwargs)  # positions are rows: batch size 1
        self.batch_size = None  # no one batch size (a prefetcher's global rows are inferred)
        self.schedule = schedule
        self.process_index, self.process_count = process_index, process_count

    @property
    def local_batch_size(self) -> int:
        raise AttributeError("a batch-size schedule has no one batch size: use schedule.batch_size_at(step)")

    @property
    def num_steps(self) -> int | None:
        """Full steps under the stop strategy (None: no end, ``restart``)."""
        rows, _ = self.length()
        return None if rows is None else self.schedule.full_steps_within(rows)

    def global_rows(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        self._check_step(step)
        return self.rows_at(self.schedule.positions(step))

    def local_rows(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        self._check_step(step)
        return self.rows_at(local_positions(self.schedule, step, self.process_index, self.process_count))


def scheduled_mixture(cfg: Any, datasets: Mapping[str, Any], schedule: BatchSchedule, seed: int, *,
                      process_index: int = 0, process_count: int = 1) -> ScheduledMixtureSource:
    """The batches of data section ``cfg``'s mixture under a batch-size schedule; the phases of
    ``train_weights`` given at step ``s`` start at row ``schedule.offset_at(s)`` (Levanter's
    rescaling of a mixture's schedule to a batch schedule)."""
    ordered = {name: datasets[name] for name in cfg.configs if name in datasets}
    phases = [(schedule.offset_at(step), {n: w for n, w in weights.items() if n in ordered or w > 0})
              for step, weights in weight_phases(cfg.train_weights)[0]]
    return ScheduledMixtureSource(ordered, phases, schedule, seed, process_index=process_index,
                                  process_count=process_count, block_size=cfg.mixture_block_size,
                                  stop_strategy=cfg.stop_strategy, shuffle=cfg.shuffle, era_length=cfg.era_length)
