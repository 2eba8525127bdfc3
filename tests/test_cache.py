"""Token cache: determinism, crash-resume, commit visibility, tokenizer checks, EOS/BOS and bytes."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.data import EOS, sample_texts, tiny_tokenizer
from tokenizers import Tokenizer

from lm_pipeline import faultpoints
from lm_pipeline.data.cache import (
    CacheError,
    CacheIncompleteError,
    CacheMismatchError,
    CacheNotFoundError,
    build_cache,
    open_cache,
)
from lm_pipeline.data.encode import tokenizer_info
from lm_pipeline.data.textshard import TextShard

REPO = Path(__file__).resolve().parents[1]
GROUP = 2


def tree(path: str | Path) -> dict[str, bytes]:
    """Every file under ``path`` (relative name -> bytes)."""
    root = Path(path)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    base = tmp_path_factory.mktemp("corpus")
    texts = sample_texts(120, seed=1)
    texts[7] = f"text that mentions {EOS} literally, twice: {EOS}"
    shards = [TextShard(f"shard-{i:02d}", tuple(texts[i * 10 : (i + 1) * 10])) for i in range(12)]
    tokdir = tiny_tokenizer(str(base / "tok"))
    ref = str(base / "ref")
    build_cache(ref, shards, tokdir, num_workers=1, shard_group_size=GROUP, progress=False)
    return {"texts": texts, "shards": shards, "tokdir": tokdir, "ref": ref, "base": base}


def _builder(corpus, out: str, fault: str | None, workers: int = 1) -> subprocess.Popen:
    """A child process building the cache at ``out``; ``fault`` arms its fault points
    (``LM_PIPELINE_FAULTPOINT``); a paused point is reported in ``<out>.fault``."""
    args = corpus["base"] / f"args-{os.path.basename(out)}.pkl"
    args.write_bytes(pickle.dumps((corpus["shards"], corpus["tokdir"], out, workers, GROUP)))
    code = (
        "import pickle, sys\n"
        "from lm_pipeline.data.cache import build_cache\n"
        "shards, tokdir, out, workers, group = pickle.load(open(sys.argv[1], 'rb'))\n"
        "build_cache(out, shards, tokdir, num_workers=workers, shard_group_size=group, progress=False)\n"
        "print('DONE', flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in (faultpoints.ENV, faultpoints.ENV_ACTION, faultpoints.ENV_FILE):
        env.pop(name, None)
    if fault:
        env[faultpoints.ENV] = fault
        env[faultpoints.ENV_FILE] = f"{out}.fault"
    return subprocess.Popen([sys.executable, "-c", code, str(args)], stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def test_identical_regardless_of_workers_and_grouping(corpus, tmp_path):
    out = str(tmp_path / "c2")
    ledger = build_cache(out, corpus["shards"], corpus["tokdir"], num_workers=2, shard_group_size=5, progress=False)
    assert ledger["complete"]
    assert tree(out) == tree(corpus["ref"])  # byte-identical, ledger included


def test_ledger_and_content(corpus):
    cache = open_cache(corpus["ref"], expected_tokenizer_fingerprint=None, tokenizer_dir=corpus["tokdir"],
                       shards=corpus["shards"])
    texts, ledger = corpus["texts"], cache.ledger
    tok_json = Path(corpus["tokdir"], "tokenizer.json").read_bytes()
    assert cache.tokenizer_fingerprint == hashlib.sha256(tok_json).hexdigest()
    assert ledger["format_version"] == 1 and ledger["complete"]
    assert [s["name"] for s in ledger["shards"]] == [s.name for s in corpus["shards"]]
    assert [s["fingerprint"] for s in ledger["shards"]] == [s.fingerprint for s in corpus["shards"]]
    assert sum(s["docs"] for s in ledger["shards"]) == cache.num_docs == len(texts)
    assert sum(s["tokens"] for s in ledger["shards"]) == cache.num_tokens
    assert cache.num_bytes == sum(len(t.encode("utf-8")) for t in texts)
    np.testing.assert_array_equal(cache.doc_bytes, [len(t.encode("utf-8")) for t in texts])

    tok = Tokenizer.from_file(str(Path(corpus["tokdir"], "tokenizer.json")))
    eos = tok.token_to_id(EOS)
    assert cache.eos_id == eos
    all_tokens = cache.read_tokens(0, cache.num_tokens)
    off = cache.doc_offsets
    assert off[0] == 0 and off[-1] == cache.num_tokens and np.all(np.diff(off) >= 1)
    assert (all_tokens == eos).sum() == len(texts)  # exactly one EOS per document ...
    for i, text in enumerate(texts):
        doc = all_tokens[off[i] : off[i + 1]]
        assert doc[-1] == eos  # ... at its end
        assert tok.decode(doc[:-1].tolist(), skip_special_tokens=False) == text
    assert EOS in texts[7]  # the literal special-token string stayed text


@pytest.mark.parametrize("post", ["bos", "eos"])
def test_special_tokens_detected_not_assumed(tmp_path, post):
    tokdir = tiny_tokenizer(str(tmp_path / "tok"), post=post)
    info = tokenizer_info(tokdir)
    texts = ["hello", "", "naïve café"]
    build_cache(str(tmp_path / "c"), [TextShard("s", tuple(texts))], tokdir, num_workers=1, progress=False)
    cache = open_cache(str(tmp_path / "c"), tokenizer_dir=tokdir)
    eos = cache.eos_id
    for i in range(len(texts)):
        doc = cache.doc(i)
        assert doc[-1] == eos
        if post == "bos":
            assert info.prefix_ids == (eos,) and info.append_eos
            assert doc[0] == eos and (doc == eos).sum() == 2  # BOS kept, EOS appended once
        else:
            assert info.suffix_ids == (eos,) and not info.append_eos
            assert (doc == eos).sum() == 1  # the post-processor's EOS, not doubled


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point,npass,committed", [("after_commit", 2, 2 * GROUP), ("before_commit", 3, 2 * GROUP)])
def test_sigkill_midway_then_resume_is_identical(corpus, tmp_path, caplog, point, npass, committed):
    out = str(tmp_path / "c")
    proc = _builder(corpus, out, f"token_cache.{point}:{npass}:pause")
    try:
        deadline = time.time() + 90
        while not Path(f"{out}.fault").exists():
            assert proc.poll() is None and time.time() < deadline, "the builder never reached the fault point"
            time.sleep(0.05)
        assert Path(f"{out}.fault").read_text().split() == [f"token_cache.{point}", str(npass)]
        with pytest.raises(CacheError, match="another process"):  # one builder at a time
            build_cache(out, corpus["shards"], corpus["tokdir"], num_workers=1, progress=False)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    ledger = json.loads(Path(out, "ledger.json").read_text())
    assert ledger["committed"]["shards"] == committed and not ledger["complete"]
    assert not Path(out, "COMPLETE").exists()
    with pytest.raises(CacheIncompleteError):
        open_cache(out)
    partial = open_cache(out, require_complete=False)
    ref = open_cache(corpus["ref"])
    n = partial.num_tokens
    np.testing.assert_array_equal(partial.read_tokens(0, n), ref.read_tokens(0, n))
    stored = json.loads(Path(out, "tokens", "zarr.json").read_text())["shape"][0]
    if point == "before_commit":  # the killed group was written past the committed counts ...
        assert stored > n
    assert partial.tokens.shape[0] == n  # ... and readers do not see it
    with caplog.at_level("INFO", logger="lm_pipeline.data.cache"):
        build_cache(out, corpus["shards"], corpus["tokdir"], num_workers=1, shard_group_size=GROUP, progress=False)
    assert f"resuming the token cache build at shard {committed} of 12" in caplog.text  # not from scratch
    assert tree(out) == tree(corpus["ref"])


@pytest.mark.timeout(120)
def test_concurrent_reader_never_sees_partial_rows(corpus, tmp_path):
    out = str(tmp_path / "c")
    ref = open_cache(corpus["ref"])
    ref_tokens, ref_off, ref_bytes = ref.read_tokens(0, ref.num_tokens), ref.doc_offsets, ref.doc_bytes
    # Slow the build down around each commit so that the reader interleaves with it.
    proc = _builder(corpus, out, "token_cache.before_commit:*:sleep=0.15,token_cache.after_commit:*:sleep=0.05")
    seen = set()
    try:
        deadline = time.time() + 90
        while time.time() < deadline:
            finished = proc.poll() is not None
            try:
                snap = open_cache(out, require_complete=False)
            except CacheNotFoundError:
                continue
            d, n = snap.num_docs, snap.num_tokens
            assert snap.tokens.shape[0] == n  # reads are bounded by the committed count
            off = snap.doc_offsets
            np.testing.assert_array_equal(off, ref_off[: d + 1])
            assert off[-1] == n  # whole documents only
            np.testing.assert_array_equal(snap.read_tokens(0, n), ref_tokens[:n])
            np.testing.assert_array_equal(snap.doc_bytes, ref_bytes[:d])
            seen.add((snap.ledger["committed"]["shards"], snap.complete))
            if finished:
                break
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    partial_states = {s for s, done in seen if not done}
    assert len(partial_states) >= 2, seen  # the reader really saw the cache grow
    assert tree(out) == tree(corpus["ref"])


def test_mismatches_raise_clear_errors(corpus, tmp_path):
    other = tiny_tokenizer(str(tmp_path / "other_tok"), vocab_size=310)
    other_fp = tokenizer_info(other).fingerprint
    with pytest.raises(CacheMismatchError, match="tokenizer"):
        open_cache(corpus["ref"], other_fp)
    with pytest.raises(CacheMismatchError, match="tokenizer"):
        open_cache(corpus["ref"], tokenizer_dir=other)
    with pytest.raises(CacheMismatchError, match="shards"):
        open_cache(corpus["ref"], shards=corpus["shards"][:-1])
    with pytest.raises(CacheMismatchError, match="eos_id"):
        open_cache(corpus["ref"], expected_settings={"eos_id": 12345})
    open_cache(corpus["ref"], tokenizer_info(corpus["tokdir"]).fingerprint)  # the right one passes

    out = str(tmp_path / "c")
    build_cache(out, corpus["shards"][:2], corpus["tokdir"], num_workers=1, progress=False)
    with pytest.raises(CacheMismatchError, match="tokenizer"):
        build_cache(out, corpus["shards"][:2], other, num_workers=1, progress=False)
    with pytest.raises(CacheMismatchError, match="shards"):
        build_cache(out, corpus["shards"][:3], corpus["tokdir"], num_workers=1, progress=False)
    build_cache(out, corpus["shards"][:2], other, num_workers=1, progress=False, overwrite=True)
    assert open_cache(out).tokenizer_fingerprint == other_fp

    ledger_path = Path(out, "ledger.json")
    ledger = json.loads(ledger_path.read_text())
    ledger["format_version"] = 999
    ledger_path.write_text(json.dumps(ledger))
    with pytest.raises(CacheMismatchError, match="format version"):
        open_cache(out)
    with pytest.raises(CacheNotFoundError):
        open_cache(str(tmp_path / "nothing"))


def test_rebuild_is_a_noop_and_refuses_foreign_dirs(corpus, tmp_path):
    before = {p: os.stat(Path(corpus["ref"], p)).st_mtime_ns for p in tree(corpus["ref"])}
    build_cache(corpus["ref"], corpus["shards"], corpus["tokdir"], num_workers=1, progress=False)
    assert {p: os.stat(Path(corpus["ref"], p)).st_mtime_ns for p in tree(corpus["ref"])} == before
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(CacheError, match="refusing"):
        build_cache(str(foreign), corpus["shards"][:1], corpus["tokdir"], num_workers=1, progress=False)
    assert (foreign / "precious.txt").read_text() == "keep me"


def test_a_failing_shard_names_itself_and_keeps_committed_groups(corpus, tmp_path):
    out = str(tmp_path / "c")
    class BadShard:
        name, fingerprint = "bad-shard", "0123"

        def iter_texts(self):
            yield "fine"
            raise OSError("connection reset")

    bad = BadShard()
    shards = [*corpus["shards"][:2], bad]
    with pytest.raises(RuntimeError, match="bad-shard.*connection reset"):
        build_cache(out, shards, corpus["tokdir"], num_workers=1, shard_group_size=2, progress=False)
    partial = open_cache(out, require_complete=False)
    assert partial.ledger["committed"]["shards"] == 2 and not partial.complete


def test_other_kvstores(corpus):
    url = "memory://lm_pipeline_test_cache/"
    build_cache(url, corpus["shards"][:3], corpus["tokdir"], num_workers=1, shard_group_size=2, progress=False)
    mem, ref = open_cache(url), open_cache(corpus["ref"])
    n = mem.num_tokens
    assert mem.num_docs == 30
    np.testing.assert_array_equal(mem.read_tokens(0, n), ref.read_tokens(0, n))
    np.testing.assert_array_equal(mem.doc_bytes, ref.doc_bytes[:30])
    from lm_pipeline.data.loader import CacheDataset

    ds = CacheDataset(mem, 16, "greedy")
    assert mem.root().read("packing/greedy-16/layout.json") is not None
    batch = ds.get_many([0])
    starts, lens = ds.layout.row_pieces(0)
    np.testing.assert_array_equal(batch.tokens[0, : lens[0]], mem.read_tokens(starts[0], starts[0] + lens[0]))


def test_a_failed_array_write_is_never_committed_and_the_resumed_cache_is_identical(corpus, tmp_path, monkeypatch):
    """The commit point waits for the arrays' writes to land: when a write of the token array
    fails (here its shard file cannot be locked, as on a full or broken disk), the build raises
    that error and the ledger never claims the shard it was writing; once the disk is fixed the
    resumed build gives a cache byte-identical to a clean one."""
    from lm_pipeline.data.cache import writer

    out = tmp_path / "c"
    obstacle = out / "tokens" / "c" / "0.__lock"  # TensorStore's lock file for the shard file tokens/c/0
    real_commit = writer.Committer.commit

    def commit_then_break_the_disk(self):
        real_commit(self)
        if self.ledger["committed"]["shards"] == GROUP:  # after the first group: later writes fail
            obstacle.mkdir()

    monkeypatch.setattr(writer.Committer, "commit", commit_then_break_the_disk)
    with pytest.raises(Exception, match="Error writing local file"):
        build_cache(str(out), corpus["shards"], corpus["tokdir"], num_workers=1, shard_group_size=GROUP,
                    progress=False)
    ledger = json.loads((out / "ledger.json").read_text())
    assert ledger["committed"]["shards"] == GROUP and not ledger["complete"]  # the failed group is not claimed
    partial = open_cache(str(out), require_complete=False)
    ref = open_cache(corpus["ref"])
    n = partial.num_tokens
    np.testing.assert_array_equal(partial.read_tokens(0, n), ref.read_tokens(0, n))  # committed rows intact
    monkeypatch.setattr(writer.Committer, "commit", real_commit)
    obstacle.rmdir()
    build_cache(str(out), corpus["shards"], corpus["tokdir"], num_workers=1, shard_group_size=GROUP, progress=False)
    assert tree(out) == tree(corpus["ref"])
