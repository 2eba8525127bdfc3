"""The token cache: documents tokenized once, stored in TensorStore, independent of ``seq_len``.

On-disk layout of a cache directory (a local path or any TensorStore kvstore URL such as
``gs://bucket/cache/`` or ``memory://name/``)::

    <cache>/
      ledger.json        committed state (JSON, replaced atomically after every shard group)
      COMPLETE           completion marker, written last and atomically
      tokens/            zarr3 uint32 [num_tokens]     all documents' token ids, concatenated
      doc_offsets/       zarr3 int64  [num_docs + 1]   document i = tokens[offsets[i]:offsets[i+1]]
      doc_bytes/         zarr3 int64  [num_docs]       UTF-8 bytes of document i's text (for bits/byte)
      packing/<strategy>-<seq_len>/   layouts derived by :mod:`lm_pipeline.data.packing`
      .build.lock        (local caches) held by the one running builder

Every document ends with exactly one EOS; what else the tokenizer adds (BOS, ...) is detected
rather than assumed (see :mod:`lm_pipeline.data.encode`).

Building and committing. Shards are tokenized in parallel by worker processes and committed in
order; each shard's ids, offsets and byte counts are written to the arrays *past* the committed
counts (space no reader reads: readers bound every read by the ledger's committed counts) one
encode batch at a time as it is tokenized (so memory is bounded by the batch, not the shard), and
once a *group* of ``shard_group_size`` whole shards is written the ledger is atomically replaced
with the new counts. That replacement is the commit: a reader sees whole
groups or nothing. A build killed at any point resumes from the last committed group; the uncommitted tail is overwritten
with identical bytes, so a resumed build ends byte-identical to an uninterrupted one. The output
never depends on the number of workers (commit order is the shard order). When all shards are
committed the ledger is marked complete and then ``COMPLETE`` is written (temp file + rename).
Since shards are committed in shard order, each one starting where the committed ones end, every
committed state is a prefix of the final cache: a reader may train on it while the cache grows
(:class:`lm_pipeline.data.loader.GrowingCacheDataset`, ``data.shuffle: era``).

=====================  ==================================================================
module                 job
=====================  ==================================================================
``cache.build``        :func:`build_cache`: tokenize shards, commit them in groups
``cache.merge``        :func:`merge_cache_parts`: join part caches without tokenizing
``cache.writer``       start, append, commit and finalize (shared by build and merge)
``cache.reader``       :func:`open_cache` and :class:`TokenCache`
``cache.ledger``       the ledger's format and the checks that a cache matches
``cache.storage``      the location (local or kvstore), atomic writes, lock, arrays
``cache.errors``       the exceptions
=====================  ==================================================================
"""

from lm_pipeline.data.cache.build import build_cache
from lm_pipeline.data.cache.errors import (
    CacheError,
    CacheIncompleteError,
    CacheMismatchError,
    CacheNotFoundError,
    CacheStalledError,
)
from lm_pipeline.data.cache.ledger import FORMAT_VERSION
from lm_pipeline.data.cache.merge import merge_cache_parts
from lm_pipeline.data.cache.reader import TokenCache, open_cache
from lm_pipeline.data.cache.storage import PACKING_DIR
from lm_pipeline.data.encode import tokenizer_fingerprint

__all__ = [
    "FORMAT_VERSION",
    "PACKING_DIR",
    "CacheError",
    "CacheIncompleteError",
    "CacheMismatchError",
    "CacheNotFoundError",
    "CacheStalledError",
    "TokenCache",
    "build_cache",
    "merge_cache_parts",
    "open_cache",
    "tokenizer_fingerprint",
]
