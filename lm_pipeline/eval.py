"""Evaluation of checkpoints: loss, perplexity and bits-per-byte per validation set, a unigram
baseline, and reports as validated tables (Parquet + JSON).

Loading. :func:`load_model_from_checkpoint` reads a checkpoint dir written by the trainer
(``<run_dir>/step-<N>/`` with ``config.yaml``, ``tokenizer/`` and the Orbax state, see
:mod:`lm_pipeline.train.checkpoint`) and restores only the ``model`` subtree of the train state,
on one device. The model's vocabulary size is read from the saved embedding's shape.

Metrics of a validation set (a :class:`~lm_pipeline.batch.SequenceDataset`), over the rows
evaluated (the first ``max_eval_batches * batch_size`` rows in order; all rows by default):

* ``loss``: mean next-token cross-entropy in nats over the predicted tokens (the same targets
  and mask as the trainer's loss: position t predicts t+1 within a row, never across documents
  with segment ids, never into padding); ``perplexity = exp(loss)``.
* ``bpb`` (bits per byte) ``= total nats / ln 2 / bytes``. ``bytes`` counts exactly the text of
  the tokens evaluated: each predicted token carries the bytes-per-token of its own document
  (``doc_bytes[d] / doc_tokens[d]`` from the token cache), so a document whose tokens are all
  predicted contributes exactly its UTF-8 byte count, and a document cut by the row boundaries
  or by ``max_eval_batches`` contributes its share. (Tokens that are never predicted, the first
  of each row or packed segment, carry no bytes.) Datasets that are not backed by a token cache
  use their ``bytes_per_token`` attribute if they have one; otherwise bpb is missing.
* A unigram baseline: the token distribution of the *training* cache with add-one (Laplace)
  smoothing, ``p(v) = (count(v) + 1) / (N + V)``, scored on the same predicted tokens with the
  same byte counts (``unigram_loss``, ``unigram_bpb``), and its entropy (``unigram_entropy``).
  A model that has learned anything beats it.
* Aggregates: a ``micro`` row (totals over all sets: sum of nats / sum of tokens, / sum of
  bytes) and a ``macro`` row (the unweighted mean of the sets' losses and bpbs).

Reports have one row per (checkpoint, dataset or aggregate; aggregates are named ``_micro`` and
``_macro``) with the columns of :data:`REPORT_COLUMNS` (``max_eval_batches`` is -1 when all rows
were evaluated; missing values are NaN), and are validated by :func:`report_schema` (pandera)
before :func:`write_report` saves them as Parquet and JSON.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from lm_pipeline import atomic
from lm_pipeline.batch import SequenceDataset
from lm_pipeline.faultpoints import faultpoint
from lm_pipeline.models.base import LmModel
from lm_pipeline.schema import ConfigError, field

if TYPE_CHECKING:
    import pandas as pd

    from lm_pipeline.config import RunConfig
    from lm_pipeline.data.cache import TokenCache

__all__ = [
    "REPORT_COLUMNS",
    "DatasetMetrics",
    "EvalConfig",
    "LoadedCheckpoint",
    "UnigramBaseline",
    "bits_per_byte",
    "checkpoint_step",
    "evaluate_checkpoint",
    "evaluate_checkpoints",
    "evaluate_model",
    "load_model_from_checkpoint",
    "read_report",
    "report_schema",
    "resolve_dtype",
    "target_byte_weights",
    "unigram_baseline",
    "unigram_log_probs",
    "validate_report",
    "write_report",
]

CONFIG_FILE = "config.yaml"
TOKENIZER_DIR = "tokenizer"
MODEL_SUBTREE = "model"
REPORT_NAME = "eval_report"
LN2 = math.log(2.0)


# --------------------------------------------------------------------------------------------
# Configuration (for the lead to hook into RunConfig as `eval:`)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalConfig:
    """Offline evaluation of checkpoints (``lm-pipeline eval``)."""

    batch_size: int = field(
        8, help="Rows per eval batch (with max_eval_batches it decides how many rows are evaluated).", semantic=True
    )
    max_eval_batches: int | None = field(None, help="Evaluate at most this many batches per validation set (the first rows, in order); null = all rows.")
    compute_dtype: str | None = field(None, help="Dtype of the forward pass ('float32', 'bfloat16', ...); null = the run's compute dtype (trainer.mp).")
    unigram_baseline: bool = field(True, help="Report a unigram baseline (add-one smoothed token frequencies of the training cache) beside the model.")
    report_dir: str | None = field(None, help="Where eval_report.parquet/.json are written; null = <run_dir>/eval.", semantic=False)

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ConfigError("batch_size", f"must be >= 1, got {self.batch_size}")
        if self.max_eval_batches is not None and self.max_eval_batches < 1:
            raise ConfigError("max_eval_batches", f"must be >= 1 or null, got {self.max_eval_batches}")
        if self.compute_dtype is not None:
            try:
                resolve_dtype(self.compute_dtype)
            except ValueError as e:
                raise ConfigError("compute_dtype", str(e)) from None


_DTYPES = {
    "float32": jnp.float32, "f32": jnp.float32, "fp32": jnp.float32,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
    "float16": jnp.float16, "f16": jnp.float16, "fp16": jnp.float16,
}


def resolve_dtype(spec: Any) -> Any:
    """A JAX dtype from a name ('bf16', 'bfloat16', 'float32', 'f16', ...) or a dtype."""
    if isinstance(spec, str):
        if spec.lower() not in _DTYPES:
            raise ValueError(f"unknown dtype {spec!r}; use one of float32, bfloat16, float16")
        return _DTYPES[spec.lower()]
    return jnp.dtype(spec)


# --------------------------------------------------------------------------------------------
# Loading a model from a training checkpoint
# --------------------------------------------------------------------------------------------


class LoadedCheckpoint(NamedTuple):
    """What :func:`load_model_from_checkpoint` returns (unpacks as a 4-tuple)."""

    config: RunConfig
    model: LmModel
    tokenizer_dir: str | None  # <step_dir>/tokenizer, or None if the checkpoint has none
    vocab_size: int  # rows of the model's embedding (may exceed the tokenizer's: padding)


def _resolve_checkpoint(path: str | os.PathLike) -> str:
    from lm_pipeline.train.checkpoint import latest_checkpoint

    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(
            f"no complete checkpoint at or under {os.fspath(path)} (a step-<N> dir with checkpoint.json)"
        )
    return found


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step recorded in a checkpoint's completion marker."""
    from lm_pipeline.train.checkpoint import read_metadata

    return int(read_metadata(_resolve_checkpoint(path))["step"])


