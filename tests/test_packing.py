"""Packing layouts: every token placed once, rows fit, segment ids, determinism, stored beside the cache."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from helpers.data import sample_texts, tiny_tokenizer

from lm_pipeline.data import packing
from lm_pipeline.data.cache import build_cache, open_cache
from lm_pipeline.data.packing import PackedLayout, open_packing, pack_documents, split_pieces
from lm_pipeline.data.textshard import TextShard


def _reference_rows(lens: list[int], T: int, strategy: str) -> list[list[int]]:
    """Piece indices per row, by the textbook definitions (quadratic, for checking)."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i, n in enumerate(lens):
        if strategy == "greedy":
            target = len(rows) - 1 if rows and free[-1] >= n else None
        else:
            target = next((r for r, f in enumerate(free) if f >= n), None)
        if target is None:
            rows.append([])
            free.append(T)
            target = len(rows) - 1
        rows[target].append(i)
        free[target] -= n
    return rows


def _random_docs(rng: np.random.Generator, T: int) -> np.ndarray:
    lens = rng.integers(1, 3 * T + 2, size=int(rng.integers(1, 60)))
    lens[rng.random(len(lens)) < 0.2] = T  # exactly seq_len
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


def _layout(offsets: np.ndarray, T: int, strategy: str) -> PackedLayout:
    return PackedLayout(strategy, T, **pack_documents(offsets, T, strategy))


@pytest.mark.parametrize("strategy", ["greedy", "first_fit"])
def test_whole_documents_each_piece_once_rows_fit(strategy):
    rng = np.random.default_rng(0)
    for T in (1, 4, 16, 33):
        for _ in range(15):
            offsets = _random_docs(rng, T)
            lay = _layout(offsets, T, strategy)
            starts, lens = split_pieces(offsets, T)
            # pieces: seq_len-sized except each document's remainder, never crossing documents
            doc_of = np.searchsorted(offsets, starts, side="right") - 1
            assert np.all(starts + lens <= offsets[doc_of + 1])
            assert np.all((lens == T) | (starts + lens == offsets[doc_of + 1]))
            # every piece exactly once, hence every token exactly once
            got = sorted(zip(lay.piece_start.tolist(), lay.piece_len.tolist(), strict=True))
            assert got == sorted(zip(starts.tolist(), lens.tolist(), strict=True))
            covered = np.concatenate([np.arange(s, s + n) for s, n in got])
            np.testing.assert_array_equal(np.sort(covered), np.arange(offsets[-1]))
            # no row longer than seq_len, no empty row
            per_row = np.add.reduceat(lay.piece_len.astype(np.int64), lay.row_ptr[:-1])
            assert per_row.max() <= T and np.all(np.diff(lay.row_ptr) >= 1)
            # placement is exactly next-fit / first-fit
            ref = _reference_rows(lens.tolist(), T, strategy)
            mine = [list(zip(*lay.row_pieces(r), strict=True)) for r in range(lay.num_rows)]
            assert mine == [[(int(starts[i]), int(lens[i])) for i in row] for row in ref]


def test_first_fit_is_denser_than_greedy():
    rng = np.random.default_rng(1)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(1, 300, size=2000))])
    g, f = _layout(offsets, 256, "greedy"), _layout(offsets, 256, "first_fit")
    assert f.num_rows < g.num_rows and f.fill > g.fill
    assert f.num_tokens == g.num_tokens == offsets[-1]


def test_concat_chunks_all_tokens_once():
    offsets = np.array([0, 5, 6, 30, 31, 47], np.int64)
    lay = _layout(offsets, 8, "concat")
    assert lay.num_rows == 47 // 8
    plan = lay.plan(np.arange(lay.num_rows))
    assert plan.segment_ids is None
    covered = np.concatenate([np.arange(s, s + n) for s, n in zip(plan.run_start, plan.run_len, strict=True)])
    np.testing.assert_array_equal(covered, np.arange(lay.num_rows * 8))  # each token once, in order


@pytest.mark.parametrize("strategy", ["greedy", "first_fit"])
def test_segment_ids(strategy):
    rng = np.random.default_rng(2)
    T = 16
    offsets = _random_docs(rng, T)
    lay = _layout(offsets, T, strategy)
    rows = rng.permutation(lay.num_rows)
    plan = lay.plan(rows)
    seg = plan.segment_ids
    assert seg.shape == (len(rows), T) and seg.dtype == np.int32
    runs = iter(zip(plan.run_start.tolist(), plan.run_len.tolist(), strict=True))
    for i, r in enumerate(rows):
        starts, lens = lay.row_pieces(r)
        n = int(lens.sum())
        assert plan.row_len[i] == n
        # ids 1..k, one per piece (document), in order; 0 only as trailing padding
        np.testing.assert_array_equal(seg[i, :n], np.repeat(np.arange(1, len(lens) + 1), lens))
        assert np.all(seg[i, n:] == 0)
        # the runs of this row cover exactly its pieces' tokens, in order
        want = np.concatenate([np.arange(s, s + k) for s, k in zip(starts, lens, strict=True)])
        got = []
        while sum(len(x) for x in got) < n:
            s, k = next(runs)
            got.append(np.arange(s, s + k))
        np.testing.assert_array_equal(np.concatenate(got), want)


