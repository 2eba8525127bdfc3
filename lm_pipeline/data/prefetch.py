"""Background prefetch of step-indexed batches: :class:`Prefetcher` loads upcoming steps on
background threads (``depth`` steps ahead) and yields ``(step, batch)`` in order from any start
step; its :class:`PrefetchStats` record how long the consumer (the training loop, i.e. the device)
waited for data. With a ``sharding`` it assembles the global ``jax.Array`` of a multi-process run
with ``jax.make_array_from_process_local_data``, each host contributing its slice."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lm_pipeline.batch import LmBatch, device_put_batch


@dataclass
class PrefetchStats:
    """Timings of a :class:`Prefetcher` (seconds).

    ``waits``: per consumed step, how long ``next()`` blocked, i.e. how long the training loop
    (and so the device, once its queued work ran out) waited for data. ``loads``: per produced
    step, the time to build the batch on the background thread (reading + device transfer).
    """

    waits: list[float] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)

    def summary(self, skip_first: int = 1) -> dict[str, float]:
        """Mean/max wait (first ``skip_first`` steps excluded: the pipeline is filling), mean load."""
        w = np.asarray(self.waits[skip_first:] or [0.0])
        ld = np.asarray(self.loads or [0.0])
        return {
            "steps": len(self.waits),
            "wait_mean_s": float(w.mean()),
            "wait_max_s": float(w.max()),
            "wait_total_s": float(np.sum(self.waits)),
            "steps_waiting_over_1ms": int((w > 1e-3).sum()),
            "load_mean_s": float(ld.mean()),
        }


class Prefetcher(Iterator[tuple[int, Any]]):
    """Yields ``(step, batch)`` for ``start_step, start_step + 1, ...``, loaded ahead in the background.

    Args:
        source: anything with ``batch(step) -> LmBatch`` (a :class:`StepBatchSource`).
        start_step: first step (a resumed run starts at its checkpoint's step; batches are the
            same as in an uninterrupted run because ``batch(k)`` is a pure function of ``k``).
        num_steps: how many steps to yield (None = unbounded).
        depth: steps loaded ahead of the consumer.
        threads: loader threads (1 = one background thread; more overlap several steps' reads).
        sharding: if given, batches are placed on devices: ``jax.device_put`` in a single
            process, ``jax.make_array_from_process_local_data`` in a multi-process run (each
            host contributes its slice of the global batch). Arrays are ready when yielded.
        put: alternatively, any function ``LmBatch -> T`` applied on the background thread.
    """

    def __init__(
        self,
        source: Any,
        start_step: int = 0,
        *,
        num_steps: int | None = None,
        depth: int = 2,
        threads: int = 1,
        sharding: Any = None,
        put: Callable[[LmBatch], Any] | None = None,
    ):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if sharding is not None and put is not None:
            raise ValueError("give sharding or put, not both")
        self.source = source
        self.stats = PrefetchStats()
        self._put = put if put is not None else (self._device_put if sharding is not None else None)
        self._sharding = sharding
        self._next = start_step
        self._end = None if num_steps is None else start_step + num_steps
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="lm-prefetch")
        self._pending: deque[Future] = deque()
        self._lock = threading.Lock()
        self._closed = False
        for _ in range(depth):
            self._submit()

    def _device_put(self, batch: LmBatch) -> LmBatch:
        import jax

        out = device_put_batch(batch, self._sharding, getattr(self.source, "batch_size", None))
        jax.block_until_ready([a for a in out if a is not None])
        return out

    def _load(self, step: int) -> tuple[int, Any]:
        t0 = time.perf_counter()
        batch = self.source.batch(step)
        if self._put is not None:
            batch = self._put(batch)
        self.stats.loads.append(time.perf_counter() - t0)
        return step, batch

    def _submit(self) -> None:
        if self._end is not None and self._next >= self._end:
            return
        self._pending.append(self._pool.submit(self._load, self._next))
        self._next += 1

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> tuple[int, Any]:
        with self._lock:
            if self._closed or not self._pending:
                raise StopIteration
            fut = self._pending.popleft()
            t0 = time.perf_counter()
            try:
                item = fut.result()
            except BaseException:
                self.close()
                raise
            self.stats.waits.append(time.perf_counter() - t0)
            self._submit()
            return item

    def close(self) -> None:
        """Stop loading; pending loads are cancelled (a running one finishes in the background)."""
        self._closed = True
        for f in self._pending:
            f.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()