def _is_shape(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def load_model_from_checkpoint(path: str | os.PathLike, *, dtype: Any = None) -> LoadedCheckpoint:
    """The run config, model, tokenizer dir and model vocabulary size of a checkpoint.

    ``path``: a complete ``step-<N>`` dir, or a run dir (its latest complete checkpoint is used).
    Only the ``model`` subtree of the saved train state is read (no optimizer state), onto the
    first local device. Parameters keep their saved dtype unless ``dtype`` is given.
    """
    from lm_pipeline.config import load_config
    from lm_pipeline.train.checkpoint import load, read_metadata

    step_dir = _resolve_checkpoint(path)
    cfg_path = atomic.join(step_dir, CONFIG_FILE)
    if not atomic.is_local(cfg_path):
        raise ValueError(f"{step_dir}: loading from a remote checkpoint is not supported here; copy it locally first")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{step_dir} has no {CONFIG_FILE}: cannot tell which model it holds")
    cfg = load_config(cfg_path)
    saved = read_metadata(step_dir).get("state", {}).get("arrays", {})
    emb = saved.get(f"{MODEL_SUBTREE}.token_embeddings")
    if emb is None:
        raise ValueError(f"{step_dir}: the checkpoint holds no '{MODEL_SUBTREE}.token_embeddings' array")
    vocab_size = int(emb["shape"][0])

    skeleton = eqx.filter_eval_shape(cfg.model.build, vocab_size, key=jax.random.PRNGKey(0))
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def abstract(p, leaf):
        if not _is_shape(leaf):
            return leaf
        key = ".".join([MODEL_SUBTREE, *(e.name for e in p)])
        dt = np.dtype(saved[key]["dtype"]) if key in saved else leaf.dtype  # missing: load() names it
        return jax.ShapeDtypeStruct(leaf.shape, dt, sharding=device)

    target = jax.tree_util.tree_map_with_path(abstract, skeleton, is_leaf=_is_shape)
    model = load(step_dir, target, subtree=MODEL_SUBTREE)
    if dtype is not None:
        from lm_pipeline.train.trainer import cast_floating

        model = cast_floating(model, resolve_dtype(dtype))
    tok = os.path.join(step_dir, TOKENIZER_DIR)
    tok_dir = tok if os.path.isfile(os.path.join(tok, "tokenizer.json")) else None
    return LoadedCheckpoint(cfg, model, tok_dir, vocab_size)


# --------------------------------------------------------------------------------------------
# Bits per byte: which bytes the evaluated tokens stand for
# --------------------------------------------------------------------------------------------


def bits_per_byte(nats: float, num_bytes: float) -> float:
    """``nats / ln 2 / num_bytes`` (NaN when there are no bytes)."""
    if not num_bytes or not math.isfinite(num_bytes) or num_bytes <= 0:
        return float("nan")
    return float(nats) / LN2 / float(num_bytes)


def _excl_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x), np.int64)
    if len(x) > 1:
        np.cumsum(x[:-1], out=out[1:])
    return out


