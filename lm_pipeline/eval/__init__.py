"""Evaluation of checkpoints: loss, perplexity and bits-per-byte per validation set, a unigram
baseline, and reports as validated tables (Parquet + JSON).

Modules: :mod:`~lm_pipeline.eval.config` (the ``eval:`` section; light, no JAX),
:mod:`~lm_pipeline.eval.loading` (a model from a training checkpoint),
:mod:`~lm_pipeline.eval.bpb` (bytes of the evaluated tokens), :mod:`~lm_pipeline.eval.unigram`
(the baseline), :mod:`~lm_pipeline.eval.evaluate` (the evaluation loop) and
:mod:`~lm_pipeline.eval.report` (report tables); :mod:`~lm_pipeline.eval.data` finds the
validation sets' token caches for a checkpoint's tokenizer (building only those no cache holds).
Every public name is importable from ``lm_pipeline.eval``; the submodules load on first use, so
importing the config stays light.

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

from lm_pipeline.lazy import lazy_exports

# Public name -> its submodule. Loaded on first access (PEP 562) so that `lm_pipeline.config`,
# which imports `lm_pipeline.eval.config`, does not pull in JAX through this package.
_EXPORTS = {
    "EvalConfig": "config",
    "resolve_dtype": "config",
    "LoadedCheckpoint": "loading",
    "checkpoint_step": "loading",
    "load_model_from_checkpoint": "loading",
    "bits_per_byte": "bpb",
    "target_byte_weights": "bpb",
    "UnigramBaseline": "unigram",
    "unigram_baseline": "unigram",
    "unigram_log_probs": "unigram",
    "EvalData": "data",
    "eval_datasets": "data",
    "DatasetMetrics": "evaluate",
    "evaluate_checkpoint": "evaluate",
    "evaluate_checkpoints": "evaluate",
    "evaluate_model": "evaluate",
    "REPORT_COLUMNS": "report",
    "read_report": "report",
    "report_schema": "report",
    "validate_report": "report",
    "write_report": "report",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
