"""Evaluating a model, or checkpoints, on named validation sets.

:func:`evaluate_model` sums next-token nats, predicted tokens and their bytes per set (the
metrics are defined in :mod:`lm_pipeline.eval`); :func:`evaluate_checkpoint` and
:func:`evaluate_checkpoints` load checkpoints and turn those sums into a validated report.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from lm_pipeline.batch import SequenceDataset
from lm_pipeline.compute import ComputePlan, plan_for_params
from lm_pipeline.eval.bpb import ByteCounter, bits_per_byte, target_mask
from lm_pipeline.eval.config import resolve_dtype
from lm_pipeline.eval.loading import (
    LoadedCheckpoint,
    checkpoint_step,
    load_model_from_checkpoint,
    resolve_checkpoint,
)
from lm_pipeline.eval.report import report_frame, report_rows, validate_report
from lm_pipeline.eval.unigram import UnigramBaseline, unigram_baseline
from lm_pipeline.faultpoints import faultpoint
from lm_pipeline.models.base import LmModel
from lm_pipeline.xla_cache import enable as enable_xla_cache

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["DatasetMetrics", "evaluate_checkpoint", "evaluate_checkpoints", "evaluate_model"]


@dataclass(frozen=True)
class DatasetMetrics:
    """Sums over the evaluated tokens of one validation set."""

    nats: float
    tokens: int
    bytes: float | None  # None: no byte information
    unigram_nats: float | None
    rows: int
    batches: int
    seconds: float

    @property
    def loss(self) -> float:
        return self.nats / self.tokens if self.tokens else float("nan")

    @property
    def bpb(self) -> float:
        return bits_per_byte(self.nats, self.bytes) if self.bytes is not None else float("nan")

    @property
    def unigram_loss(self) -> float:
        return self.unigram_nats / self.tokens if self.unigram_nats is not None and self.tokens else float("nan")

    @property
    def unigram_bpb(self) -> float:
        if self.unigram_nats is None or self.bytes is None:
            return float("nan")
        return bits_per_byte(self.unigram_nats, self.bytes)


@eqx.filter_jit
def _token_nll(model: LmModel, tokens: jax.Array, segment_ids: jax.Array | None, plan: ComputePlan) -> jax.Array:
    """f32 [B, T-1]: -log p(token t+1 | prefix) at every position (unmasked)."""
    logits = model(tokens, segment_ids, inference=True, plan=plan)[:, :-1].astype(jnp.float32)
    picked = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def evaluate_model(
    model: LmModel,
    datasets: Mapping[str, SequenceDataset],
    *,
    batch_size: int = 8,
    max_eval_batches: int | None = None,
    compute_dtype: Any = None,
    unigram: UnigramBaseline | np.ndarray | None = None,
    progress: bool | None = None,
    plan: ComputePlan | None = None,
) -> dict[str, DatasetMetrics]:
    """Sum of next-token nats, tokens and bytes per dataset (see :mod:`lm_pipeline.eval`).

    ``plan``: how the model computes; default: the plan for one device of the default backend
    in the (cast) parameters' dtype (:func:`lm_pipeline.compute.plan_for_devices`).

    ``progress``: a tqdm bar per dataset (batches, rate, ETA; its last state is the summary line);
    None = only when stderr is a terminal.

    Rows ``0 .. min(len, max_eval_batches * batch_size) - 1`` are evaluated in order, each once;
    a final partial batch is padded (to keep one compiled shape) and the padding ignored.
    ``unigram`` (log-probs or a :class:`UnigramBaseline`) is scored on the same tokens.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if compute_dtype is not None:
        from lm_pipeline.train.trainer import cast_floating

        model = cast_floating(model, resolve_dtype(compute_dtype))
    if plan is None:
        plan = plan_for_params(model)
    logp = unigram.log_probs if isinstance(unigram, UnigramBaseline) else unigram
    return {
        name: _evaluate_set(model, name, ds, batch_size=batch_size, max_eval_batches=max_eval_batches,
                            logp=logp, progress=progress, plan=plan)
        for name, ds in datasets.items()
    }