def _stream_positions(ds: Any, rows: np.ndarray) -> np.ndarray:
    """int64 [n, T]: position in the cache's token stream of each slot of the rows (-1: padding)."""
    layout = ds.layout
    plan = layout.plan(np.asarray(rows, np.int64))
    n, T = len(rows), ds.seq_len
    if plan.segment_ids is None:  # concat: row r is tokens[r*T:(r+1)*T]
        return np.asarray(rows, np.int64)[:, None] * T + np.arange(T, dtype=np.int64)[None]
    run_len = np.asarray(plan.run_len, np.int64)
    total = int(run_len.sum())
    stream = np.repeat(np.asarray(plan.run_start, np.int64), run_len)
    stream += np.arange(total, dtype=np.int64) - np.repeat(_excl_cumsum(run_len), run_len)
    pos = np.full((n, T), -1, np.int64)
    pos[np.arange(T)[None, :] < np.asarray(plan.row_len)[:, None]] = stream
    return pos


class _ByteCounter:
    """Bytes-per-token of each document of a cache-backed dataset (see the module docstring)."""

    def __init__(self, ds: Any):
        self.ds = ds
        self.kind = "none"
        cache = getattr(ds, "cache", None)
        if cache is not None and hasattr(ds, "layout") and hasattr(cache, "doc_bytes"):
            offsets = np.asarray(cache.doc_offsets, np.int64)
            lengths = np.diff(offsets)
            self.offsets = offsets
            self.bpt = np.asarray(cache.doc_bytes, np.float64) / np.maximum(lengths, 1)
            self.kind = "documents"
        elif getattr(ds, "bytes_per_token", None) is not None:
            self.const = float(ds.bytes_per_token)
            self.kind = "constant"

    def weights(self, rows: np.ndarray, target_mask: np.ndarray) -> np.ndarray | None:
        """float64 [n, T-1]: bytes of each predicted token (0 where not predicted)."""
        if self.kind == "none":
            return None
        if self.kind == "constant":
            return target_mask * self.const
        pos = _stream_positions(self.ds, rows)[:, 1:]
        doc = np.searchsorted(self.offsets, np.maximum(pos, 0), side="right") - 1
        return np.where(target_mask > 0, self.bpt[np.clip(doc, 0, len(self.bpt) - 1)], 0.0)


def target_byte_weights(ds: SequenceDataset, rows: Sequence[int]) -> np.ndarray | None:
    """Bytes carried by each predicted token of ``rows`` (float64 [n, T-1]), or None when ``ds``
    has no byte information. Summed over all tokens of a document predicted in full, this is
    exactly the document's UTF-8 byte count."""
    rows = np.asarray(rows, np.int64)
    batch = ds.get_many(rows)
    return _ByteCounter(ds).weights(rows, _target_mask(batch.tokens, batch.segment_ids))


def _target_mask(tokens: np.ndarray, segment_ids: np.ndarray | None) -> np.ndarray:
    """float64 [n, T-1]: 1 where token t+1 is predicted from position t (the trainer's mask)."""
    tokens = np.asarray(tokens)
    if segment_ids is None:
        return np.ones((tokens.shape[0], tokens.shape[1] - 1), np.float64)
    s = np.asarray(segment_ids)
    return ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] != 0)).astype(np.float64)


