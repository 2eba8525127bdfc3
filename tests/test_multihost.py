"""A two-process jax.distributed run on loopback trains exactly like one process on the same global batch.

``tests/scripts/multihost_equivalence.py`` runs the same 5-step f32 training (same config, data and
seed) once as one process and once as two processes with one CPU device each (gloo collectives).
Each process records the rows that reached its device at every train and eval step. The test
checks that process p was fed rows ``[p*B/P, (p+1)*B/P)`` of the global batch, computed here from
the epoch permutations, and that per-step training losses, eval losses and final parameters
equal the one-process run's. Rows differ in loss (different alphabets), so a process that reads
another process's rows changes the loss, and one that reads the right rows at the wrong place
in the batch fails the row check.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lm_pipeline.batch import epoch_permutation

SCRIPT = Path(__file__).resolve().parent / "scripts" / "multihost_equivalence.py"
TIMEOUT_S = 300
NPROC = 2

_spec = importlib.util.spec_from_file_location("multihost_equivalence", SCRIPT)
mh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mh)  # the script's data and sizes; its run is under __main__ only


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # no forced host device count
    env["JAX_PLATFORMS"] = "cpu"
    # Compilation dominates: with LLVM optimisation off XLA:CPU compiled the init in 5 s instead of
    # 22 and the train step in 8 s instead of 18 (2 loaded cores). The tiny model's run time does
    # not matter, and both runs use the same flag.
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    return env


def _start(out: Path, nproc: int, coordinator: str | None = None) -> list[subprocess.Popen]:
    out.mkdir()
    extra = [coordinator] if coordinator else []
    procs = []
    for p in range(nproc):
        # Output to a file, not a pipe that nobody reads while the processes run.
        with open(out / f"console-{p}.txt", "w") as log:
            procs.append(subprocess.Popen([sys.executable, str(SCRIPT), str(out), str(nproc), str(p), *extra],
                                          env=_env(), stdout=log, stderr=subprocess.STDOUT))
    return procs


def _finish(procs: list[subprocess.Popen], deadline: float) -> None:
    """Wait for all; if one fails or the time runs out, kill the rest (a lone distributed process
    would wait for its peer until jax.distributed's own timeouts) and show their output."""
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    if any(p.returncode for p in procs):
        logs = "\n".join(f"--- {Path(p.args[2]).name} process {p.args[4]} rc={p.returncode}:\n"
                         f"{(Path(p.args[2]) / f'console-{p.args[4]}.txt').read_text()[-3000:]}" for p in procs)
        pytest.fail(f"training processes failed or timed out after {TIMEOUT_S} s:\n{logs}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(one-process record, [record of process p], one-process params, two-process params,
    the two-process run's metrics log)."""
    tmp = tmp_path_factory.mktemp("multihost")
    # All three processes at once: the start-up and compilation of one run overlap the other's.
    procs = _start(tmp / "one", 1) + _start(tmp / "two", NPROC, f"127.0.0.1:{_free_port()}")
    _finish(procs, time.monotonic() + TIMEOUT_S)

    def record(run, p):
        return json.loads((tmp / run / f"process-{p}.json").read_text())

    def params(run):
        with np.load(tmp / run / "params.npz") as z:
            return [z[f"arr_{i}"] for i in range(len(z.files))]

    log = [json.loads(line) for line in (tmp / "two" / "run" / "metrics.jsonl").read_text().splitlines()]
    return record("one", 0), [record("two", p) for p in range(NPROC)], params("one"), params("two"), log


def _row_ids(tokens, rows: np.ndarray) -> list[int]:
    """Dataset row ids of fed token rows (rows are distinct), so failures name rows, not tokens."""
    index = {r.tobytes(): i for i, r in enumerate(rows)}
    return [index.get(np.asarray(t, np.int32).tobytes(), -1) for t in tokens]


def _expected_train_rows(step: int, num_rows: int) -> list[int]:
    """Global batch of ``step`` from the epoch permutations (not through StepBatchSource)."""
    flat = np.arange(step * mh.BATCH, (step + 1) * mh.BATCH)
    return [int(epoch_permutation(num_rows, mh.CONFIG["trainer.seed"], e)[o]) for e, o in zip(*np.divmod(flat, num_rows), strict=True)]


def _check_fed(recs: list[dict], kind: str, expected: list[list[int]], rows: np.ndarray) -> None:
    """Process p's device got rows [p*B/P, (p+1)*B/P) of each global batch, at that offset."""
    per = mh.BATCH // len(recs)
    for p, rec in enumerate(recs):
        fed = rec["fed"][kind]
        assert len(fed) == len(expected), (kind, p, len(fed))
        for k, (shards, want) in enumerate(zip(fed, expected, strict=True)):
            (shard,) = shards  # one device per process
            got = _row_ids(shard["tokens"], rows)
            assert (shard["offset"], got) == (p * per, want[p * per : (p + 1) * per]), \
                f"{kind} batch {k}: process {p} fed rows {got} at offset {shard['offset']}; global batch {want}"


def test_each_process_feeds_its_own_slice(runs):
    one, two, _, _, _ = runs
    train_rows, eval_rows = (ds.rows for ds in mh.datasets())
    train_expected = [_expected_train_rows(k, len(train_rows)) for k in range(mh.STEPS)]
    # The one-process run reads the whole global batch: checks the expectation itself.
    _check_fed([one], "train", train_expected, train_rows)
    _check_fed(two, "train", train_expected, train_rows)
    # Eval reads its rows in order, batch b = rows [b*B, (b+1)*B), at every eval.
    batches = len(eval_rows) // mh.BATCH
    eval_expected = [list(range(b * mh.BATCH, (b + 1) * mh.BATCH)) for b in range(batches)] * len(one["eval"])
    _check_fed([one], "eval", eval_expected, eval_rows)
    _check_fed(two, "eval", eval_expected, eval_rows)


def test_two_processes_train_like_one(runs):
    one, two, params_one, params_two, _ = runs
    assert (one["processes"], one["devices"]) == (1, 1)
    assert all((r["process"], r["processes"], r["devices"]) == (p, NPROC, NPROC) for p, r in enumerate(two))
    steps = list(range(1, mh.STEPS + 1))
    assert one["loss_steps"] == steps and all(r["loss_steps"] == steps for r in two)
    for p, r in enumerate(two):
        np.testing.assert_allclose(r["losses"], one["losses"], rtol=0, atol=1e-5, err_msg=f"train loss, process {p}")
        assert [e["step"] for e in r["eval"]] == [e["step"] for e in one["eval"]] == [2, 4, 5]
        np.testing.assert_allclose([e["loss"] for e in r["eval"]], [e["loss"] for e in one["eval"]], rtol=0,
                                   atol=1e-5, err_msg=f"eval loss, process {p}")
    assert len(params_two) == len(params_one)
    for i, (a, b) in enumerate(zip(params_two, params_one, strict=True)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=f"parameter leaf {i}")
    # the comparison has teeth: the model moved
    assert one["losses"][-1] < one["losses"][0] - 0.1


def test_only_process_zero_writes_the_run_log(runs):
    one, two, *_, log = runs
    assert [len(r["log_writers"]) for r in two] == [1, 0], "process 0 writes the metrics log, the others none"
    steps = [r["step"] for r in log if "train/loss" in r]
    assert steps == list(range(1, mh.STEPS + 1)), f"each step's metrics once, by one process: {steps}"
    np.testing.assert_allclose([r["train/loss"] for r in log if "train/loss" in r], one["losses"], rtol=0, atol=1e-5)
