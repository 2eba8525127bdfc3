"""An independent reference for what the model learns: next-token cross-entropy recomputed in
plain NumPy (float64) from the model's logits on real loader batches, for concatenate-and-chunk
rows and first-fit packed rows with segment ids and padding.

The trainer's loss (fused and unfused head, the jitted train and eval steps) and the loss and
bits-per-byte that :func:`lm_pipeline.eval.evaluate_model` reports must equal that reference;
and the model must be causal within each document: a logit depends only on earlier-or-equal
tokens of its own document (no label leak through attention, no attention across documents).
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.data import EOS, tiny_tokenizer

from lm_pipeline.batch import StepBatchSource
from lm_pipeline.compute import plan_for
from lm_pipeline.config import load_config
from lm_pipeline.data.cache import build_cache, open_cache
from lm_pipeline.data.loader import CacheDataset
from lm_pipeline.data.textshard import TextShard
from lm_pipeline.data.tokenizer import load_tokenizer
from lm_pipeline.eval import evaluate_model
from lm_pipeline.train.loss import model_loss_sums
from lm_pipeline.train.sharding import make_mesh
from lm_pipeline.train.trainer import TrainState, build_step_functions, put_batch

T = 24
TOKENIZER_VOCAB = 300
VOCAB = 320  # model vocabulary: the head has rows no token uses
BATCH = 4
PACKINGS = ("concat", "first_fit")
# Distinct documents of 2 to 42 tokens (one longer than T, so it is split across rows).
TEXTS = (
    "alpha beta gamma delta",
    "café naïve 日本語 🙂 данные",
    "x",
    "foo_bar 42 alpha alpha beta gamma gamma delta x x foo_bar 42",
    "данные 🙂 café",
    "the quick brown fox jumps over the lazy dog",
    "42 42 42",
    "gamma delta naïve café alpha",
    "日本語 日本語",
    "beta",
    "alpha foo_bar x 42 delta",
)
MODELS = {
    "gpt2": {"model.type": "gpt2", "model.num_heads": 4},
    "llama": {"model.type": "llama", "model.num_heads": 4, "model.num_kv_heads": 2, "model.intermediate_dim": 64},
}
# The one case run through the compiled train step (~10 s to compile on 2 cores): packed rows
# with padding. Every case's loss goes through the same model_loss_sums, checked by the eval
# step and directly.
TRAIN_CASE = ("gpt2", "first_fit")


def run_config(family: str):
    return load_config(None, {
        **MODELS[family], "model.seq_len": T, "model.hidden_dim": 32, "model.num_layers": 2,
        "model.gradient_checkpointing": False,
        "trainer.train_batch_size": BATCH, "trainer.mp": "f32", "trainer.progress": False,
    })


def numpy_model(cfg, seed: int):
    """The model with every parameter drawn from N(0, 0.3) by NumPy.

    Wide (not the init's 0.02), so the logits are far from uniform and predicting the wrong
    target or attending to the wrong tokens changes the loss well beyond f32 rounding; drawn by
    NumPy because XLA:CPU takes ~0.5 s to compile each ``jax.random.normal`` of an init."""
    rng = np.random.default_rng(seed)
    abstract = eqx.filter_eval_shape(cfg.model.build, VOCAB, key=jax.random.key(0))
    return jax.tree.map(
        lambda a: jnp.asarray(rng.normal(0.0, 0.3, a.shape), a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a,
        abstract)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The token cache of TEXTS, and each document's token ids and UTF-8 bytes worked out here."""
    base = tmp_path_factory.mktemp("refloss")
    tokdir = tiny_tokenizer(str(base / "tok"), vocab_size=TOKENIZER_VOCAB)
    build_cache(str(base / "cache"), [TextShard("docs", TEXTS)], tokdir, num_workers=1, progress=False)
    tok = load_tokenizer(tokdir)
    docs = [tok.encode(t).ids + [tok.token_to_id(EOS)] for t in TEXTS]
    assert max(map(len, docs)) > T > min(map(len, docs)) + 1
    cache = open_cache(str(base / "cache"))
    return {"docs": docs, "bytes": [len(t.encode("utf-8")) for t in TEXTS],
            "datasets": {p: CacheDataset(cache, T, p) for p in PACKINGS}}


@pytest.fixture(scope="module")
def trainer():
    """family -> (plan, step functions, a train state holding the model, the model); built once."""
    built = {}

    def get(family: str):
        if family not in built:
            cfg = run_config(family)
            plan = make_mesh(cfg.trainer, jax.devices()[:1])
            fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=VOCAB, num_train_steps=10,
                                       plan=plan, has_segments=True)
            model = numpy_model(cfg, seed=len(built))
            # The train step reports the loss of the parameters it was given, before the update,
            # so a zero optimizer state will do (and fns.init's random init is not compiled).
            a = fns.abstract_state
            state = TrainState(jnp.zeros((), jnp.int32), eqx.filter(model, eqx.is_array),
                               jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), a.opt_state),
                               jax.random.key_data(jax.random.key(0)))
            built[family] = plan, fns, state, model
        return built[family]

    return get


