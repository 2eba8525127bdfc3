"""JAX's private names the pipeline uses, each where JAX has no public API for it.

* the coordination service's key-value client of ``jax.distributed`` (the multi-process
  checkpoint commit exchanges its parts through it): ``jax.distributed`` exports only
  ``initialize``, ``is_initialized`` and ``shutdown``; Orbax reads the same attribute;
* whether JAX's backends are initialized, asked without initializing them (``hostinfo``):
  ``jax.extend.backend.backends()`` would initialize them;
* the persistent compilation cache's file cache class and the slot of the open cache
  (``xla_cache`` opens the same cache with atomic writes): the public
  ``jax.experimental.compilation_cache`` can only set a directory or reset the cache.

Nothing else in the core reaches into ``jax._src`` (the Dagster layer's one private use is
``assets/_preload.py``). Nothing here imports JAX at import time. :data:`NAMES` lists every
private name used; :func:`problems` says which of them the installed JAX lacks
(``tests/test_private_apis.py`` fails on any, naming it and this module).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["NAMES", "backends_initialized", "coordination_client", "file_cache_class", "install_compilation_cache",
           "open_compilation_cache", "problems"]

#: module -> the attributes read from it.
NAMES: dict[str, tuple[str, ...]] = {
    "jax._src.distributed": ("global_state",),
    "jax._src.xla_bridge": ("_backends",),
    "jax._src.lru_cache": ("LRUCache",),
    "jax._src.compilation_cache": ("_cache", "_cache_initialized", "_cache_initialized_mutex"),
}


def problems() -> list[str]:
    """One line per private name of :data:`NAMES` the installed JAX lacks (empty: all present)."""
    out = []
    for module, attrs in NAMES.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            out.append(f"{module}: cannot be imported ({e})")
            continue
        out.extend(f"{module}.{a}: missing" for a in attrs if not hasattr(mod, a))
    return out


def coordination_client() -> Any:
    """The ``jax.distributed`` coordination client (``key_value_set``,
    ``blocking_key_value_get``, ...), or None before ``jax.distributed.initialize()``."""
    from jax._src import distributed

    return distributed.global_state.client


def backends_initialized() -> bool:
    """Whether JAX has initialized its backends (asked without initializing them)."""
    from jax._src import xla_bridge

    return bool(xla_bridge._backends)


def file_cache_class() -> type:
    """JAX's file-backed compilation cache class (``LRUCache(path, max_size=...)``; its
    ``path``, ``eviction_enabled`` and ``put(key, value)``)."""
    from jax._src.lru_cache import LRUCache

    return LRUCache


def open_compilation_cache() -> Any | None:
    """The persistent compilation cache JAX has open in this process, or None before first use."""
    from jax._src import compilation_cache as cc

    return cc._cache


def install_compilation_cache(make: Callable[[], Any]) -> Any:
    """Open the persistent compilation cache as ``make()`` builds it, unless JAX has one open
    already; returns the cache in use (JAX's own one if it was open). ``make`` raising leaves
    JAX's cache closed, to be opened by JAX as usual."""
    from jax._src import compilation_cache as cc

    lock: threading.Lock = cc._cache_initialized_mutex
    with lock:
        if cc._cache is None:
            cc._cache = make()
            cc._cache_initialized = True
        return cc._cache
