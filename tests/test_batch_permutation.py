"""The epoch permutation of large datasets is computed per position (no O(rows) array) and is a
bijection; small datasets keep their stored permutation (their batches are unchanged)."""

from __future__ import annotations

import numpy as np
import pytest

import lm_pipeline.batch as batch_mod
from lm_pipeline.batch import ArrayDataset, StepBatchSource, _feistel_permute, epoch_permutation


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4097, 65_537])
def test_feistel_permutation_is_a_bijection(n):
    perm = _feistel_permute(n, seed=3, epoch=1, positions=np.arange(n))
    assert perm.dtype == np.int64
    np.testing.assert_array_equal(np.sort(perm), np.arange(n))


def test_feistel_permutation_depends_on_seed_and_epoch_and_shuffles():
    n = 10_000
    a = _feistel_permute(n, 0, 0, np.arange(n))
    assert not np.array_equal(a, _feistel_permute(n, 0, 1, np.arange(n)))
    assert not np.array_equal(a, _feistel_permute(n, 1, 0, np.arange(n)))
    np.testing.assert_array_equal(a, _feistel_permute(n, 0, 0, np.arange(n)))
    # a shuffle, not a near-identity: neighbours land far apart, and the first rows are not early
    assert np.median(np.abs(np.diff(a))) > n / 10
    assert np.abs(np.corrcoef(np.arange(n), a)[0, 1]) < 0.05
    # any subset of positions gives the same rows as the whole permutation
    pos = np.array([9_999, 0, 17, 17, 5_000])
    np.testing.assert_array_equal(_feistel_permute(n, 0, 0, pos), a[pos])


def test_small_datasets_keep_the_stored_permutation():
    n = 23
    rng = np.random.Generator(np.random.PCG64([5, 2, 0x5EED]))
    np.testing.assert_array_equal(epoch_permutation(n, 5, 2), rng.permutation(n))


def test_large_dataset_batches_cover_each_epoch_once_without_a_stored_permutation(monkeypatch):
    monkeypatch.setattr(batch_mod, "MATERIALIZED_PERMUTATION_MAX_ROWS", 50)
    seq, rows = 4, 203
    ds = ArrayDataset(np.arange(rows * seq), seq)
    src = StepBatchSource(ds, 7, seed=11)
    steps = 2 * rows // 7 + 1
    flat = np.concatenate([src.global_indices(k) for k in range(steps)])
    np.testing.assert_array_equal(np.sort(flat[:rows]), np.arange(rows))  # epoch 0: every row once
    np.testing.assert_array_equal(np.sort(flat[rows : 2 * rows]), np.arange(rows))  # epoch 1
    np.testing.assert_array_equal(flat[:rows], epoch_permutation(rows, 11, 0))
    assert not src._perm_cache  # nothing O(rows) kept
    # host slices still partition the global batch
    hosts = [StepBatchSource(ds, 8, seed=11, process_index=i, process_count=2) for i in range(2)]
    for k in (0, 25, 26):
        np.testing.assert_array_equal(np.concatenate([h.local_indices(k) for h in hosts]), hosts[0].global_indices(k))
        b = hosts[1].batch(k)
        np.testing.assert_array_equal(b.tokens[:, 0] // seq, hosts[1].local_indices(k))


def test_few_and_many_positions_give_the_same_rows():
    n = 1_234_567
    pos = np.random.default_rng(0).integers(0, n, 5000)
    many = _feistel_permute(n, 7, 3, pos)
    few = np.concatenate([_feistel_permute(n, 7, 3, pos[i : i + 8]) for i in range(0, len(pos), 8)])
    np.testing.assert_array_equal(many, few)
