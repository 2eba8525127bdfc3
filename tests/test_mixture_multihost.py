"""A data mixture trained by two jax.distributed processes on loopback: each process is fed
exactly its slice of the rows the one-process run is fed, and both end at the same parameters.

The run is ``tests/scripts/multihost_equivalence.py`` with ``$MULTIHOST_MIXTURE=1``: the training
rows as two components (rows 0-11 and 12-19), weighed 3 : 1 and from step 2 on 1 : 1, in blocks
of 4 rows. The rows each device received are recorded by the script (the data itself); the
reference for the two processes is the one-process run, and for the mixture the counts of each
component per block (3 and 1, then 2 and 2), computed here.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import test_multihost as launcher  # starts the script's processes and waits for them

pytestmark = pytest.mark.slow  # three processes compile and train a tiny model: ~1 min

mh = launcher.mh


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mixture_multihost")
    before = os.environ.get("MULTIHOST_MIXTURE")
    os.environ["MULTIHOST_MIXTURE"] = "1"
    try:
        procs = launcher._start(tmp / "one", 1) + launcher._start(
            tmp / "two", launcher.NPROC, f"127.0.0.1:{launcher._free_port()}")
    finally:
        if before is None:
            del os.environ["MULTIHOST_MIXTURE"]
        else:
            os.environ["MULTIHOST_MIXTURE"] = before
    launcher._finish(procs, time.monotonic() + launcher.TIMEOUT_S)
    def record(run, p):
        return json.loads((tmp / run / f"process-{p}.json").read_text())

    def params(run):
        with np.load(tmp / run / "params.npz") as z:
            return [z[f"arr_{i}"] for i in range(len(z.files))]

    return record("one", 0), [record("two", p) for p in range(launcher.NPROC)], params("one"), params("two")


def test_two_processes_are_fed_the_one_process_rows_split_by_slice(runs):
    one, two, _, _ = runs
    rows = mh.datasets()[0].rows
    seen = [launcher._row_ids(step[0]["tokens"], rows) for step in one["fed"]["train"]]
    assert len(seen) == mh.STEPS and all(-1 not in step for step in seen)
    # the one-process run's batches hold each component's share of every block of 4 rows
    for k, step in enumerate(seen):
        a_rows = [int(r < mh.MIXTURE_SPLIT) for r in step]
        per_block = [sum(a_rows[i:i + 4]) for i in range(0, mh.BATCH, 4)]
        assert per_block == ([3, 3] if k < 2 else [2, 2]), (k, step)
    per = mh.BATCH // launcher.NPROC
    for p, rec in enumerate(two):
        for k, shards in enumerate(rec["fed"]["train"]):
            (shard,) = shards
            got = launcher._row_ids(shard["tokens"], rows)
            assert (shard["offset"], got) == (p * per, seen[k][p * per:(p + 1) * per]), (p, k)


def test_two_processes_train_the_mixture_like_one(runs):
    one, two, params_one, params_two = runs
    for p, r in enumerate(two):
        np.testing.assert_allclose(r["losses"], one["losses"], rtol=0, atol=1e-5, err_msg=f"train loss, process {p}")
    assert len(params_two) == len(params_one) > 0
    for i, (a, b) in enumerate(zip(params_two, params_one, strict=True)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=f"parameter leaf {i}")