# --------------------------------------------------------------------------------------------
# Unigram baseline
# --------------------------------------------------------------------------------------------


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

    ``train_cache``: a :class:`TokenCache`, a cache-backed dataset, or a cache location.
    ``vocab_size`` defaults to the tokenizer's (stored in the cache's ledger).
    """
    cache = _cache_of(train_cache)
    if vocab_size is None:
        vocab_size = int(cache.settings["vocab_size"])
    counts = _token_counts(cache, vocab_size, chunk)
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


# --------------------------------------------------------------------------------------------
# Evaluating a model
# --------------------------------------------------------------------------------------------


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
def _token_nll(model: LmModel, tokens: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """f32 [B, T-1]: -log p(token t+1 | prefix) at every position (unmasked)."""
    logits = model(tokens, segment_ids, inference=True)[:, :-1].astype(jnp.float32)
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
) -> dict[str, DatasetMetrics]:
    """Sum of next-token nats, tokens and bytes per dataset (see the module docstring).

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
    logp = unigram.log_probs if isinstance(unigram, UnigramBaseline) else unigram
    out: dict[str, DatasetMetrics] = {}
    for name, ds in datasets.items():
        t0 = time.perf_counter()
        n = len(ds)
        if n == 0:
            raise ValueError(f"validation set {name!r} has no rows (is seq_len longer than its data?)")
        n_eval = n if max_eval_batches is None else min(n, max_eval_batches * batch_size)
        counter = _ByteCounter(ds)
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
            nll = np.asarray(_token_nll(model, jnp.asarray(toks), None if seg is None else jnp.asarray(seg)), np.float64)
            mask = _target_mask(toks, seg)
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
        out[name] = DatasetMetrics(nats, tokens, nbytes, uni, n_eval, batches, time.perf_counter() - t0)
    return out


# --------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------


REPORT_COLUMNS = (
    "checkpoint", "step", "dataset", "kind", "loss", "perplexity", "bpb", "tokens", "bytes",
    "unigram_loss", "unigram_bpb", "unigram_entropy", "rows", "batches", "max_eval_batches",
    "model_type", "num_params", "seq_len", "compute_dtype", "eval_seconds",
)
KINDS = ("dataset", "micro", "macro")
MICRO, MACRO = "_micro", "_macro"  # dataset names of the aggregate rows (set names cannot start with '_')


def _rows_for(
    checkpoint: str, step: int, metrics: Mapping[str, DatasetMetrics], *, entropy: float | None,
    max_eval_batches: int | None, model_type: str, num_params: int, seq_len: int, compute_dtype: str,
) -> list[dict[str, Any]]:
    nan = float("nan")
    base = {
        "checkpoint": checkpoint, "step": int(step), "max_eval_batches": -1 if max_eval_batches is None else int(max_eval_batches),
        "model_type": model_type, "num_params": int(num_params), "seq_len": int(seq_len),
        "compute_dtype": compute_dtype, "unigram_entropy": nan if entropy is None else float(entropy),
    }
    rows = []
    for name, m in metrics.items():
        rows.append({
            **base, "dataset": name, "kind": "dataset", "loss": m.loss, "perplexity": math.exp(m.loss),
            "bpb": m.bpb, "tokens": m.tokens, "bytes": nan if m.bytes is None else m.bytes,
            "unigram_loss": m.unigram_loss, "unigram_bpb": m.unigram_bpb, "rows": m.rows,
            "batches": m.batches, "eval_seconds": m.seconds,
        })
    ms = list(metrics.values())
    nats, tokens = sum(m.nats for m in ms), sum(m.tokens for m in ms)
    have_bytes = all(m.bytes is not None for m in ms)
    have_uni = all(m.unigram_nats is not None for m in ms)
    nbytes = sum(m.bytes for m in ms) if have_bytes else None  # type: ignore[misc]
    uni = sum(m.unigram_nats for m in ms) if have_uni else None  # type: ignore[misc]
    totals = {
        "tokens": tokens, "bytes": nan if nbytes is None else nbytes, "rows": sum(m.rows for m in ms),
        "batches": sum(m.batches for m in ms), "eval_seconds": sum(m.seconds for m in ms),
    }
    micro_loss = nats / tokens
    rows.append({
        **base, **totals, "dataset": MICRO, "kind": "micro", "loss": micro_loss, "perplexity": math.exp(micro_loss),
        "bpb": nan if nbytes is None else bits_per_byte(nats, nbytes),
        "unigram_loss": nan if uni is None else uni / tokens,
        "unigram_bpb": nan if uni is None or nbytes is None else bits_per_byte(uni, nbytes),
    })
    macro_loss = float(np.mean([m.loss for m in ms]))
    rows.append({
        **base, **totals, "dataset": MACRO, "kind": "macro", "loss": macro_loss, "perplexity": math.exp(macro_loss),
        "bpb": float(np.mean([m.bpb for m in ms])) if have_bytes else nan,
        "unigram_loss": float(np.mean([m.unigram_loss for m in ms])) if have_uni else nan,
        "unigram_bpb": float(np.mean([m.unigram_bpb for m in ms])) if have_uni and have_bytes else nan,
    })
    return rows