@eqx.filter_jit
def _forward(model, tokens, seg, attention: str = "auto"):
    """The logits and the trainer's loss sums with the fused and the unfused head (one compile
    per model family, batch structure and attention implementation serves every test)."""
    fused = plan_for("cpu", jnp.float32, num_devices=1, attention=attention)
    heads = [model_loss_sums(model, tokens, seg, key=None, inference=True, plan=p)
             for p in (fused, dataclasses.replace(fused, loss="logits"))]
    return model(tokens, seg, key=None, inference=True, plan=fused), heads


def logits_of(model, tokens: np.ndarray, segment_ids: np.ndarray | None, attention: str = "auto") -> np.ndarray:
    """float64 [n, T, V] logits, computed BATCH rows at a time (one compiled shape)."""
    n = len(tokens)
    pad = -n % BATCH
    tokens = np.concatenate([tokens, tokens[:pad]])
    segment_ids = None if segment_ids is None else np.concatenate([segment_ids, segment_ids[:pad]])
    out = [_forward(model, jnp.asarray(tokens[i : i + BATCH]),
                    None if segment_ids is None else jnp.asarray(segment_ids[i : i + BATCH]), attention)[0]
           for i in range(0, len(tokens), BATCH)]
    return np.concatenate([np.asarray(o, np.float64) for o in out])[:n]


