"""Training on the committed prefix of a token cache still being built (``data.shuffle: era``).

* The era order's batches on a partial cache are those of the complete cache, step by step, and
  both equal a NumPy reference of the rule written here (not the code under test): the first
  epoch visits eras of ``K`` consecutive rows, era ``b`` in ``PCG64([seed, b, 0xE4A])``'s
  permutation of its rows (the last era: the ``N mod K`` rows left over); later epochs in
  ``PCG64([seed, e, 0x5EED])``'s permutation of all ``N`` rows. A step is served from the prefix
  exactly when its eras are committed.
* ``lm-pipeline train``'s stage with ``data.shuffle: era`` builds the cache on a thread and trains
  while it grows; its losses equal a run on the complete cache, and the fingerprint is the same.
* Waiting on a cache whose builder died fails in one line instead of hanging.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import pipeline as pt
from helpers.data import EOS, tiny_tokenizer
from tokenizers import Tokenizer

from lm_pipeline import faultpoints
from lm_pipeline.batch import StepBatchSource
from lm_pipeline.data.cache import CacheError, CacheStalledError, build_cache, open_cache
from lm_pipeline.data.loader import CacheDataset, GrowingCacheDataset
from lm_pipeline.data.textshard import TextShard

T, K, B, SEED = 16, 10, 4, 3  # seq_len, era_length, batch (B does not divide K: batches straddle eras)
WORDS = ["alpha", "beta", "gamma", "delta", "lorem", "ipsum", "x", "42", "foo_bar", "\n"]


def docs(n: int, seed: int) -> tuple[str, ...]:
    rng = random.Random(seed)
    return tuple(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(n))


SHARDS = [TextShard(f"s{i:02d}", docs(3, i)) for i in range(10)]


# -- the reference, in NumPy, from the tokenizer and the rule ------------------------------------------


def reference_rows(tokdir: str) -> np.ndarray:
    """[N, T] rows of the concatenated documents (each + EOS), in shard order; the tail dropped."""
    tok = Tokenizer.from_file(f"{tokdir}/tokenizer.json")
    eos = tok.token_to_id(EOS)
    stream = [i for s in SHARDS for text in s.texts for i in [*tok.encode(text).ids, eos]]
    n = len(stream) // T
    return np.asarray(stream[: n * T], np.int64).reshape(n, T)


def reference_row_ids(step: int, n: int) -> np.ndarray:
    out = []
    for p in range(step * B, (step + 1) * B):
        epoch, o = divmod(p, n)
        if epoch == 0:
            era, j = divmod(o, K)
            size = min(K, n - era * K)
            out.append(era * K + np.random.Generator(np.random.PCG64([SEED, era, 0xE4A])).permutation(size)[j])
        else:
            out.append(np.random.Generator(np.random.PCG64([SEED, epoch, 0x5EED])).permutation(n)[o])
    return np.asarray(out)


# -- caches ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def partial_cache(where: Path, tokdir: str, commits: int, monkeypatch) -> None:
    """A cache whose builder died right after its ``commits``-th commit (one shard a commit)."""
    monkeypatch.setenv(faultpoints.ENV, f"token_cache.after_commit:{commits}:raise")
    faultpoints.reset()
    with pytest.raises(faultpoints.FaultInjected):
        build_cache(where, SHARDS, tokdir, num_workers=1, shard_group_size=1, progress=False)
    monkeypatch.delenv(faultpoints.ENV)
    faultpoints.reset()


def source(ds, **kw) -> StepBatchSource:
    return StepBatchSource(ds, B, SEED, shuffle="era", era_length=K, **kw)


def test_era_batches_on_a_growing_cache_are_the_complete_caches_and_the_reference(tmp_path, tokdir, monkeypatch):
    rows = reference_rows(tokdir)
    n = len(rows)
    assert n % K and n > 3 * K, f"the corpus must end in a partial era: {n} rows"
    build_cache(tmp_path / "full", SHARDS, tokdir, num_workers=1, shard_group_size=1, progress=False)
    full = source(CacheDataset(tmp_path / "full", T))
    assert len(full.dataset) == n
    steps = -(-2 * n // B) + 1  # into the third epoch

    partial_cache(tmp_path / "growing", tokdir, 3, monkeypatch)
    growing = GrowingCacheDataset(tmp_path / "growing", T, poll_s=0.01, stall_timeout_s=0.3,
                                  builder_alive=lambda: False)
    have = len(growing)
    assert not growing.complete and K <= have < n, (have, n)
    served = [k for k in range(steps) if -(-(k + 1) * B // K) * K <= have]  # its eras are committed
    assert served and served == list(range(len(served)))
    nxt = served[-1] + 1
    assert nxt * B // K < have // K == ((nxt + 1) * B - 1) // K, "the first step not served straddles into a partial era"
    hosts = [source(growing, process_index=i, process_count=2) for i in range(2)]
    for k in served:
        expect = rows[reference_row_ids(k, n)]
        np.testing.assert_array_equal(full.batch(k).tokens, expect, err_msg=f"complete cache, step {k}")
        got = np.concatenate([h.batch(k).tokens for h in hosts])
        np.testing.assert_array_equal(got, expect, err_msg=f"committed prefix, step {k}")
    # the next step needs an era that is not committed: it waits, and the dead builder ends the wait
    with pytest.raises(CacheStalledError, match="its builder stopped"):
        hosts[0].batch(served[-1] + 1)

    build_cache(tmp_path / "growing", SHARDS, tokdir, num_workers=1, shard_group_size=1, progress=False)  # resumes
    whole = source(growing)
    for k in range(steps):
        expect = rows[reference_row_ids(k, n)]
        np.testing.assert_array_equal(whole.batch(k).tokens, expect, err_msg=f"completed cache, step {k}")
        np.testing.assert_array_equal(full.batch(k).tokens, expect, err_msg=f"complete cache, step {k}")
    assert growing.complete and len(growing) == n
    print(f"{n} rows, era {K}, batch {B}: steps 0-{served[-1]} served from {have} committed rows, {steps} steps equal")


def test_default_order_is_the_epoch_permutation(tmp_path, tokdir):
    build_cache(tmp_path / "c", SHARDS, tokdir, num_workers=1, shard_group_size=1, progress=False)
    ds = CacheDataset(tmp_path / "c", T)
    n = len(ds)
    src = StepBatchSource(ds, B, SEED)  # data.shuffle: epoch, the default
    flat = np.concatenate([src.global_indices(k) for k in range(-(-2 * n // B))])
    expect = np.concatenate([np.random.Generator(np.random.PCG64([SEED, e, 0x5EED])).permutation(n) for e in (0, 1)])
    np.testing.assert_array_equal(flat[: 2 * n], expect)


def test_waiting_on_a_dead_builder_fails_in_one_line(tmp_path, tokdir, monkeypatch):
    partial_cache(tmp_path / "c", tokdir, 2, monkeypatch)
    ds = GrowingCacheDataset(tmp_path / "c", T, poll_s=0.05, stall_timeout_s=1.0)  # no builder to ask: a timeout
    t0 = time.monotonic()
    with pytest.raises(CacheStalledError) as err:
        source(ds).batch(len(ds) // B + 2)
    waited = time.monotonic() - t0
    message = str(err.value)
    assert 1.0 <= waited < 10, waited
    assert "\n" not in message and "nothing new committed for 1 s" in message and str(tmp_path / "c") in message
    assert "2 of 10 shards committed" in message, message
    print(message)
    # a run that stops closes its dataset: a prefetch thread still waiting for rows stops too
    waiting = GrowingCacheDataset(tmp_path / "c", T, poll_s=0.05, stall_timeout_s=60)
    threading.Timer(0.2, waiting.close).start()
    t0 = time.monotonic()
    with pytest.raises(CacheError, match="closed"):
        waiting.rows_ready(len(waiting) + 1)
    assert time.monotonic() - t0 < 5
    # a live builder may spend longer than the timeout on one shard group: training keeps waiting
    alive = GrowingCacheDataset(tmp_path / "c", T, poll_s=0.05, stall_timeout_s=0.2, builder_alive=lambda: True)
    threading.Timer(1.0, alive.close).start()
    t0 = time.monotonic()
    with pytest.raises(CacheError, match="closed"):
        alive.rows_ready(len(alive) + 1)
    assert time.monotonic() - t0 >= 0.9  # waited past five timeouts, stopped only by close()
    # a builder that stopped: its own one-line message at once
    dead = GrowingCacheDataset(tmp_path / "c", T, poll_s=0.05, stall_timeout_s=60, builder_alive=lambda: False)
    with pytest.raises(CacheStalledError, match="its builder stopped before committing"):
        dead.rows_ready(len(dead) + 1)
    # greedy / first_fit rows need the whole cache: refused in one line naming the fields
    from lm_pipeline.schema import ConfigError

    with pytest.raises(ConfigError, match=r"data\.packing.*data\.shuffle: era.*packing: concat") as err:
        GrowingCacheDataset(tmp_path / "c", T, "greedy")
    assert "\n" not in str(err.value)


# -- training while the cache builds: the pipeline's train stage ------------------------------------------


def experiment(tmp: Path, root: str) -> dict:
    data = tmp / "data"
    if not data.exists():
        data.mkdir()
        for i in range(8):
            (data / f"train-{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs(3, 100 + i)))
        (data / "validation.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs(2, 99)))
    cfg = pt.tiny_config(tmp)
    cfg["data"].update(train_urls=sorted(str(p) for p in data.glob("train-*.jsonl")),
                       validation_urls=[str(data / "validation.jsonl")], shuffle="era", era_length=8)
    cfg["trainer"].update(log_every=1)  # the tiny experiment's 6 steps of batch 4
    cfg["store"] = {"root": str(tmp / root)}
    return cfg


@pytest.mark.slow  # two tiny trainings (one compile each): ~20 s
def test_training_while_the_cache_builds_equals_training_on_the_complete_cache(tmp_path, monkeypatch):
    from lm_pipeline.config import RunConfig
    from lm_pipeline.data.cache.writer import Committer
    from lm_pipeline.schema import from_dict
    from lm_pipeline.steps import Pipeline
    from lm_pipeline.steps.builders import train_while_caching
    from lm_pipeline.steps.stage import BuildContext, Inputs
    from lm_pipeline.train.trainer import Hook

    # The builder is held after two eras of the training split until training has done 2 steps:
    # those steps certainly run on a partial cache; later ones wait for the rows they need.
    released = threading.Event()
    held: list[int] = []
    original = Committer.commit

    def commit(self):
        original(self)
        if self.root.path.endswith("/train") and self.tokens >= 2 * 8 * 32 and not released.is_set():
            held.append(self.tokens)
            assert released.wait(120), "training never reached step 2"

    def run(root: str, in_background: bool):
        pipe = Pipeline(from_dict(RunConfig, experiment(tmp_path, root)), progress=False)
        train_dir = Path(pipe.store.artifact("token_cache", pipe.address("token_cache").fingerprint).path) / "train"
        losses, complete_at = [], []

        def record(info):
            losses.append(info.metrics["train/loss"])
            complete_at.append((train_dir / "COMPLETE").exists())
            if info.step == 2:
                released.set()

        if not in_background:
            pipe.token_cache()
        stage = pipe.stage("train_ckpt")
        assert train_while_caching(BuildContext(pipe, stage), Inputs(pipe, stage)) is in_background
        res = pipe.train_ckpt(hooks=[Hook(record, every=1)])
        return pipe, res, losses, complete_at

    monkeypatch.setattr(Committer, "commit", commit)
    bg_pipe, bg, bg_losses, bg_complete = run("store-a", True)
    monkeypatch.setattr(Committer, "commit", original)
    ref_pipe, ref, ref_losses, ref_complete = run("store-b", False)

    assert held, "the builder was never held: the training split is too small"
    assert bg_complete[:2] == [False, False] and all(ref_complete), (bg_complete, ref_complete)
    assert len(bg_losses) == 6 and bg_losses == ref_losses, (bg_losses, ref_losses)
    assert bg.fingerprint == ref.fingerprint == ref_pipe.address("train_ckpt").fingerprint
    def evals(res):
        return [{k: v for k, v in e.items() if k.endswith(("loss", "bpb")) or k == "step"} for e in res.manifest["eval_history"]]

    assert evals(bg) == evals(ref) != [], (evals(bg), evals(ref))
    rows = open_cache(f"{bg_pipe.cached('token_cache').path}/train").num_tokens // 32
    assert 6 * 4 > rows > 2 * 8, f"the run must cross into the second epoch ({rows} rows)"
    print(f"{sum(not c for c in bg_complete)} of 6 steps ran before the cache was complete; losses equal: "
          f"{bg_losses[0]:.6f} ... {bg_losses[-1]:.6f}")


def test_a_builder_that_dies_stops_training_with_its_error(tmp_path, monkeypatch):
    from lm_pipeline.config import RunConfig
    from lm_pipeline.schema import from_dict
    from lm_pipeline.steps import Pipeline

    pipe = Pipeline(from_dict(RunConfig, experiment(tmp_path, "store")), progress=False)
    pipe.tokenizer()
    monkeypatch.setenv(faultpoints.ENV, "token_cache.after_commit:1:raise")  # the validation set's first commit
    faultpoints.reset()
    t0 = time.monotonic()
    with pytest.raises(faultpoints.FaultInjected):
        pipe.train_ckpt()
    assert time.monotonic() - t0 < 30
    assert pipe.cached("token_cache") is None and pipe.cached("train_ckpt") is None