def _frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    import pandas as pd

    df = pd.DataFrame(rows, columns=list(REPORT_COLUMNS))
    ints = ("step", "tokens", "rows", "batches", "max_eval_batches", "num_params", "seq_len")
    floats = ("loss", "perplexity", "bpb", "bytes", "unigram_loss", "unigram_bpb", "unigram_entropy", "eval_seconds")
    return df.astype({**{c: "int64" for c in ints}, **{c: "float64" for c in floats}})


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
) -> pd.DataFrame:
    """Evaluate one checkpoint on named validation sets; a validated report table.

    Args:
        step_dir: a complete checkpoint dir (or a run dir: its latest checkpoint).
        datasets: ``{name: dataset}``; cache-backed datasets (:class:`CacheDataset`) give exact
            bits per byte (see the module docstring).
        batch_size / max_eval_batches: rows per batch; cap on batches per dataset.
        compute_dtype: dtype of the forward pass; default: the run's compute dtype (trainer.mp).
        train_cache: the training token cache (or its location) for the unigram baseline; or
            pass a precomputed ``unigram`` (see :func:`unigram_baseline`). Neither: no baseline.

    Returns one row per dataset plus the ``_micro`` and ``_macro`` aggregates.
    """
    path = _resolve_checkpoint(step_dir)
    loaded = load_model_from_checkpoint(path)
    if unigram is None and train_cache is not None:
        unigram = _unigram_for(loaded, train_cache)
    return _evaluate_loaded(
        path, loaded, datasets, batch_size=batch_size, max_eval_batches=max_eval_batches,
        compute_dtype=compute_dtype, unigram=unigram,
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
    max_eval_batches: int | None, compute_dtype: Any, unigram: UnigramBaseline | None,
) -> pd.DataFrame:
    if compute_dtype is None:
        from lm_pipeline.train.config import parse_mp

        compute_dtype = parse_mp(loaded.config.trainer.mp).compute
    metrics = evaluate_model(
        loaded.model, datasets, batch_size=batch_size, max_eval_batches=max_eval_batches,
        compute_dtype=compute_dtype, unigram=unigram,
    )
    rows = _rows_for(
        path, checkpoint_step(path), metrics, entropy=None if unigram is None else unigram.entropy,
        max_eval_batches=max_eval_batches, model_type=_model_type(loaded.model),
        num_params=loaded.config.model.num_params(loaded.vocab_size), seq_len=loaded.config.model.seq_len,
        compute_dtype=jnp.dtype(resolve_dtype(compute_dtype)).name,
    )
    return validate_report(_frame(rows))