def slot_docs(docs, packing: str, rows, tokens: np.ndarray, segment_ids: np.ndarray | None) -> np.ndarray:
    """int [B, T]: the document each slot's token comes from (-1: padding), found from the
    hand-tokenized documents rather than the cache or layout, checking the loader's rows."""
    if packing == "concat":  # row r is the token stream's [r*T, (r+1)*T)
        stream = np.concatenate(docs)
        doc_of = np.repeat(np.arange(len(docs)), [len(d) for d in docs])
        pos = np.asarray(rows)[:, None] * T + np.arange(T)
        np.testing.assert_array_equal(tokens, stream[pos])
        assert segment_ids is None
        return doc_of[pos]
    # first_fit: each segment is one whole piece (T tokens or a remainder) of one document
    pieces = {tuple(d[k : k + T]): i for i, d in enumerate(docs) for k in range(0, len(d), T)}
    assert len(pieces) == sum(-(-len(d) // T) for d in docs)  # pieces are told apart by content
    out = np.full(tokens.shape, -1)
    for b in range(tokens.shape[0]):
        for s in set(segment_ids[b].tolist()) - {0}:
            where = np.flatnonzero(segment_ids[b] == s)
            assert np.array_equal(where, np.arange(where[0], where[-1] + 1))  # contiguous
            out[b, where] = pieces[tuple(tokens[b, where].tolist())]
    return out


def reference_loss(logits, tokens, segment_ids, doc_bpt=None, doc_of=None):
    """(sum of nats, predicted tokens, bytes of the predicted tokens) in float64, by loops.

    Position t predicts token t+1 of its row, only if t+1 is in the same document and not
    padding; the last position predicts nothing. Each predicted token carries its document's
    bytes per token (when ``doc_bpt`` and ``doc_of`` are given)."""
    nats, count, nbytes = 0.0, 0, 0.0
    for b in range(tokens.shape[0]):
        for t in range(tokens.shape[1] - 1):
            if segment_ids is not None and (segment_ids[b, t + 1] == 0 or segment_ids[b, t + 1] != segment_ids[b, t]):
                continue
            z = logits[b, t]
            lse = z.max() + math.log(np.exp(z - z.max()).sum())
            nats += lse - z[tokens[b, t + 1]]
            count += 1
            if doc_bpt is not None:
                nbytes += doc_bpt[doc_of[b, t + 1]]
    return nats, count, nbytes


def is_mixed(segment_row: np.ndarray) -> bool:
    """Whether a packed row holds at least two documents and at least two padding slots."""
    return len(set(segment_row.tolist()) - {0}) >= 2 and (segment_row == 0).sum() >= 2


def loader_batch(corpus, packing: str):
    """A real training batch (step 0), checked against the hand-tokenized documents."""
    src = StepBatchSource(corpus["datasets"][packing], BATCH, seed=3)
    batch = src.batch(0)
    slot_docs(corpus["docs"], packing, src.local_indices(0), batch.tokens, batch.segment_ids)
    if batch.segment_ids is not None:
        assert any(is_mixed(s) for s in batch.segment_ids)
    return batch


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("family", list(MODELS))
def test_trainer_loss_equals_numpy_reference(corpus, trainer, family, packing):
    """model_loss_sums (fused and unfused head), the jitted eval step and (TRAIN_CASE) the train
    step's reported loss, taken before its update, all equal the NumPy reference on a loader
    batch."""
    plan, fns, state, model = trainer(family)
    batch = loader_batch(corpus, packing)
    logits, heads = _forward(model, *put_batch(batch, plan))
    nats, count, _ = reference_loss(np.asarray(logits, np.float64), batch.tokens, batch.segment_ids)
    assert count == (T - 1) * BATCH if packing == "concat" else 0 < count < (T - 1) * BATCH
    ref = nats / count

    for fused, (s, n) in zip((True, False), heads, strict=True):
        assert float(n) == count and float(s) / count == pytest.approx(ref, rel=1e-5), f"fused_head={fused}"
    s, n = fns.eval_step(state, *put_batch(batch, plan))
    assert float(n) == count and float(s) / count == pytest.approx(ref, rel=1e-5), "eval_step"
    if (family, packing) == TRAIN_CASE:
        _, metrics = fns.train_step(jax.tree.map(jnp.copy, state), *put_batch(batch, plan))  # donates its state
        assert float(metrics["train/loss"]) == pytest.approx(ref, rel=1e-5), "train_step"


@pytest.mark.parametrize("family", list(MODELS))
def test_eval_loss_and_bits_per_byte_equal_numpy_reference(corpus, trainer, family):
    """evaluate_model over every row (the last batch is partial) reports the reference's nats,
    predicted tokens and bytes: bpb = nats / ln 2 / bytes of the predicted tokens' text, each
    predicted token carrying its document's UTF-8 bytes / tokens."""
    model = trainer(family)[3]
    docs = corpus["docs"]
    doc_bpt = np.asarray(corpus["bytes"], np.float64) / np.asarray([len(d) for d in docs])
    metrics = evaluate_model(model, corpus["datasets"], batch_size=BATCH, progress=False)
    for packing, ds in corpus["datasets"].items():
        rows = np.arange(len(ds))
        assert len(rows) % BATCH, "want a padded final batch"
        batch = ds.get_many(rows)
        doc_of = slot_docs(docs, packing, rows, batch.tokens, batch.segment_ids)
        if packing == "first_fit":  # every token of every document is evaluated once
            assert sorted(doc_of[doc_of >= 0].tolist()) == [i for i, d in enumerate(docs) for _ in d]
        nats, count, nbytes = reference_loss(logits_of(model, batch.tokens, batch.segment_ids), batch.tokens,
                                             batch.segment_ids, doc_bpt, doc_of)
        m = metrics[packing]
        assert (m.rows, m.tokens) == (len(rows), count), packing
        assert m.nats == pytest.approx(nats, rel=1e-5) and m.loss == pytest.approx(nats / count, rel=1e-5), packing
        assert m.bytes == pytest.approx(nbytes, rel=1e-12), packing
        assert m.bpb == pytest.approx(nats / math.log(2) / nbytes, rel=1e-5), packing


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("family", list(MODELS))
def test_logits_depend_only_on_earlier_tokens_of_the_same_document(corpus, trainer, family, packing):
    """Changing the token at p changes logits only at positions q >= p of p's document (padding:
    only p itself): no label leak through attention, no attention across documents. And a
    packed document's logits are those of the document alone at the start of a row.

    Plain causal rows are checked with both CPU attention paths: the native kernel (``auto``, on
    one device) and the blocked attention (``blocked``, as on several devices); segment ids always
    take the blocked one."""
    model = trainer(family)[3]
    batch = loader_batch(corpus, packing)
    seg = batch.segment_ids
    r = 0 if seg is None else next(i for i, s in enumerate(seg) if is_mixed(s))
    row = batch.tokens[r]
    sid = np.ones(T, np.int32) if seg is None else seg[r]

    perturbed = np.tile(row, (T + 1, 1))  # copy p has token p changed; the last copy is unchanged
    perturbed[np.arange(T), np.arange(T)] = (row + 1 + np.arange(T)) % TOKENIZER_VOCAB
    q = np.arange(T)
    for attention in ("auto",) if seg is not None else ("auto", "blocked"):
        logits = logits_of(model, perturbed, None if seg is None else np.tile(sid, (T + 1, 1)), attention)
        changed = np.abs(logits[:T] - logits[T]).max(axis=-1) > 1e-5  # [p, q]
        for p in range(T):
            allowed = (q == p) if sid[p] == 0 else ((q >= p) & (sid == sid[p]))
            leaked = q[changed[p] & ~allowed]
            assert not len(leaked), f"{attention}: token {p} changed the logits at {leaked}"
            assert changed[p, p]

    if seg is not None:
        spans = [np.flatnonzero(sid == s) for s in sorted(set(sid.tolist()) - {0})]
        # each document first in a row of its own, followed by arbitrary tokens
        alone = logits_of(model, np.stack([np.concatenate([row[w], row[: T - len(w)]]) for w in spans]), None)
        for w, out in zip(spans, alone, strict=True):
            np.testing.assert_allclose(out[: len(w)], logits[T, w], rtol=1e-4, atol=1e-4)
