"""Token cache built part by part: a shard much bigger than the part size is appended in bounded
parts (memory independent of the shard's size), with the same bytes as whole-shard appends."""

from __future__ import annotations

import json
import os
import random
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from helpers.data import EOS, sample_texts, tiny_tokenizer
from tokenizers import Tokenizer

from lm_pipeline.data import encode
from lm_pipeline.data.cache import CacheError, build_cache, open_cache
from lm_pipeline.data.cache.writer import Committer
from lm_pipeline.data.textshard import TextShard

PART_CHARS = 4096
PART_DOCS = 64


def tree(path: str | Path) -> dict[str, bytes]:
    root = Path(path)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            if p.name != ".build.lock"}


def ascii_docs(n_chars: int, seed: int) -> tuple[str, ...]:
    """ASCII documents of 0-3000 characters, ``n_chars`` in all (so a token is at most one char)."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "x", "foo_bar", "42", "lorem", "ipsum", "\n"]
    out, total = [], 0
    while total < n_chars:
        text = " ".join(rng.choice(words) for _ in range(rng.choice([0, 1, 5, 40, 200, 500])))
        out.append(text)
        total += len(text)
    return tuple(out)


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture
def small_parts(monkeypatch):
    monkeypatch.setattr(encode, "PART_CHARS", PART_CHARS)
    monkeypatch.setattr(encode, "PART_DOCS", PART_DOCS)


@pytest.fixture
def appends(monkeypatch):
    """The (tokens, docs, UTF-8 bytes) of every part the build appends."""
    seen: list[tuple[int, int, int]] = []
    original = Committer.append_part

    def record(self, part):
        seen.append((len(part.tokens), len(part.doc_lengths), int(part.doc_bytes.sum())))
        return original(self, part)

    monkeypatch.setattr(Committer, "append_part", record)
    return seen


def reference(tokdir: str, texts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, offsets and byte counts by the ``tokenizers`` library directly: each document
    encoded with its special tokens, then EOS (the tiny tokenizer has no post-processor)."""
    tok = Tokenizer.from_file(str(Path(tokdir, "tokenizer.json")))
    eos = tok.token_to_id(EOS)
    docs = [[*tok.encode(t, add_special_tokens=True).ids, eos] for t in texts]
    tokens = np.array([i for d in docs for i in d], np.uint32)
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    return tokens, offsets, np.array([len(t.encode("utf-8")) for t in texts], np.int64)


def test_big_shard_is_appended_in_bounded_parts_and_matches_the_tokenizer(tokdir, tmp_path, small_parts, appends):
    texts = ascii_docs(400_000, seed=3)  # ~100 parts of <= 4096 characters
    shards = [TextShard("small", tuple(sample_texts(20, seed=4))), TextShard("big", texts)]
    out = str(tmp_path / "c")
    build_cache(out, shards, tokdir, num_workers=1, shard_group_size=2, progress=False)
    cache = open_cache(out)
    big = cache.shards[1]
    assert big["docs"] == len(texts) and big["bytes"] == sum(map(len, texts))

    # (a) the arrays are the tokenizer's own encoding, document by document, + EOS
    tokens, offsets, nbytes = reference(tokdir, texts)
    t0, d0 = big["token_start"], big["doc_start"]
    np.testing.assert_array_equal(cache.read_tokens(t0, t0 + big["tokens"]), tokens)
    np.testing.assert_array_equal(cache.doc_offsets[d0:] - t0, offsets)
    np.testing.assert_array_equal(cache.doc_bytes[d0:], nbytes)

    # (b) every append is one bounded part: ASCII, so tokens <= characters + one EOS per document
    big_parts = appends[1:]
    assert len(big_parts) >= sum(map(len, texts)) // PART_CHARS
    assert sum(p[0] for p in big_parts) == big["tokens"]
    assert max(p[2] for p in big_parts) <= PART_CHARS  # no document here is longer than a part
    assert max(p[1] for p in big_parts) <= PART_DOCS
    assert max(p[0] for p in big_parts) <= PART_CHARS + PART_DOCS


def _traced_peak(tokdir: str, out: str, texts) -> int:
    shards = [TextShard("one", texts)]
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        build_cache(out, shards, tokdir, num_workers=1, progress=False)
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_memory_growth_does_not_follow_the_shard_size(tokdir, tmp_path, small_parts):
    small, large = ascii_docs(100_000, seed=5), ascii_docs(800_000, seed=6)
    peak_small = _traced_peak(tokdir, str(tmp_path / "s"), small)
    peak_large = _traced_peak(tokdir, str(tmp_path / "l"), large)
    large_ids = open_cache(str(tmp_path / "l")).num_tokens * 4
    # Python-side allocations (numpy arrays, id lists) at their peak: a whole shard's ids would be
    # 8x more for the large shard; parts keep the peak where it was for the small one.
    assert peak_large < 1.5 * peak_small + (1 << 20), (peak_small, peak_large)
    assert peak_large < large_ids / 2, (peak_large, large_ids)