def evaluate_checkpoints(
    paths: Iterable[str | os.PathLike],
    datasets: Mapping[str, SequenceDataset],
    *,
    batch_size: int = 8,
    max_eval_batches: int | None = None,
    compute_dtype: Any = None,
    train_cache: Any = None,
    unigram: UnigramBaseline | None = None,
) -> pd.DataFrame:
    """:func:`evaluate_checkpoint` for several checkpoints (each evaluated once; the unigram
    baseline computed once), concatenated into one report."""
    import pandas as pd

    frames, seen = [], set()
    for p in paths:
        path = _resolve_checkpoint(p)
        if path in seen:  # e.g. a step dir and its run dir
            continue
        seen.add(path)
        loaded = load_model_from_checkpoint(path)
        if unigram is None and train_cache is not None:
            unigram = _unigram_for(loaded, train_cache)
        frames.append(_evaluate_loaded(
            path, loaded, datasets, batch_size=batch_size, max_eval_batches=max_eval_batches,
            compute_dtype=compute_dtype, unigram=unigram,
        ))
    if not frames:
        raise ValueError("no checkpoints to evaluate")
    return validate_report(pd.concat(frames, ignore_index=True))


def report_schema():
    """The pandera ``DataFrameSchema`` of an evaluation report."""
    import pandera.pandas as pa

    def nonneg(nullable: bool = False) -> Any:
        return pa.Column(float, pa.Check.ge(0.0), nullable=nullable)

    def perplexity_is_exp_loss(df):
        return (df["perplexity"] - np.exp(df["loss"])).abs() <= 1e-6 * df["perplexity"].abs()

    return pa.DataFrameSchema(
        {
            "checkpoint": pa.Column(str, pa.Check.str_length(min_value=1)),
            "step": pa.Column("int64", pa.Check.ge(0)),
            "dataset": pa.Column(str, pa.Check.str_length(min_value=1)),
            "kind": pa.Column(str, pa.Check.isin(KINDS)),
            "loss": nonneg(),
            "perplexity": pa.Column(float, pa.Check.ge(1.0)),
            "bpb": nonneg(nullable=True),
            "tokens": pa.Column("int64", pa.Check.gt(0)),
            "bytes": nonneg(nullable=True),
            "unigram_loss": nonneg(nullable=True),
            "unigram_bpb": nonneg(nullable=True),
            "unigram_entropy": nonneg(nullable=True),
            "rows": pa.Column("int64", pa.Check.gt(0)),
            "batches": pa.Column("int64", pa.Check.gt(0)),
            "max_eval_batches": pa.Column("int64", pa.Check.ge(-1)),
            "model_type": pa.Column(str),
            "num_params": pa.Column("int64", pa.Check.gt(0)),
            "seq_len": pa.Column("int64", pa.Check.gt(0)),
            "compute_dtype": pa.Column(str),
            "eval_seconds": nonneg(),
        },
        checks=[
            pa.Check(perplexity_is_exp_loss, error="perplexity must equal exp(loss)"),
            pa.Check(lambda df: ((df["kind"] == "dataset") != df["dataset"].isin([MICRO, MACRO])),
                     error="aggregate rows are named _micro/_macro, dataset rows are not"),
        ],
        unique=["checkpoint", "dataset"],
        strict=True,
        ordered=False,
        coerce=False,
        name="eval_report",
    )


def validate_report(df: pd.DataFrame) -> pd.DataFrame:
    """Validate a report table against :func:`report_schema`; every problem is collected and
    raised together as ``pandera.errors.SchemaErrors``."""
    return report_schema().validate(df, lazy=True)


def write_report(df: pd.DataFrame, out_dir: str | os.PathLike) -> dict[str, str]:
    """Validate ``df`` and write ``eval_report.parquet`` and ``eval_report.json`` (a list of
    records; NaN as null) into ``out_dir`` (local or fsspec URL), each atomically."""
    import io

    df = validate_report(df)
    out = os.fspath(out_dir)
    buf = io.BytesIO()
    df.to_parquet(buf, index=False)
    parquet = atomic.join(out, f"{REPORT_NAME}.parquet")
    atomic.atomic_write_bytes(parquet, buf.getvalue())
    records = json.loads(df.to_json(orient="records", double_precision=15))
    path_json = atomic.join(out, f"{REPORT_NAME}.json")
    atomic.atomic_write_json(path_json, records)
    return {"parquet": parquet, "json": path_json}


def read_report(path: str | os.PathLike) -> pd.DataFrame:
    """Read a report written by :func:`write_report` (its dir or the .parquet file), validated."""
    import pandas as pd

    p = os.fspath(path)
    if not p.endswith(".parquet"):
        p = atomic.join(p, f"{REPORT_NAME}.parquet")
    return validate_report(pd.read_parquet(p))
