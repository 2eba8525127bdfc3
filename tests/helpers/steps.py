"""A fresh one-device training step function run over given batches."""

from __future__ import annotations

import jax
import numpy as np

from lm_pipeline.config import load_config
from lm_pipeline.train.sharding import make_mesh
from lm_pipeline.train.trainer import build_step_functions, put_batch


def train_steps(overrides: dict, batches: list, *, has_loss_mask: bool = False, vocab_size: int = 64,
                num_train_steps: int = 10) -> tuple[list[np.ndarray], list[dict[str, float]]]:
    """Train from the config ``overrides`` on ``batches`` (packed rows with segment ids; with
    ``has_loss_mask``, loss masks too), one step per batch: (the parameters as float64 leaves,
    each step's metrics)."""
    cfg = load_config(None, overrides)
    plan = make_mesh(cfg.trainer, jax.devices()[:1])
    fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=vocab_size,
                               num_train_steps=num_train_steps, plan=plan, has_segments=True,
                               has_loss_mask=has_loss_mask)
    state = fns.init(jax.random.key_data(jax.random.key(0)))
    metrics = []
    for b in batches:
        state, m = fns.train_step(state, *put_batch(b, plan))
        metrics.append({k: float(v) for k, v in m.items()})
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(state.model)], metrics


def segment_row(rng: np.random.Generator, seq_len: int, doc_len: tuple[int, int], max_tail: int) -> np.ndarray:
    """One packed row's segment ids: documents of ``doc_len`` (numpy's ``integers`` bounds) tokens
    numbered from 1, until fewer than a random ``[0, max_tail)`` positions are left (then padding, 0)."""
    seg = np.zeros(seq_len, np.int32)
    pos, doc = 0, 1
    while pos < seq_len - rng.integers(0, max_tail):
        n = int(rng.integers(*doc_len))
        seg[pos : pos + n] = doc
        pos, doc = pos + n, doc + 1
    return seg