@pytest.mark.timeout(180)
def test_parts_and_workers_do_not_change_the_bytes(tokdir, tmp_path, monkeypatch):
    texts = sample_texts(300, seed=7) + list(ascii_docs(60_000, seed=8))
    shards = [TextShard(f"s{i}", tuple(texts[i::5])) for i in range(5)] + [TextShard("empty", ())]
    ref = str(tmp_path / "ref")
    build_cache(ref, shards, tokdir, num_workers=1, shard_group_size=2, progress=False)  # one part a shard
    monkeypatch.setattr(encode, "PART_CHARS", 1000)
    monkeypatch.setattr(encode, "PART_DOCS", 7)
    for workers in (1, 2):
        out = str(tmp_path / f"w{workers}")
        build_cache(out, shards, tokdir, num_workers=workers, shard_group_size=2, progress=False)
        assert tree(out) == tree(ref), workers  # byte-identical, ledger included


class FlakyShard:
    """A big shard whose first read fails after many parts (``fail_file`` exists), then succeeds."""

    def __init__(self, texts, fail_file: str):
        self.name, self.fingerprint, self.texts, self.fail_file = "flaky", "f00d", texts, fail_file

    def iter_texts(self):
        for i, t in enumerate(self.texts):
            if i == len(self.texts) // 2 and Path(self.fail_file).exists():
                Path(self.fail_file).unlink()
                raise OSError("connection reset")
            yield t


@pytest.mark.parametrize("workers", [1, 2])
def test_a_shard_failing_midway_is_never_committed_and_resumes_identical(tokdir, tmp_path, small_parts, workers):
    good = [TextShard(f"g{i}", tuple(sample_texts(30, seed=10 + i))) for i in range(2)]
    texts = ascii_docs(100_000, seed=9)
    ref = str(tmp_path / "ref")
    build_cache(ref, [*good, FlakyShard(texts, str(tmp_path / "nofail"))], tokdir, num_workers=1,
                shard_group_size=2, progress=False)
    out, fail = str(tmp_path / "c"), tmp_path / "fail"
    fail.touch()
    shards = [*good, FlakyShard(texts, str(fail))]
    with pytest.raises(RuntimeError, match="flaky.*connection reset"):
        build_cache(out, shards, tokdir, num_workers=workers, shard_group_size=2, progress=False)
    partial = open_cache(out, require_complete=False)
    assert partial.ledger["committed"]["shards"] == 2 and not partial.complete
    assert [s["name"] for s in partial.shards] == ["g0", "g1"]
    written = json.loads(Path(out, "tokens", "zarr.json").read_text())["shape"][0]
    assert written > partial.num_tokens  # half the flaky shard was appended, past the committed counts
    build_cache(out, shards, tokdir, num_workers=workers, shard_group_size=2, progress=False)
    assert tree(out) == tree(ref)


def test_commit_refuses_a_partly_written_shard(tokdir, tmp_path):
    from lm_pipeline.data.cache.storage import CacheRoot
    from lm_pipeline.data.cache.writer import start_cache
    from lm_pipeline.data.encode import DocumentEncoder, tokenizer_info

    info = tokenizer_info(tokdir)
    ledger, arrays = start_cache(CacheRoot(str(tmp_path / "c")), info, {"num_shards": 1, "fingerprint": "x"})
    committer = Committer(CacheRoot(str(tmp_path / "c")), ledger, arrays)
    committer.append_part(DocumentEncoder(tokdir, info).encode_texts(["hello"]))
    with pytest.raises(CacheError, match="partly written"):
        committer.commit()


class DyingShard:
    """Kills the worker process that reads it."""

    name, fingerprint = "dying", "dead"

    def iter_texts(self):
        yield "some text"
        os._exit(3)


@pytest.mark.timeout(120)
def test_a_worker_that_dies_is_reported(tokdir, tmp_path):
    shards = [TextShard("ok", ("fine",)), DyingShard()]
    with pytest.raises(RuntimeError, match="dying.*worker process died.*exit code 3"):
        build_cache(str(tmp_path / "c"), shards, tokdir, num_workers=2, shard_group_size=1, progress=False)
    assert open_cache(str(tmp_path / "c"), require_complete=False).ledger["committed"]["shards"] == 1
