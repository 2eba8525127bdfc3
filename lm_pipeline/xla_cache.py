"""JAX's persistent compilation cache, turned on for training, evaluation and generation.

A re-run, a resumed run or an evaluation of the same shapes loads its compiled programs from
disk instead of compiling them again (the tiny GPT-2's train step: seconds of XLA compilation).
:func:`enable` is the one switch; ``train()``, the evaluation and ``generate_text`` call it first.

Where the cache lives (:func:`cache_dir_for`), first rule that applies:

* ``$JAX_COMPILATION_CACHE_DIR`` is set (or the program set ``jax_compilation_cache_dir``
  itself): left alone, that directory is used as JAX's own settings say;
* ``$LM_PIPELINE_XLA_CACHE`` is ``0``/``off``/``false``/``no``: no persistent cache (opt out);
* ``$LM_PIPELINE_XLA_CACHE`` is a directory: ``<that dir>/<key>``;
* the store is local (``store.root`` a path or ``file://``): ``<store.root>/_xla_cache/<key>``;
* the store is a URL (``s3://``, ``gs://``, ...): a local directory,
  ``$XDG_CACHE_HOME/lm_pipeline/xla/<key>`` (default ``~/.cache/lm_pipeline/xla/<key>``);
  compiled programs are machine-specific and small, not worth a round trip to an object store.

``<key>`` (:func:`cache_key`) names the platform, the jax and jaxlib versions and a hash of the
machine's architecture and CPU features. JAX's own entry key covers the program (its HLO), the
compile options, the backend and its version and ``XLA_FLAGS``, but not the host CPU's features,
for which XLA:CPU generates code: a store shared by machines of different CPUs must not hand one
machine's code to another. The native CPU attention kernel is not inside a cached program: the
program calls it by its XLA FFI name, registered in each process from this machine's own build
(``kernels/cpu/native_attention.py`` builds and registers it while the step is traced, before
the cache is looked up).

Writes: JAX's file cache writes an entry in place (``write_bytes``), so a process killed while
writing would leave a truncated entry that every later run fails to read (and recompiles: JAX
never replaces an existing entry). :func:`enable` installs the same cache with one change: an
entry is written to a temporary file in the directory and renamed into place, so readers see a
whole entry or none; concurrent writers of one key write the same bytes, and the last rename
wins. If JAX's internals differ from what this expects, JAX's own cache is used unchanged.

The cache is trusted code (JAX's warning): whoever can write into it can run code in processes
that read it. Keep it where only the pipeline's users can write, as the store itself.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Mapping
from importlib import metadata

from lm_pipeline.hostinfo import detect_platform, machine_signature

log = logging.getLogger(__name__)

DIR_ENV = "LM_PIPELINE_XLA_CACHE"
JAX_DIR_ENV = "JAX_COMPILATION_CACHE_DIR"
STORE_SUBDIR = "_xla_cache"
_OFF = ("0", "off", "false", "no", "none", "disabled")

#: Programs that compile faster than this are not written. JAX's default (1 s) leaves out the
#: evaluation step and the few dozen small programs of start-up and of the first step's logging
#: (0.01-0.2 s each to compile, a few ms to load: together seconds on a loaded CPU).
MIN_COMPILE_SECS = 0.0

_lock = threading.Lock()
_ours: set[str] = set()  # directories this module configured (not the user's)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def cache_key(platform: str | None = None) -> str:
    """The directory name under which this host's compiled programs are kept, e.g.
    ``cpu-jax0.10.2-jaxlib0.10.2-1a2b3c4d5e6f`` (platform, versions, machine signature)."""
    platform = platform or detect_platform()
    return f"{platform}-jax{_version('jax')}-jaxlib{_version('jaxlib')}-{machine_signature()}"


def disabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``$LM_PIPELINE_XLA_CACHE`` opts out."""
    env = os.environ if environ is None else environ
    return (env.get(DIR_ENV) or "").strip().lower() in _OFF and bool((env.get(DIR_ENV) or "").strip())


