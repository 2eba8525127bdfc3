"""Loader: cache-backed rows, step-indexed batches, resumption, host slices, prefetch."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from helpers.data import sample_texts, tiny_tokenizer

from lm_pipeline.batch import ArrayDataset, LmBatch, StepBatchSource
from lm_pipeline.data.cache import build_cache, open_cache
from lm_pipeline.data.loader import CacheDataset, Prefetcher, make_batch_source, open_dataset
from lm_pipeline.data.textshard import TextShard

T = 16


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    base = tmp_path_factory.mktemp("loader")
    tokdir = tiny_tokenizer(str(base / "tok"))
    shards = [TextShard(f"s{i}", tuple(sample_texts(25, seed=10 + i))) for i in range(4)]
    build_cache(str(base / "cache"), shards, tokdir, num_workers=1, progress=False)
    return open_cache(str(base / "cache"))


def _eq(a: LmBatch, b: LmBatch) -> None:
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    if a.segment_ids is None:
        assert b.segment_ids is None
    else:
        np.testing.assert_array_equal(np.asarray(a.segment_ids), np.asarray(b.segment_ids))


def test_concat_rows_are_the_token_stream(cache):
    ds = CacheDataset(cache, T, "concat")
    stream = cache.read_tokens(0, cache.num_tokens)
    assert len(ds) == cache.num_tokens // T
    rows = np.array([3, 0, len(ds) - 1, 3])
    batch = ds.get_many(rows)
    assert batch.tokens.dtype == np.int32 and batch.tokens.shape == (4, T) and batch.segment_ids is None
    for i, r in enumerate(rows):
        np.testing.assert_array_equal(batch.tokens[i], stream[r * T : (r + 1) * T])


@pytest.mark.parametrize("packing", ["greedy", "first_fit"])
def test_packed_rows_hold_whole_documents_once(cache, packing):
    ds = CacheDataset(cache, T, packing)
    batch = ds.get_many(np.arange(len(ds)))
    off = cache.doc_offsets
    stream = cache.read_tokens(0, cache.num_tokens)
    pieces = []
    for r in range(len(ds)):
        seg, toks = batch.segment_ids[r], batch.tokens[r]
        starts, lens = ds.layout.row_pieces(r)
        for k, (s, n) in enumerate(zip(starts, lens, strict=True)):
            sel = seg == k + 1
            assert sel.sum() == n
            np.testing.assert_array_equal(toks[sel], stream[s : s + n])  # a document's piece, intact
            d = np.searchsorted(off, s, side="right") - 1
            assert s + n <= off[d + 1]  # never crossing into the next document
            pieces.append(np.arange(s, s + n))
        assert np.all(toks[seg == 0] == ds.pad_id)
    np.testing.assert_array_equal(np.sort(np.concatenate(pieces)), np.arange(cache.num_tokens))


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_step_k_is_the_same_from_scratch_or_resumed(cache, packing):
    ds = CacheDataset(cache, T, packing)
    run = StepBatchSource(ds, 8, seed=7)
    straight = [run.batch(k) for k in range(12)]  # crosses epoch boundaries
    resumed = StepBatchSource(open_dataset(cache.location, T, packing), 8, seed=7)  # fresh process state
    for k in (11, 5, 0, 9):
        _eq(resumed.batch(k), straight[k])
    other_seed = StepBatchSource(ds, 8, seed=8)
    assert not np.array_equal(other_seed.batch(0).tokens, straight[0].tokens)


def test_epochs_cover_all_rows_and_reshuffle(cache):
    ds = CacheDataset(cache, T, "greedy")
    n = len(ds)
    src = StepBatchSource(ds, 4, seed=0)
    flat = np.concatenate([src.global_indices(k) for k in range(-(-2 * n // 4) + 1)])
    e0, e1 = flat[:n], flat[n : 2 * n]
    np.testing.assert_array_equal(np.sort(e0), np.arange(n))
    np.testing.assert_array_equal(np.sort(e1), np.arange(n))
    assert not np.array_equal(e0, e1)


@pytest.mark.parametrize("packing", ["concat", "greedy"])
def test_two_hosts_see_exactly_the_global_batch(cache, packing):
    ds = CacheDataset(cache, T, packing)
    world = StepBatchSource(ds, 8, seed=3)
    hosts = [make_batch_source(ds, 8, 3, process_index=i, process_count=2) for i in range(2)]
    for step in (0, 1, 7, 20):
        idx = [h.local_indices(step) for h in hosts]
        assert len(idx[0]) == len(idx[1]) == 4
        assert not set(idx[0].tolist()) & set(idx[1].tolist())  # no overlap
        np.testing.assert_array_equal(np.concatenate(idx), world.global_indices(step))
        parts = [h.batch(step) for h in hosts]
        glob = world.batch(step)
        _eq(LmBatch(np.concatenate([p.tokens for p in parts]),
                    None if glob.segment_ids is None else np.concatenate([p.segment_ids for p in parts])), glob)
    with pytest.raises(ValueError, match="divisible"):
        StepBatchSource(ds, 7, 0, process_index=0, process_count=2)


def test_each_host_reads_only_its_rows(cache):
    ds = CacheDataset(cache, T, "concat")
    seen: list[np.ndarray] = []
    real = ds.get_many

    def spy(indices):
        seen.append(np.asarray(indices))
        return real(indices)

    ds.get_many = spy  # type: ignore[method-assign]
    host1 = StepBatchSource(ds, 8, 0, process_index=1, process_count=2)
    host1.batch(4)
    np.testing.assert_array_equal(seen[0], StepBatchSource(ds, 8, 0).global_indices(4)[4:])


@pytest.mark.parametrize("start", [0, 5])
def test_prefetch_yields_the_direct_batches(cache, start):
    src = StepBatchSource(CacheDataset(cache, T, "first_fit"), 4, seed=1)
    with Prefetcher(src, start_step=start, num_steps=6, depth=3) as pf:
        got = list(pf)
    assert [s for s, _ in got] == list(range(start, start + 6))
    for step, batch in got:
        _eq(batch, src.batch(step))
    assert len(pf.stats.waits) == 6 and len(pf.stats.loads) == 6
    assert pf.stats.summary()["steps"] == 6


def test_prefetch_device_put_and_threads(cache):
    src = StepBatchSource(CacheDataset(cache, T, "greedy"), 4, seed=2)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with Prefetcher(src, 3, num_steps=5, depth=2, threads=2, sharding=sharding) as pf:
        for step, batch in pf:
            assert isinstance(batch.tokens, jax.Array) and batch.tokens.sharding == sharding
            _eq(batch, src.batch(step))


def test_prefetch_propagates_errors_and_stops():
    class Flaky:
        def batch(self, step):
            if step == 2:
                raise RuntimeError("disk on fire")
            return LmBatch(np.full((1, 2), step, np.int32))

    pf = Prefetcher(Flaky(), 0, depth=2)
    assert next(pf)[0] == 0 and next(pf)[0] == 1
    with pytest.raises(RuntimeError, match="disk on fire"):
        next(pf)
    with pytest.raises(StopIteration):
        next(pf)


def test_step_source_is_thread_safe_across_epochs():
    ds = ArrayDataset(np.arange(10 * 4), 4)  # 10 rows: epochs turn every 2.5 steps
    src = StepBatchSource(ds, 4, seed=0)
    want = {k: StepBatchSource(ds, 4, seed=0).batch(k).tokens for k in range(40)}
    errors = []

    def work(ks):
        for k in ks:
            if not np.array_equal(src.batch(k).tokens, want[k]):
                errors.append(k)

    threads = [threading.Thread(target=work, args=(range(i, 40, 4),)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