def _evaluate_set(
    model: LmModel, name: str, ds: SequenceDataset, *, batch_size: int, max_eval_batches: int | None,
    logp: np.ndarray | None, progress: bool | None, plan: ComputePlan,
) -> DatasetMetrics:
    """:func:`evaluate_model` on one validation set."""
    t0 = time.perf_counter()
    n = len(ds)
    if n == 0:
        raise ValueError(f"validation set {name!r} has no rows (is seq_len longer than its data?)")
    n_eval = n if max_eval_batches is None else min(n, max_eval_batches * batch_size)
    counter = ByteCounter(ds)
    nats = 0.0
    tokens = 0
    nbytes = 0.0 if counter.kind != "none" else None
    uni = 0.0 if logp is not None else None
    batches = 0
    bar = tqdm(total=-(-n_eval // batch_size), desc=f"eval {name}", unit="batch",
               disable=None if progress is None else not progress, leave=True)
    for start in range(0, n_eval, batch_size):
        rows = np.arange(start, min(start + batch_size, n_eval), dtype=np.int64)
        real = len(rows)
        idx = np.concatenate([rows, np.full(batch_size - real, rows[-1], np.int64)])
        batch = ds.get_many(idx)
        toks = np.asarray(batch.tokens, np.int32)
        seg = None if batch.segment_ids is None else np.asarray(batch.segment_ids, np.int32)
        seg_ids = None if seg is None else jnp.asarray(seg)
        nll = np.asarray(_token_nll(model, jnp.asarray(toks), seg_ids, plan), np.float64)
        mask = target_mask(toks, seg)
        if batch.loss_mask is not None:  # a chat source's: only the assistant's tokens are predicted targets
            mask *= np.asarray(batch.loss_mask)[:, 1:] != 0
        mask[real:] = 0.0
        nats += float((nll * mask).sum())
        tokens += int(mask.sum())
        if nbytes is not None:
            w = counter.weights(idx, mask)
            nbytes += float(w.sum())
        if uni is not None:
            targets = toks[:, 1:]
            if int(targets.max()) >= len(logp):
                raise ValueError(f"{name}: token id {int(targets.max())} is outside the unigram vocabulary ({len(logp)})")
            uni += float((-logp[targets] * mask).sum())
        batches += 1
        bar.update(1)
        if tokens:
            bar.set_postfix(loss=f"{nats / tokens:.4f}", refresh=False)
        faultpoint("eval.after_batch")
    bar.close()
    if tokens == 0:
        raise ValueError(f"validation set {name!r}: no token was predicted (rows of single tokens?)")
    return DatasetMetrics(nats, tokens, nbytes, uni, n_eval, batches, time.perf_counter() - t0)


def _model_type(model: LmModel) -> str:
    return str(getattr(getattr(model, "config", None), "type", type(model).__name__))


def evaluate_checkpoint(
    step_dir: str | os.PathLike,
    datasets: Mapping[str, SequenceDataset],
    *,
    batch_size: int = 8,
    max_eval_batches: int | None = None,
    compute_dtype: Any = None,
    train_cache: Any = None,
    unigram: UnigramBaseline | None = None,
    store_root: str | None = None,
) -> pd.DataFrame:
    """Evaluate one checkpoint on named validation sets; a validated report table.

    Args:
        step_dir: a complete checkpoint dir (or a run dir: its latest checkpoint).
        datasets: ``{name: dataset}``; cache-backed datasets (:class:`CacheDataset`) give exact
            bits per byte (see :mod:`lm_pipeline.eval`).
        batch_size / max_eval_batches: rows per batch; cap on batches per dataset.
        compute_dtype: dtype of the forward pass; default: the run's compute dtype (trainer.mp).
        train_cache: the training token cache (or its location) for the unigram baseline; or
            pass a precomputed ``unigram`` (see :func:`unigram_baseline`). Neither: no baseline.
        store_root: the store whose XLA compilation cache the evaluation uses
            (:mod:`lm_pipeline.xla_cache`); default: the checkpoint's run config's, and for a
            Hugging Face directory (no store of its own) the user's cache directory.

    Returns one row per dataset plus the ``_micro`` and ``_macro`` aggregates.
    """
    path = resolve_checkpoint(step_dir)
    loaded = load_model_from_checkpoint(path)
    if unigram is None and train_cache is not None:
        unigram = _unigram_for(loaded, train_cache)
    return _evaluate_loaded(
        path, loaded, datasets, batch_size=batch_size, max_eval_batches=max_eval_batches,
        compute_dtype=compute_dtype, unigram=unigram, store_root=store_root,
    )


def _unigram_for(loaded: LoadedCheckpoint, train_cache: Any) -> UnigramBaseline:
    """The baseline over the checkpoint tokenizer's vocabulary (the cache's, without one)."""
    vocab = None
    if loaded.tokenizer_dir is not None:
        from lm_pipeline.data.tokenizer import tokenizer_info

        vocab = tokenizer_info(loaded.tokenizer_dir).vocab_size
    return unigram_baseline(train_cache, vocab_size=vocab)


def _evaluate_loaded(
    path: str, loaded: LoadedCheckpoint, datasets: Mapping[str, SequenceDataset], *, batch_size: int,
    max_eval_batches: int | None, compute_dtype: Any, unigram: UnigramBaseline | None, store_root: str | None = None,
) -> pd.DataFrame:
    from lm_pipeline.hf.start import is_hf_model_dir

    if store_root is None and not is_hf_model_dir(path):
        store_root = loaded.config.store.root
    enable_xla_cache(store_root)
    if compute_dtype is None:
        from lm_pipeline.train.config import parse_mp

        compute_dtype = parse_mp(loaded.config.trainer.mp).compute
    metrics = evaluate_model(
        loaded.model, datasets, batch_size=batch_size, max_eval_batches=max_eval_batches,
        compute_dtype=compute_dtype, unigram=unigram,
    )
    rows = report_rows(
        path, checkpoint_step(path), metrics, entropy=None if unigram is None else unigram.entropy,
        max_eval_batches=max_eval_batches, model_type=_model_type(loaded.model),
        num_params=loaded.config.model.num_params(loaded.vocab_size), seq_len=loaded.config.model.seq_len,
        compute_dtype=jnp.dtype(resolve_dtype(compute_dtype)).name,
    )
    return validate_report(report_frame(rows))


def evaluate_checkpoints(
    paths: Iterable[str | os.PathLike],
    datasets: Mapping[str, SequenceDataset],
    *,
    batch_size: int = 8,
    max_eval_batches: int | None = None,
    compute_dtype: Any = None,
    train_cache: Any = None,
    unigram: UnigramBaseline | None = None,
    store_root: str | None = None,
) -> pd.DataFrame:
    """:func:`evaluate_checkpoint` for several checkpoints (each evaluated once; the unigram
    baseline computed once), concatenated into one report."""
    import pandas as pd

    frames, seen = [], set()
    for p in paths:
        path = resolve_checkpoint(p)
        if path in seen:  # e.g. a step dir and its run dir
            continue
        seen.add(path)
        loaded = load_model_from_checkpoint(path)
        if unigram is None and train_cache is not None:
            unigram = _unigram_for(loaded, train_cache)
        frames.append(_evaluate_loaded(
            path, loaded, datasets, batch_size=batch_size, max_eval_batches=max_eval_batches,
            compute_dtype=compute_dtype, unigram=unigram, store_root=store_root,
        ))
    if not frames:
        raise ValueError("no checkpoints to evaluate")
    return validate_report(pd.concat(frames, ignore_index=True))
