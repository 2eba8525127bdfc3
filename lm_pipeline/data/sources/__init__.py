"""Data sources: configured urls / Hugging Face datasets / built-in corpora -> picklable shards.

=========================  =============================================================
module                     job
=========================  =============================================================
``sources.resolve``        the ``data:`` config -> each split's shards (url expansion)
``sources.shard``          :class:`Shard` (read, validate) and its fingerprint
``sources.readers``        file formats: bytes -> records (JSONL, JSON, text, Parquet)
``sources.streams``        opening, decompressing and hashing a file's bytes
``sources.hf``             Hugging Face datasets: loading, identity, rows
=========================  =============================================================

The names below are the package's interface; import them from ``lm_pipeline.data.sources``.
"""

from lm_pipeline.data.sources.hf import HFSpec
from lm_pipeline.data.sources.readers import READER_VERSION, ReaderSettings, infer_format
from lm_pipeline.data.sources.resolve import expand_urls, resolve_shards, split_names, validation_sets
from lm_pipeline.data.sources.shard import Shard, iter_shard_texts, scan_shards, shard_fingerprint
from lm_pipeline.data.validation import DataValidationError, ShardChangedError, ShardReport

__all__ = [
    "READER_VERSION",
    "DataValidationError",
    "HFSpec",
    "ReaderSettings",
    "Shard",
    "ShardChangedError",
    "ShardReport",
    "expand_urls",
    "infer_format",
    "iter_shard_texts",
    "resolve_shards",
    "scan_shards",
    "shard_fingerprint",
    "split_names",
    "validation_sets",
]
