"""Reading a token cache: :func:`open_cache` checks a cache against what the caller expects and
returns a :class:`TokenCache`, a read-only view bounded by the ledger's committed counts."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from lm_pipeline.data.cache.errors import (
    CacheError,
    CacheIncompleteError,
    CacheMismatchError,
    CacheNotFoundError,
)
from lm_pipeline.data.cache.ledger import format_problem, settings_problem, shard_plan
from lm_pipeline.data.cache.storage import COMPLETE, LEDGER, CacheRoot, open_array
from lm_pipeline.data.encode import Shard, tokenizer_info

__all__ = ["TokenCache", "open_cache"]


class TokenCache:
    """A read-only view of a token cache, bounded by the ledger's committed counts.

    For a cache still being built, the view is a snapshot: it never reads past the rows that
    were committed when it was opened; :meth:`refresh` takes a newer snapshot.
    """

    def __init__(self, location: str | os.PathLike, ledger: dict[str, Any], marker: dict[str, Any] | None,
                 ledger_bytes: bytes):
        self.location = os.fspath(location)
        self._root = CacheRoot(location)
        self.ledger = ledger
        self.marker = marker
        self._ledger_sha = hashlib.sha256(ledger_bytes).hexdigest()
        self._arrays: dict[str, ts.TensorStore] = {}
        self._offsets: np.ndarray | None = None
        self._doc_bytes: np.ndarray | None = None

    def __repr__(self) -> str:
        state = "complete" if self.complete else "partial"
        return f"TokenCache({self.location!r}, {state}, docs={self.num_docs}, tokens={self.num_tokens})"

    # identity and sizes
    @property
    def complete(self) -> bool:
        return self.marker is not None

    @property
    def identity(self) -> str:
        """sha256 of the ledger: changes whenever the cache's content could."""
        return self._ledger_sha

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.ledger["tokenizer"]["fingerprint"]

    @property
    def settings(self) -> dict[str, Any]:
        return self.ledger["settings"]

    @property
    def eos_id(self) -> int:
        return int(self.settings["eos_id"])

    @property
    def num_docs(self) -> int:
        return int(self.ledger["committed"]["docs"])

    @property
    def num_tokens(self) -> int:
        return int(self.ledger["committed"]["tokens"])

    @property
    def num_bytes(self) -> int:
        """UTF-8 bytes of all committed documents' text."""
        return int(self.ledger["committed"]["bytes"])

    @property
    def shards(self) -> list[dict[str, Any]]:
        return self.ledger["shards"]

    def root(self) -> CacheRoot:
        """The cache's location, for files derived from it (packing layouts)."""
        return self._root

    # arrays
    def array(self, name: str) -> ts.TensorStore:
        """The TensorStore array ``name``, restricted to the committed extent."""
        arr = self._arrays.get(name)
        if arr is None:
            n = {"tokens": self.num_tokens, "loss_mask": self.num_tokens, "doc_offsets": self.num_docs + 1,
                 "doc_bytes": self.num_docs}[name]
            arr = open_array(self._root, name)[:n]
            self._arrays[name] = arr
        return arr

    @property
    def tokens(self) -> ts.TensorStore:
        return self.array("tokens")

    @property
    def doc_offsets(self) -> np.ndarray:
        """int64 [num_docs + 1]; document i is ``tokens[offsets[i]:offsets[i + 1]]``."""
        if self._offsets is None:
            self._offsets = self.array("doc_offsets").read().result()
        return self._offsets

    @property
    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.doc_offsets)

    @property
    def doc_bytes(self) -> np.ndarray:
        """int64 [num_docs]: UTF-8 byte count of each document's text."""
        if self._doc_bytes is None:
            self._doc_bytes = self.array("doc_bytes").read().result()
        return self._doc_bytes

    def read_tokens(self, start: int, stop: int) -> np.ndarray:
        return self.tokens[start:stop].read().result()

    # a chat source's cache (lm_pipeline.data.chat)
    @property
    def chat(self) -> dict[str, Any] | None:
        """The chat settings the cache was built with (``settings.chat``); None for text."""
        return self.settings.get("chat")

    @property
    def has_loss_mask(self) -> bool:
        """Whether the cache holds a per-token loss mask (a chat source's cache)."""
        return self.chat is not None

    def read_loss_mask(self, start: int, stop: int) -> np.ndarray:
        """uint8 loss mask of tokens ``start:stop`` (1 = trained on); a chat cache only."""
        return self.array("loss_mask")[start:stop].read().result()

    def doc(self, i: int) -> np.ndarray:
        off = self.doc_offsets
        return self.read_tokens(int(off[i]), int(off[i + 1]))

    def refresh(self) -> TokenCache:
        """A new snapshot (for a cache that is still being built)."""
        return open_cache(self.location, require_complete=False)


