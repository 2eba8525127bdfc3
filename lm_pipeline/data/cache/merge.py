"""Merging part caches: the cache of all parts' shards, written from caches of groups of them.

A pipeline may tokenize groups of shards as separate steps (each its own complete cache) and then
join them; the joined cache is byte-for-byte the one :func:`~lm_pipeline.data.cache.build_cache`
writes for the concatenated shards, without tokenizing again.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from lm_pipeline.data.cache.ledger import incompatibility, shard_plan
from lm_pipeline.data.cache.reader import TokenCache, open_cache
from lm_pipeline.data.cache.storage import COMPLETE, LEDGER, CacheRoot
from lm_pipeline.data.cache.writer import Committer, finalize_cache, start_cache
from lm_pipeline.data.encode import TOKEN_DTYPE, EncodedShard, Shard, tokenizer_info

__all__ = ["merge_cache_parts"]

# Tokens copied per append: a shard is copied in pieces of whole documents of at most this many
# tokens (or one longer document), so a merge's memory does not grow with the shards' size.
PIECE_TOKENS = 1 << 22


def _shard_pieces(part: TokenCache, d0: int, n: int) -> Iterator[EncodedShard]:
    """Documents ``d0 .. d0 + n`` of ``part`` in pieces of whole documents."""
    offsets = np.asarray(part.array("doc_offsets")[d0 : d0 + n + 1].read().result(), np.int64)
    nbytes = np.asarray(part.array("doc_bytes")[d0 : d0 + n].read().result(), np.int64)
    chat = part.has_loss_mask
    a = 0
    while a < n:
        b = int(np.searchsorted(offsets, offsets[a] + PIECE_TOKENS, side="right")) - 1
        b = min(max(b, a + 1), n)
        t0, t1 = int(offsets[a]), int(offsets[b])
        tokens = part.read_tokens(t0, t1) if t1 > t0 else np.zeros(0, TOKEN_DTYPE)
        mask = part.read_loss_mask(t0, t1) if chat else None
        yield EncodedShard(tokens, np.diff(offsets[a : b + 1]), nbytes[a:b], mask)
        a = b


def merge_cache_parts(
    out_dir: str | os.PathLike,
    parts: Sequence[tuple[Sequence[Shard], str | os.PathLike]],
    tokenizer_dir: str | os.PathLike,
    chat: Any = None,
) -> dict[str, Any]:
    """Write the token cache of all parts' shards at ``out_dir``; return its ledger.

    ``parts``: ``(shards of the group, part cache dir)`` in shard order; each part must be a
    complete cache of exactly its shards built with the tokenizer at ``tokenizer_dir`` (else
    :func:`open_cache` raises). Each part's shards are committed as one group. Idempotent: a
    complete cache of the same inputs at ``out_dir`` is returned untouched; anything else there
    is replaced. ``chat``: a chat source's :class:`~lm_pipeline.data.chat.ChatSettings` (the
    parts' loss masks are copied too).
    """
    tokenizer_dir = os.fspath(tokenizer_dir)
    shards = [s for group, _ in parts for s in group]
    root = CacheRoot(out_dir)
    info = tokenizer_info(tokenizer_dir)
    plan = shard_plan(shards)
    chat_ledger = chat.ledger() if chat is not None else None
    with root.build_lock():
        ledger = root.read_json(LEDGER)
        if (ledger is not None and incompatibility(ledger, info, plan, chat_ledger) is None and ledger.get("complete")
                and root.exists(COMPLETE)):
            return ledger
        ledger, arrays = start_cache(root, info, plan, chat_ledger)
        committer = Committer(root, ledger, arrays)
        for group, part_dir in parts:
            part = open_cache(part_dir, tokenizer_dir=tokenizer_dir, shards=list(group),
                              expected_settings={"chat": chat_ledger} if chat_ledger else None)
            for rec, shard in zip(part.shards, group, strict=True):
                for piece in _shard_pieces(part, rec["doc_start"], rec["docs"]):
                    committer.append_part(piece)
                committer.end_shard(shard)
            committer.commit()
        finalize_cache(root, ledger, arrays)
    return ledger
