"""Log-likelihoods of token windows, batched by length: the compute behind the harness's
``loglikelihood`` and ``loglikelihood_rolling`` (:mod:`lm_pipeline.eval.harness`).

A window is ``tokens`` (at most ``max_length + 1`` ids) of which the last ``n_scored`` are
scored: the model reads ``tokens[:-1]`` and predicts ``tokens[1:]``. Windows are sorted by
length and cut into batches of ``batch_size`` rows whose length is padded (on the right, which
a causal model never reads back) to the smallest of a few bucket lengths (powers of two up to
``max_length``), and a short last batch is filled with copies of its last row: every batch has
one of a handful of shapes, so the jitted forward pass is compiled once per bucket and reused.
Identical windows are computed once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from lm_pipeline.compute import ComputePlan
from lm_pipeline.models.base import LmModel

__all__ = ["Scored", "bucket_lengths", "score_windows"]

#: The shortest bucket: shorter windows share its compiled program.
MIN_BUCKET = 16


class Scored(NamedTuple):
    """One window's result: the sum of the scored tokens' log-probabilities (nats) and whether
    each scored token is the model's argmax (greedy) choice."""

    logprob: float
    greedy: bool


def bucket_lengths(max_length: int) -> tuple[int, ...]:
    """Powers of two from :data:`MIN_BUCKET` below ``max_length``, then ``max_length`` itself."""
    out, n = [], MIN_BUCKET
    while n < max_length:
        out.append(n)
        n *= 2
    return (*out, max_length)


@eqx.filter_jit
def _token_logprobs(model: LmModel, inputs: jax.Array, targets: jax.Array, vocab: int,
                    plan: ComputePlan) -> tuple[jax.Array, jax.Array]:
    """(f32 [B, T] log p(target | inputs up to t), bool [B, T] target is the argmax), over the
    first ``vocab`` logits (a vocabulary padded beyond the tokenizer's is left out)."""
    logits = model(inputs, None, inference=True, plan=plan)[..., :vocab].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(logits, axis=-1) == targets


def _batches(lengths: np.ndarray, batch_size: int, buckets: Sequence[int]) -> list[tuple[np.ndarray, int]]:
    """(row indices, bucket length) per batch: rows sorted longest first, never mixing buckets."""
    bucket_of = np.searchsorted(np.asarray(buckets), lengths)
    order = np.lexsort((-lengths, -bucket_of))
    out = []
    for b in np.unique(bucket_of[order])[::-1]:
        rows = order[bucket_of[order] == b]
        out += [(rows[i:i + batch_size], int(buckets[b])) for i in range(0, len(rows), batch_size)]
    return out


def _pack(windows: Sequence[Sequence[int]], rows: np.ndarray, length: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """int32 inputs and targets [batch_size, length], right-padded with 0; missing rows repeat the last."""
    idx = np.concatenate([rows, np.full(batch_size - len(rows), rows[-1])])
    inputs = np.zeros((batch_size, length), np.int32)
    targets = np.zeros((batch_size, length), np.int32)
    for r, i in enumerate(idx):
        w = windows[i]
        inputs[r, :len(w) - 1] = w[:-1]
        targets[r, :len(w) - 1] = w[1:]
    return inputs, targets


def score_windows(model: LmModel, windows: Sequence[Sequence[int]], n_scored: Sequence[int], *, vocab: int,
                  max_length: int, batch_size: int, plan: ComputePlan, progress=None) -> list[Scored]:
    """The :class:`Scored` of each window (``len(window) <= max_length + 1``; its last
    ``n_scored`` tokens scored, ``1 <= n_scored < len(window)``), in the order given.
    ``progress``: called with the number of windows finished after each batch."""
    keys = [(tuple(w), int(n)) for w, n in zip(windows, n_scored, strict=True)]
    unique = list(dict.fromkeys(keys))
    lengths = np.asarray([len(w) - 1 for w, _ in unique], np.int64)
    if len(unique) and (lengths.max() > max_length or lengths.min() < 1):
        raise ValueError(f"a window of {lengths.max() + 1} tokens does not fit max_length {max_length} (+1)")
    results: dict[tuple[tuple[int, ...], int], Scored] = {}
    for rows, length in _batches(lengths, batch_size, bucket_lengths(max_length)):
        inputs, targets = _pack([w for w, _ in unique], rows, length, batch_size)
        logp, greedy = jax.device_get(_token_logprobs(model, jnp.asarray(inputs), jnp.asarray(targets), vocab, plan))
        for r, i in enumerate(rows):
            n_in, n = int(lengths[i]), unique[i][1]
            span = slice(n_in - n, n_in)
            results[unique[i]] = Scored(float(np.sum(logp[r, span], dtype=np.float64)), bool(np.all(greedy[r, span])))
        if progress is not None:
            progress(len(rows))
    return [results[k] for k in keys]