def open_cache(
    cache_dir: str | os.PathLike,
    expected_tokenizer_fingerprint: str | None = None,
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    shards: Sequence[Shard] | None = None,
    expected_settings: Mapping[str, Any] | None = None,
    require_complete: bool = True,
) -> TokenCache:
    """Open a token cache, checking it against what the caller expects.

    Raises :class:`CacheMismatchError` (never a warning) if the ledger's format version, tokenizer
    fingerprint (``expected_tokenizer_fingerprint``, or that of ``tokenizer_dir``), tokenization
    settings (those of ``tokenizer_dir``, and ``expected_settings``) or shard list (``shards``)
    disagree; :class:`CacheIncompleteError` if the build has not finished and ``require_complete``;
    :class:`CacheNotFoundError` if there is no cache.
    """
    root = CacheRoot(cache_dir)
    for _ in range(5):  # the builder may finalize between our two reads: re-read on a mismatch
        data = root.read(LEDGER)
        if data is None:
            raise CacheNotFoundError(f"{root}: no token cache here ({LEDGER} is missing)")
        marker = root.read_json(COMPLETE)
        if marker is None or marker.get("ledger_sha256") == hashlib.sha256(data).hexdigest():
            break
    ledger = json.loads(data)
    where = f"token cache {root}"
    problem = format_problem(ledger)
    if problem:
        raise CacheMismatchError(f"{where}: {problem}")
    have = ledger["tokenizer"]["fingerprint"]
    if expected_tokenizer_fingerprint is not None and have != expected_tokenizer_fingerprint:
        raise CacheMismatchError(
            f"{where} was built with tokenizer {have[:16]}…, but tokenizer {expected_tokenizer_fingerprint[:16]}… "
            "was expected; rebuild the cache for this tokenizer"
        )
    if tokenizer_dir is not None:
        info = tokenizer_info(os.fspath(tokenizer_dir))
        if info.fingerprint != have:
            raise CacheMismatchError(
                f"{where} was built with tokenizer {have[:16]}…, but {tokenizer_dir} is {info.fingerprint[:16]}…; "
                "rebuild the cache for this tokenizer"
            )
        problem = settings_problem(ledger, info.settings())
        if problem:
            raise CacheMismatchError(f"{where}: tokenization {problem}")
    if expected_settings:
        problem = settings_problem(ledger, expected_settings)
        if problem:
            raise CacheMismatchError(f"{where}: {problem}")
    if shards is not None:
        plan = shard_plan(list(shards))
        if ledger["plan"] != plan:
            raise CacheMismatchError(
                f"{where} was built from other shards ({ledger['plan']['num_shards']} shards) than given "
                f"({plan['num_shards']} shards)"
            )
    if marker is not None and marker.get("ledger_sha256") != hashlib.sha256(data).hexdigest():
        raise CacheError(f"{where}: {COMPLETE} does not match {LEDGER}; the cache is corrupt, rebuild it")
    if marker is None and require_complete:
        c = ledger["committed"]
        raise CacheIncompleteError(
            f"{where} is incomplete ({c['shards']} of {ledger['plan']['num_shards']} shards committed); "
            "finish it with build_cache (it resumes) or open with require_complete=False"
        )
    return TokenCache(cache_dir, ledger, marker, data)
