"""Writing a token cache: start an empty one, append shards past the committed counts, commit
groups of them by replacing the ledger, finalize (exact shapes, then the ``COMPLETE`` marker).

The tokenizing builder (:mod:`lm_pipeline.data.cache.build`) and the merge of part caches
(:mod:`lm_pipeline.data.cache.merge`) both write through here, so their outputs are the same bytes.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import tensorstore as ts

from lm_pipeline.data.cache.errors import CacheError
from lm_pipeline.data.cache.ledger import FORMAT, FORMAT_VERSION, new_ledger
from lm_pipeline.data.cache.storage import (
    ARRAYS,
    COMPLETE,
    KNOWN_ENTRIES,
    LEDGER,
    LOSS_MASK,
    PACKING_DIR,
    CacheRoot,
    create_array,
    dumps_json,
    open_array,
    resized,
)
from lm_pipeline.data.encode import TOKEN_DTYPE, EncodedShard, Shard, TokenizerInfo
from lm_pipeline.faultpoints import faultpoint

__all__ = ["Committer", "clear_cache", "finalize_cache", "open_arrays", "start_cache"]

Arrays = dict[str, ts.TensorStore]


def start_cache(root: CacheRoot, info: TokenizerInfo, plan: dict[str, Any],
                chat: dict[str, Any] | None = None) -> tuple[dict[str, Any], Arrays]:
    """Replace whatever is at ``root`` by an empty cache (no shards committed); its ledger and arrays.
    ``chat``: a chat source's ledger settings (:meth:`ChatSettings.ledger`): the cache then holds
    the loss mask too."""
    clear_cache(root)  # also removes leftovers of a build that died before its first ledger
    arrays = {name: create_array(root, name) for name in (*ARRAYS, *((LOSS_MASK,) if chat else ()))}
    arrays["doc_offsets"] = resized(arrays["doc_offsets"], 1)
    arrays["doc_offsets"][0:1].write(np.zeros(1, np.int64)).result()
    ledger = new_ledger(info, plan, chat)
    root.write_atomic(LEDGER, dumps_json(ledger))
    return ledger, arrays


def open_arrays(root: CacheRoot, chat: bool = False) -> Arrays:
    """The arrays of an existing cache, to resume writing (the loss mask too for a chat cache)."""
    return {name: open_array(root, name) for name in (*ARRAYS, *((LOSS_MASK,) if chat else ()))}


class Committer:
    """Appends shards to the arrays past the committed counts; commits groups through the ledger.

    A shard is written part by part as it is tokenized (:meth:`append_part`, so the builder holds
    at most the parts in flight, not a whole shard or group) and closed by :meth:`end_shard`,
    which stages its ledger record. Readers see nothing of it until :meth:`commit`, which only
    takes whole shards: a build that dies mid-shard leaves that shard's parts past the committed
    counts, where no reader looks and the resumed build overwrites them.
    """

    def __init__(self, root: CacheRoot, ledger: dict[str, Any], arrays: Arrays):
        self.root = root
        self.ledger = ledger
        self.arrays = arrays
        c = ledger["committed"]
        self.docs, self.tokens, self.bytes = c["docs"], c["tokens"], c["bytes"]
        self.staged: list[dict[str, Any]] = []
        self._open: tuple[int, int, int] | None = None  # (docs, tokens, bytes) where the open shard began

    def append_part(self, part: EncodedShard) -> None:
        """Write ``part`` (whole documents of the shard being written) past what is written so far."""
        if self._open is None:
            self._open = (self.docs, self.tokens, self.bytes)
        d0, t0 = self.docs, self.tokens
        n, m = len(part.doc_lengths), len(part.tokens)
        d1, t1 = d0 + n, t0 + m
        a = self.arrays
        a["tokens"] = resized(a["tokens"], t1)
        a["doc_offsets"] = resized(a["doc_offsets"], d1 + 1)
        a["doc_bytes"] = resized(a["doc_bytes"], d1)
        if (LOSS_MASK in a) != (part.loss_mask is not None):
            raise CacheError(f"{self.root}: a chat cache takes parts with a loss mask, a text cache parts without")
        futures = []
        if LOSS_MASK in a:
            a[LOSS_MASK] = resized(a[LOSS_MASK], t1)
            if m:
                futures.append(a[LOSS_MASK][t0:t1].write(part.loss_mask))
        if m:
            futures.append(a["tokens"][t0:t1].write(part.tokens.astype(TOKEN_DTYPE, copy=False)))
        if n:
            futures.append(a["doc_offsets"][d0 + 1 : d1 + 1].write(t0 + np.cumsum(part.doc_lengths)))
            futures.append(a["doc_bytes"][d0:d1].write(part.doc_bytes))
        for f in futures:
            f.result()
        self.docs, self.tokens, self.bytes = d1, t1, self.bytes + int(part.doc_bytes.sum())

    def end_shard(self, shard: Shard) -> None:
        """Close the shard whose parts were appended (none: an empty shard) and stage its record."""
        d0, t0, b0 = self._open if self._open is not None else (self.docs, self.tokens, self.bytes)
        self._open = None
        self.staged.append({"name": shard.name, "fingerprint": shard.fingerprint, "doc_start": d0,
                            "docs": self.docs - d0, "token_start": t0, "tokens": self.tokens - t0,
                            "bytes": self.bytes - b0})

    def append(self, shard: Shard, part: EncodedShard) -> None:
        """Write a whole shard at once (``append_part`` + ``end_shard``)."""
        self.append_part(part)
        self.end_shard(shard)

    def commit(self) -> None:
        """Make the ended shards visible: one atomic ledger replacement.

        Shards are committed in order, each starting where the committed ones end: every
        committed state is a prefix of the final cache (training may read it while it grows).
        """
        if self._open is not None:
            raise CacheError("commit with a shard partly written: end_shard first")
        c = self.ledger["committed"]
        for rec in self.staged:  # contiguous from the committed counts, in order
            if (rec["doc_start"], rec["token_start"]) != (c["docs"], c["tokens"]):
                raise CacheError(f"{self.root}: shard {rec['name']} starts at doc {rec['doc_start']}, token "
                                 f"{rec['token_start']}, not where the committed shards end; not committing")
            c = {"docs": rec["doc_start"] + rec["docs"], "tokens": rec["token_start"] + rec["tokens"]}
        faultpoint("token_cache.before_commit")  # shards appended to the arrays, ledger not yet replaced
        self.ledger["shards"].extend(self.staged)
        self.ledger["committed"] = {
            "shards": self.ledger["committed"]["shards"] + len(self.staged),
            "docs": self.docs,
            "tokens": self.tokens,
            "bytes": self.bytes,
        }
        self.staged = []
        self.root.write_atomic(LEDGER, dumps_json(self.ledger))  # the commit point
        faultpoint("token_cache.after_commit")


def clear_cache(root: CacheRoot) -> None:
    """Remove a cache's files: the marker first, then the ledger, then the data."""
    unknown = root.entries() - KNOWN_ENTRIES
    unknown = {e for e in unknown if not e.startswith(".")}
    if unknown:
        raise CacheError(
            f"{root}: refusing to delete a directory that holds other files too: {sorted(unknown)[:5]}"
        )
    root.delete(COMPLETE)
    root.delete(LEDGER)
    for name in (PACKING_DIR, LOSS_MASK, *ARRAYS):
        root.delete_tree(name)


def finalize_cache(root: CacheRoot, ledger: dict[str, Any], arrays: Arrays) -> None:
    """Mark the cache complete: trim the arrays to the committed counts, mark the ledger complete,
    then write ``COMPLETE`` (it records the ledger's sha256)."""
    c = ledger["committed"]
    # Exact final shapes (an interrupted run may have left a longer, uncommitted tail).
    arrays["tokens"] = resized(arrays["tokens"], c["tokens"])
    arrays["doc_offsets"] = resized(arrays["doc_offsets"], c["docs"] + 1)
    arrays["doc_bytes"] = resized(arrays["doc_bytes"], c["docs"])
    if LOSS_MASK in arrays:
        arrays[LOSS_MASK] = resized(arrays[LOSS_MASK], c["tokens"])
    ledger["complete"] = True
    data = dumps_json(ledger)
    root.write_atomic(LEDGER, data)
    faultpoint("token_cache.before_complete")  # ledger says complete, the marker is not there yet
    marker = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "ledger_sha256": hashlib.sha256(data).hexdigest(),
        **c,
    }
    root.write_atomic(COMPLETE, dumps_json(marker))  # last, atomically

