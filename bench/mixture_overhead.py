"""Per-step cost of a data mixture's sampler against a training step, on CPU.

Per shape (train_throughput.py's ``tiny``: batch 12 x 64 tokens, and ``medium``: 8 x 256):

* ``sampler``: :meth:`MixtureBatchSource.local_rows` for step k: which component, and which of
  its rows, each row of the step is. The mean over ``--steps`` consecutive steps, which cross
  blocks (each block's permutation is computed once, on the step that first reaches it), the
  phase change and components' epochs (a new permutation each).
* ``mixture batch``: :meth:`MixtureBatchSource.batch`: the same plus reading the rows from the
  components (in memory, so what is left is the gathering).
* ``one source``: :meth:`StepBatchSource.batch` over one dataset of all the rows: what a run
  without a mixture does per step. ``added`` = mixture batch - one source.
* ``train step``: the jitted training step of the shape (train_throughput.py's ``JaxRunner``,
  f32, one device): the median of timed windows after warm-up; or ``--step-time``.

The mixture: web / code / books of 50M / 5M / 500k rows (web and code above the size at which a
component's order is computed per position instead of stored), weights web 0.8 / code 0.2, then
from step 100 web 0.5 / code 0.3 / books 0.2; mixture_block_size 2048 (Levanter's default),
stop_strategy restart. The components hold no tokens: a row read is a row of zeros.

    python bench/mixture_overhead.py [--shapes tiny,medium] [--steps 4000] [--step-time tiny=0.03,medium=0.4]

The last line is ``RESULT {json}``: ``ratio`` is the largest sampler / train step over the shapes
(target < 0.01); ``ratio_batch`` the largest added / train step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
from common import host_info, host_line, loadavg  # noqa: E402
from train_throughput import SHAPES, JaxRunner  # noqa: E402

from lm_pipeline.batch import LmBatch, StepBatchSource  # noqa: E402
from lm_pipeline.data.mixture import MixtureBatchSource  # noqa: E402

COMPONENTS = {"web": 50_000_000, "code": 5_000_000, "books": 500_000}
WEIGHTS = [[0, {"web": 0.8, "code": 0.2}], [100, {"web": 0.5, "code": 0.3, "books": 0.2}]]
BLOCK = 2048
TARGET = 0.01


class Zeros:
    """A dataset of ``n`` rows of zeros (no memory: a row is made when read)."""

    def __init__(self, n: int, seq_len: int):
        self.n, self.seq_len = n, seq_len

    def __len__(self) -> int:
        return self.n

    def get_many(self, indices) -> LmBatch:
        return LmBatch(np.zeros((len(indices), self.seq_len), np.int32))


def per_step(fn, steps: int) -> tuple[float, float]:
    """(mean, max) seconds of ``fn(k)`` over steps 0 .. steps - 1."""
    times = []
    for k in range(steps):
        t0 = time.perf_counter()
        fn(k)
        times.append(time.perf_counter() - t0)
    return statistics.fmean(times), max(times)


def train_step_s(shape_name: str, windows: int = 5) -> float:
    """Median seconds per jitted training step of the shape (after compile and warm-up)."""
    runner = JaxRunner(SHAPES[shape_name], "f32")
    runner.run(3)  # compile + warm-up
    t0 = time.perf_counter()
    runner.run(2)
    n = max(2, int(2.0 / max((time.perf_counter() - t0) / 2, 1e-4)))  # about 2 s per window
    out = []
    for _ in range(windows):
        t0 = time.perf_counter()
        runner.run(n)
        out.append((time.perf_counter() - t0) / n)
    return statistics.median(out)


def bench_shape(shape_name: str, steps: int, step_s: float | None) -> dict:
    shape = SHAPES[shape_name]
    B, T = shape.batch, shape.ctx
    mixture = MixtureBatchSource({n: Zeros(rows, T) for n, rows in COMPONENTS.items()}, WEIGHTS, B, seed=0,
                                 block_size=BLOCK)
    sampler_mean, sampler_max = per_step(mixture.local_rows, steps)
    fresh = MixtureBatchSource({n: Zeros(rows, T) for n, rows in COMPONENTS.items()}, WEIGHTS, B, seed=0,
                               block_size=BLOCK)
    batch_mean, _ = per_step(fresh.batch, steps)
    single = StepBatchSource(Zeros(sum(COMPONENTS.values()), T), B, seed=0)
    single_mean, _ = per_step(single.batch, steps)
    measured = step_s is None
    if measured:
        step_s = train_step_s(shape_name)
    return {"batch": B, "seq_len": T, "steps": steps, "sampler_s": sampler_mean, "sampler_max_s": sampler_max,
            "mixture_batch_s": batch_mean, "one_source_batch_s": single_mean,
            "added_s": batch_mean - single_mean, "train_step_s": step_s, "train_step_measured": measured,
            "ratio": sampler_mean / step_s, "ratio_batch": (batch_mean - single_mean) / step_s}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="tiny,medium", help="comma-separated: tiny, medium")
    p.add_argument("--steps", type=int, default=4000, help="consecutive steps timed per shape")
    p.add_argument("--step-time", default="", help="train step seconds per shape instead of timing one, "
                   "e.g. tiny=0.03,medium=0.4")
    args = p.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in shapes:
        if s not in SHAPES:
            p.error(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    given = {k: float(v) for k, v in (item.split("=") for item in args.step_time.split(",") if item)}

    host = host_info()
    print(host_line(host))
    print(f"components {', '.join(f'{n} {r:,} rows' for n, r in COMPONENTS.items())}; weights {WEIGHTS}; "
          f"mixture_block_size {BLOCK}; {args.steps} steps per shape; load {loadavg():.1f}")
    results = {s: bench_shape(s, args.steps, given.get(s)) for s in shapes}

    print()
    print(f"{'shape':<7} {'batch':>8} {'sampler mean':>13} {'max':>9} {'mixture batch':>14} {'one source':>11} "
          f"{'added':>9} {'train step':>11} {'sampler/step':>13} {'added/step':>11}")
    for s, r in results.items():
        us = lambda x: f"{x * 1e6:,.0f} us"  # noqa: E731
        step = f"{r['train_step_s'] * 1e3:,.1f} ms" + ("" if r["train_step_measured"] else "*")
        print(f"{s:<7} {r['batch']:>3} x {r['seq_len']:<4} {us(r['sampler_s']):>13} {us(r['sampler_max_s']):>9} "
              f"{us(r['mixture_batch_s']):>14} {us(r['one_source_batch_s']):>11} {us(r['added_s']):>9} "
              f"{step:>11} {r['ratio']:>12.3%} {r['ratio_batch']:>10.3%}")
    if not all(r["train_step_measured"] for r in results.values()):
        print("* given with --step-time")
    ratio = max(r["ratio"] for r in results.values())
    print(f"\nsampler / train step: {ratio:.3%} at most (target < {TARGET:.0%})")
    print("RESULT " + json.dumps({"ratio": ratio, "ratio_batch": max(r["ratio_batch"] for r in results.values()),
                                  "target": TARGET, "shapes": results, **host}))


if __name__ == "__main__":
    main()
