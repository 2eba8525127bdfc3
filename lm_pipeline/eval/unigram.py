"""The unigram baseline: add-one smoothed token frequencies of the training cache.

``p(v) = (count(v) + 1) / (N + V)``; a model that has learned anything beats it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from lm_pipeline.eval.bpb import bits_per_byte

if TYPE_CHECKING:
    from lm_pipeline.data.cache import TokenCache

__all__ = ["UnigramBaseline", "unigram_baseline", "unigram_log_probs"]


@dataclass(frozen=True)
class UnigramBaseline:
    """Add-one smoothed unigram model of a training cache, and its score on an eval cache."""

    log_probs: np.ndarray  # float64 [V], natural log
    train_tokens: int
    entropy: float  # nats: entropy of the smoothed training distribution
    loss: float | None = None  # nats/token: cross-entropy on every token of the eval cache
    bpb: float | None = None  # bits per byte of the same
    eval_tokens: int = 0
    eval_bytes: int = 0

    @property
    def vocab_size(self) -> int:
        return len(self.log_probs)


def _cache_of(x: Any) -> TokenCache:
    from lm_pipeline.data.cache import TokenCache, open_cache

    if isinstance(x, TokenCache):
        return x
    cache = getattr(x, "cache", None)  # a CacheDataset
    if isinstance(cache, TokenCache):
        return cache
    return open_cache(x)


def _token_counts(cache: TokenCache, vocab_size: int, chunk: int) -> np.ndarray:
    counts = np.zeros(vocab_size, np.int64)
    for start in range(0, cache.num_tokens, chunk):
        toks = cache.read_tokens(start, min(start + chunk, cache.num_tokens)).astype(np.int64)
        if len(toks) and int(toks.max()) >= vocab_size:
            raise ValueError(f"{cache.location}: token id {int(toks.max())} is outside the vocabulary ({vocab_size})")
        counts += np.bincount(toks, minlength=vocab_size)
    return counts


def unigram_log_probs(train_cache: Any, vocab_size: int | None = None, *, chunk: int = 1 << 24) -> tuple[np.ndarray, int]:
    """(log p [V] float64, number of training tokens): ``p(v) = (count(v) + 1) / (N + V)``.

    ``train_cache``: a :class:`TokenCache`, a cache-backed dataset, or a cache location; or a list
    of them (a mixture's components: their tokens counted together).
    ``vocab_size`` defaults to the tokenizer's (stored in the cache's ledger).
    """
    caches = [_cache_of(c) for c in (train_cache if isinstance(train_cache, (list, tuple)) else [train_cache])]
    if vocab_size is None:
        vocab_size = int(caches[0].settings["vocab_size"])
    counts = sum(_token_counts(cache, vocab_size, chunk) for cache in caches)
    n = int(counts.sum())
    return np.log(counts + 1.0) - math.log(n + vocab_size), n


def unigram_baseline(
    train_cache: Any, eval_cache: Any = None, *, vocab_size: int | None = None, chunk: int = 1 << 24
) -> UnigramBaseline:
    """The add-one smoothed unigram model of ``train_cache``; with ``eval_cache``, its
    cross-entropy on every token of that cache and its bits per byte (the cache's whole text).

    :func:`evaluate_checkpoint` scores the same model on exactly the evaluated tokens instead.
    """
    logp, n = unigram_log_probs(train_cache, vocab_size, chunk=chunk)
    entropy = float(-(np.exp(logp) * logp).sum())
    if eval_cache is None:
        return UnigramBaseline(logp, n, entropy)
    cache = _cache_of(eval_cache)
    counts = _token_counts(cache, len(logp), chunk)
    tokens = int(counts.sum())
    nats = float(-(counts * logp).sum())
    return UnigramBaseline(
        logp, n, entropy, loss=nats / max(tokens, 1), bpb=bits_per_byte(nats, cache.num_bytes),
        eval_tokens=tokens, eval_bytes=int(cache.num_bytes),
    )
