"""What this host computes on, found without importing JAX: the platform a run will train on,
and a signature of the machine (architecture and CPU features).

:func:`detect_platform` decides, in this order:

1. ``$JAX_PLATFORMS`` when set: its first entry (``cpu``; ``cuda``/``rocm``/``gpu`` -> ``gpu``;
   ``tpu``), which is what JAX itself will use;
2. JAX's default backend when JAX is imported and its backends are already initialized (free);
3. an installed accelerator plugin whose device is present: a CUDA plugin (``jax_cuda*_plugin``
   or ``jax_plugins.xla_cuda*``) with ``/dev/nvidiactl``, a ROCm plugin with ``/dev/kfd`` -> ``gpu``;
   ``libtpu`` with ``/dev/accel*`` or ``/dev/vfio/*`` -> ``tpu``;
4. otherwise ``cpu``.

It never initializes a JAX backend: an orchestrator computing addresses (the Dagster
webserver) must not allocate an accelerator's memory. ``trainer.mp: auto`` resolves with it
(:mod:`lm_pipeline.train.config`), and the XLA compilation cache keys its directory with it
(:mod:`lm_pipeline.xla_cache`).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib.util
import os
import pkgutil
import platform as _platform
import sys
from pathlib import Path

PLATFORMS = ("cpu", "gpu", "tpu")
_ALIASES = {"cpu": "cpu", "cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu"}


def platform_from_env(value: str | None) -> str | None:
    """The platform named first by a ``JAX_PLATFORMS`` value (``'cuda,cpu'`` -> ``'gpu'``), or None
    when it is unset or empty. An unknown name counts as an accelerator (``gpu``)."""
    first = next((p.strip().lower() for p in (value or "").split(",") if p.strip()), None)
    if first is None:
        return None
    return _ALIASES.get(first, "gpu")


def _jax_backend() -> str | None:
    """JAX's default backend when JAX is imported and its backends are initialized, else None."""
    if "jax" not in sys.modules:
        return None
    try:
        from lm_pipeline import jax_private

        if not jax_private.backends_initialized():
            return None
        import jax

        return _ALIASES.get(jax.default_backend().lower(), "gpu")
    except Exception:  # noqa: BLE001 - a private name moved: fall back to the other rules
        return None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@functools.lru_cache(maxsize=1)
def _plugins() -> frozenset[str]:
    """Names of the installed JAX accelerator plugins (``jax_plugins.*`` and the top-level ones)."""
    names = {n for n in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin",
                         "libtpu") if _has_module(n)}
    try:
        spec = importlib.util.find_spec("jax_plugins")
        if spec is not None and spec.submodule_search_locations:
            names |= {m.name for m in pkgutil.iter_modules(list(spec.submodule_search_locations))}
    except (ImportError, ValueError):
        pass
    return frozenset(names)


def _installed_accelerator(plugins: set[str] | frozenset[str], exists=os.path.exists, globber=glob.glob) -> str | None:
    if any("cuda" in p for p in plugins) and exists("/dev/nvidiactl"):
        return "gpu"
    if any("rocm" in p for p in plugins) and exists("/dev/kfd"):
        return "gpu"
    if any("tpu" in p for p in plugins) and (globber("/dev/accel*") or globber("/dev/vfio/[0-9]*")):
        return "tpu"
    return None


def detect_platform(environ: dict[str, str] | None = None) -> str:
    """``'cpu'``, ``'gpu'`` or ``'tpu'``: the platform a run started here would train on (see the
    module docstring for the rules). Imports no JAX and initializes no backend."""
    env = os.environ if environ is None else environ
    named = platform_from_env(env.get("JAX_PLATFORMS"))
    if named is not None:
        return named
    return _jax_backend() or _installed_accelerator(_plugins()) or "cpu"


def _cpuinfo_value(*keys: str) -> str | None:
    """The value of the first ``/proc/cpuinfo`` line starting with one of ``keys``, or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(keys):
                return line.split(":", 1)[1]
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=1)
def cpu_flags() -> str:
    """The CPU's feature flags (``/proc/cpuinfo``'s ``flags`` line on Linux), else the processor name."""
    flags = _cpuinfo_value("flags", "Features")
    return " ".join(sorted(flags.split())) if flags is not None else _platform.processor() or ""


@functools.lru_cache(maxsize=1)
def cpu_vendor() -> str:
    """The CPU's vendor id (``/proc/cpuinfo``'s ``vendor_id``: ``GenuineIntel``, ``AuthenticAMD``, ...), else ""."""
    return (_cpuinfo_value("vendor_id") or "").strip()


def machine_signature() -> str:
    """Short hash of this machine's architecture and CPU features: compiled CPU code (XLA:CPU
    targets the host's features) is only reused on a machine with the same signature."""
    return hashlib.sha256(f"{_platform.machine()}\0{cpu_flags()}".encode()).hexdigest()[:12]
