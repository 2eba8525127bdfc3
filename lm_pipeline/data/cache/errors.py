"""The token cache's exceptions."""

from __future__ import annotations

__all__ = ["CacheError", "CacheIncompleteError", "CacheMismatchError", "CacheNotFoundError", "CacheStalledError"]


class CacheError(RuntimeError):
    """A token cache problem."""


class CacheNotFoundError(CacheError, FileNotFoundError):
    """No cache (no ledger) at the given location."""


class CacheMismatchError(CacheError):
    """The cache was built with another tokenizer, other settings, shards or format version."""


class CacheIncompleteError(CacheError):
    """The cache's build has not finished (no completion marker)."""



class CacheStalledError(CacheError):
    """A reader waited for a cache under construction that stopped growing (its builder died)."""