def cache_dir_for(store_root: str | os.PathLike | None, environ: Mapping[str, str] | None = None,
                  platform: str | None = None) -> str | None:
    """The compilation cache directory for a store at ``store_root`` (see the module docstring),
    or None when opted out. ``$JAX_COMPILATION_CACHE_DIR``, when set, is returned as it is."""
    from lm_pipeline.fs import as_local

    env = os.environ if environ is None else environ
    if env.get(JAX_DIR_ENV):
        return env[JAX_DIR_ENV]
    if disabled(env):
        return None
    key = cache_key(platform)
    chosen = (env.get(DIR_ENV) or "").strip()
    if chosen:
        return os.path.join(os.path.abspath(os.path.expanduser(chosen)), key)
    local = as_local(os.fspath(store_root)) if store_root else None
    if local is not None:
        return os.path.join(local, STORE_SUBDIR, key)
    base = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lm_pipeline", "xla", key)


def enable(store_root: str | os.PathLike | None, environ: Mapping[str, str] | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache for this process (for the store at
    ``store_root``; see the module docstring); returns the directory in use, or None when off.

    Call it before the first compilation that should be cached. A directory the user chose for
    JAX (``$JAX_COMPILATION_CACHE_DIR`` or ``jax_compilation_cache_dir``) is kept, with JAX's
    settings as the user left them. Calling it again with another store switches this process's
    cache to that store's directory.
    """
    env = os.environ if environ is None else environ
    if env.get(JAX_DIR_ENV):
        return env[JAX_DIR_ENV]  # JAX reads it itself
    if disabled(env):
        return None
    import jax

    with _lock:
        current = jax.config.jax_compilation_cache_dir
        if current and current not in _ours:
            return current  # set by the program itself: the user's choice
        path = cache_dir_for(store_root, env)
        if path is None or path == current:
            return path
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            log.warning("XLA compilation cache off: cannot create %s (%s)", path, e)
            return None
        _ours.add(path)
        if current:  # ours, for another store: JAX keeps the first directory unless reset
            from jax.experimental.compilation_cache import compilation_cache as cc

            cc.reset_cache()
        jax.config.update("jax_compilation_cache_dir", path)
        if not env.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
            jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
        _install_atomic_cache(path)
    log.info("XLA compilation cache: %s", path)
    return path


_atomic_class: list[type] = []


def atomic_cache_class() -> type:
    """JAX's file cache (:func:`lm_pipeline.jax_private.file_cache_class`) whose ``put``
    writes a temporary file in the directory and renames it into place (readers see a whole entry
    or none). With a size bound (``jax_compilation_cache_max_size``) JAX's own locked ``put`` is
    kept. Raises ImportError when JAX has no such class."""
    if _atomic_class:
        return _atomic_class[0]
    from lm_pipeline import jax_private

    class AtomicLRUCache(jax_private.file_cache_class()):
        def put(self, key: str, value: bytes) -> None:
            if getattr(self, "eviction_enabled", True):
                return super().put(key, value)
            if not key:
                raise ValueError("key cannot be empty")
            directory = os.fspath(self.path)
            target = os.path.join(directory, f"{key}-cache")
            if os.path.exists(target):  # as JAX: an entry is never replaced
                return
            fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=directory)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(value)
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)

    _atomic_class.append(AtomicLRUCache)
    return AtomicLRUCache


def _install_atomic_cache(path: str) -> bool:
    """Open JAX's cache for ``path`` as :func:`atomic_cache_class`; False (JAX opens its own cache
    as usual) when JAX's internals are not as expected or its cache is already open."""
    import jax

    from lm_pipeline import jax_private

    if jax_private.problems():
        return False
    cls = atomic_cache_class()
    try:
        cache = jax_private.install_compilation_cache(
            lambda: cls(path, max_size=jax.config.jax_compilation_cache_max_size))
    except Exception as e:  # noqa: BLE001 - JAX's own initialization will try again
        log.debug("atomic XLA cache not installed: %s", e)
        return False
    return isinstance(cache, cls)


def installed_cache() -> object | None:
    """JAX's open persistent cache object in this process (None before the first use)."""
    from lm_pipeline import jax_private

    try:
        return jax_private.open_compilation_cache()
    except (ImportError, AttributeError):
        return None