@pytest.mark.parametrize("strategy", ["concat", "greedy", "first_fit"])
def test_deterministic(strategy):
    offsets = _random_docs(np.random.default_rng(3), 32)
    a, b = pack_documents(offsets, 32, strategy), pack_documents(offsets.copy(), 32, strategy)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_layout_stored_beside_cache_and_seq_len_change_never_retokenizes(tmp_path, monkeypatch):
    tokdir = tiny_tokenizer(str(tmp_path / "tok"))
    shards = [TextShard(f"s{i}", tuple(sample_texts(20, seed=i))) for i in range(3)]
    out = tmp_path / "cache"
    build_cache(str(out), shards, tokdir, num_workers=1, progress=False)
    cache = open_cache(str(out))
    data_files = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and "packing" not in p.parts}

    first = open_packing(cache, 16, "first_fit")
    meta = json.loads((out / "packing" / "first_fit-16" / "layout.json").read_text())
    assert meta["cache_identity"] == cache.identity and meta["num_rows"] == first.num_rows
    assert meta["num_tokens"] == cache.num_tokens  # whole documents: every token somewhere

    def no_rebuild(*a, **k):
        raise AssertionError("layout rebuilt although stored")

    with monkeypatch.context() as m:
        m.setattr(packing, "build_packing", no_rebuild)
        again = open_packing(cache, 16, "first_fit")
    np.testing.assert_array_equal(again.piece_start, first.piece_start)
    np.testing.assert_array_equal(again.row_ptr, first.row_ptr)

    for T in (8, 32):
        for strategy in ("concat", "greedy"):
            lay = open_packing(cache, T, strategy)
            assert (out / "packing" / f"{strategy}-{T}" / "layout.json").exists()
            assert lay.seq_len == T
    assert sorted(os.listdir(out / "packing")) == ["concat-32", "concat-8", "first_fit-16", "greedy-32", "greedy-8"]
    # the cache itself was not touched
    assert {p: p.stat().st_mtime_ns for p in data_files} == data_files

    # a layout derived from another cache (identity differs) is rebuilt, not trusted
    meta["cache_identity"] = "somewhere-else"
    (out / "packing" / "first_fit-16" / "layout.json").write_text(json.dumps(meta))
    rebuilt = open_packing(cache, 16, "first_fit")
    np.testing.assert_array_equal(rebuilt.piece_start, first.piece_start)
    assert json.loads((out / "packing" / "first_fit-16" / "layout.json").read_text())["cache_identity"] == cache.identity


def test_bad_arguments():
    with pytest.raises(ValueError, match="strategy"):
        pack_documents(np.array([0, 3]), 4, "best_fit")
    with pytest.raises(ValueError, match="seq_len"):
        pack_documents(np.array([0, 3]), 0, "greedy")
    lay = _layout(np.array([0, 3, 9]), 4, "greedy")
    with pytest.raises(IndexError):
        lay.plan(np.array([lay.num_rows]))


def test_greedy_scan_in_chunks_matches_the_definition(monkeypatch):
    monkeypatch.setattr(packing, "_CHUNK", 7)  # many chunk boundaries inside rows
    monkeypatch.setattr(packing, "_DOC_CHUNK", 3)
    rng = np.random.default_rng(5)
    for T in (4, 16):
        offsets = _random_docs(rng, T)
        lay = _layout(offsets, T, "greedy")
        _, piece_len = split_pieces(offsets, T)
        ref = _reference_rows(piece_len.tolist(), T, "greedy")
        assert np.diff(lay.row_ptr).tolist() == [len(r) for r in ref]


def test_stored_layout_is_memory_mapped_and_checked(tmp_path):
    tokdir = tiny_tokenizer(str(tmp_path / "tok"))
    out = tmp_path / "cache"
    build_cache(str(out), [TextShard("s", tuple(sample_texts(80, seed=3)))], tokdir, num_workers=1, progress=False)
    cache = open_cache(str(out))
    want = pack_documents(cache.doc_offsets, 16, "greedy")
    for _ in range(2):  # derived, then opened from the files
        lay = open_packing(cache, 16, "greedy")
        for name, arr in want.items():
            got = getattr(lay, name)
            assert isinstance(got, np.memmap) and got.dtype == arr.dtype
            np.testing.assert_array_equal(got, arr)
    d = out / "packing" / "greedy-16"
    assert sorted(os.listdir(d)) == ["layout.json", "piece_len.npy", "piece_start.npy", "row_ptr.npy"]
    data = bytearray((d / "piece_start.npy").read_bytes())
    data[-1] ^= 1  # damaged: not trusted, derived again
    (d / "piece_start.npy").write_bytes(bytes(data))
    np.testing.assert_array_equal(open_packing(cache, 16, "greedy").piece_start, want["piece_start"])
    with pytest.raises(FileNotFoundError):
        (d / "row_ptr.npy").unlink()
        open_packing(cache, 16, "greedy", create=False)
