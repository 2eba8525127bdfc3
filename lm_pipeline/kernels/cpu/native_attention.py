"""Causal self-attention on the CPU as a native XLA FFI kernel, built at first use.

XLA:CPU runs attention's many small batched products (per batch x head) far below the
machine's matmul rate. ``native/cpu_attention.cc`` computes the whole causal attention of one
(batch, head) pair per task on XLA's own intra-op thread pool: query blocks of 64 rows,
register-blocked ``6 x 16`` products, the softmax (forward) and ``P * (dP - delta)`` (backward)
fused between them, reading q/k/v in the model's ``[B, T, heads, H]`` layout. Measurements are
in ``docs/benchmarks.md``.

The source is compiled once per machine with the system C++ compiler (``$CXX``, else ``c++``
or ``g++``; ``-O3 -march=native``) into ``~/.cache/lm_pipeline/native`` (or
``$LM_PIPELINE_NATIVE_DIR``), keyed by a hash of the source, the compiler, the JAX version
and the CPU's flags, written atomically. Without a compiler, or when the build fails, a
warning is logged once and the compute plan keeps the blocked attention (same values; slower).

Chosen by :class:`lm_pipeline.compute.ComputePlan` (attention ``cpu_native``) for plain causal
self-attention (no packing mask, no dropout) in float32 on a mesh of one CPU device; the
forward's output and log-sum-exp carry the
:data:`~lm_pipeline.kernels.cpu.blocked_attention.ATTENTION_RESIDUALS` names so that the
layer remat policy keeps them.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lm_pipeline.kernels.cpu.blocked_attention import ATTENTION_RESIDUALS

_log = logging.getLogger(__name__)

F32 = jnp.float32
SOURCE = Path(__file__).parent / "native" / "cpu_attention.cc"
DIR_ENV = "LM_PIPELINE_NATIVE_DIR"
_FWD, _BWD = "lm_pipeline_causal_attention_fwd", "lm_pipeline_causal_attention_bwd"

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "error": str, "path": Path


class NativeAttentionUnavailable(RuntimeError):
    """The native CPU attention kernel could not be built or loaded (the message says why)."""


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or Path.home() / ".cache" / "lm_pipeline" / "native")


def _build(cxx: str) -> Path:
    src = SOURCE.read_bytes()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(
        b"\0".join([src, version.encode(), jax.__version__.encode(), _cpu_flags().encode(), platform.machine().encode()])
    ).hexdigest()[:16]
    out = cache_dir() / f"cpu_attention-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    cmd = [cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w",
           f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise NativeAttentionUnavailable(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: a reader never loads a half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def build() -> Path:
    """The kernel's shared library, compiled unless this machine's cache has it; raises
    :class:`NativeAttentionUnavailable` (no compiler, or the compiler's error output)."""
    cxx = _compiler()
    if cxx is None:
        raise NativeAttentionUnavailable("no C++ compiler found ($CXX, c++, g++, clang++)")
    return _build(cxx)


def load() -> Path:
    """Build (once per machine) and register the kernel with XLA (once per process); raises
    :class:`NativeAttentionUnavailable`."""
    with _lock:
        if "ok" not in _state:
            try:
                path = build()
                lib = ctypes.cdll.LoadLibrary(str(path))
                jax.ffi.register_ffi_target(_FWD, jax.ffi.pycapsule(lib.LmpCausalAttentionFwd), platform="cpu")
                jax.ffi.register_ffi_target(_BWD, jax.ffi.pycapsule(lib.LmpCausalAttentionBwd), platform="cpu")
                _state.update(ok=True, path=path, lib=lib)
            except (NativeAttentionUnavailable, OSError, subprocess.SubprocessError, AttributeError) as err:
                _state.update(ok=False, error=str(err))
                _log.warning("native CPU attention unavailable, using the blocked attention (slower): %s", err)
        if not _state["ok"]:
            raise NativeAttentionUnavailable(str(_state["error"]))
        return _state["path"]  # type: ignore[return-value]


def available() -> bool:
    """Whether the kernel is built and registered (builds it on the first call)."""
    try:
        load()
        return True
    except NativeAttentionUnavailable:
        return False


def _scale_arg(scale) -> jax.Array:
    return jax.lax.stop_gradient(jnp.asarray(scale, F32)).reshape(1)


def _fwd_call(q, k, v, scale):
    b, t, n, _ = q.shape
    out_types = (jax.ShapeDtypeStruct(q.shape, F32), jax.ShapeDtypeStruct((b, n, t), F32))
    return jax.ffi.ffi_call(_FWD, out_types, vmap_method="sequential")(q, k, v, _scale_arg(scale))


def _bwd_call(q, k, v, scale, out, lse, g):
    out_types = tuple(jax.ShapeDtypeStruct(x.shape, F32) for x in (q, k, v))
    return jax.ffi.ffi_call(_BWD, out_types, vmap_method="sequential")(q, k, v, _scale_arg(scale), out, lse, g)


@jax.custom_vjp
def _attend(q, k, v, scale):
    return _fwd_call(q, k, v, scale)[0]


def _attend_fwd(q, k, v, scale):
    out, lse = _fwd_call(q, k, v, scale)
    out = checkpoint_name(out, ATTENTION_RESIDUALS[0])
    lse = checkpoint_name(lse, ATTENTION_RESIDUALS[1])
    return out, (q, k, v, scale, out, lse)


def _attend_bwd(res, g):
    q, k, v, scale, out, lse = res
    dq, dk, dv = _bwd_call(q, k, v, scale, out, lse, g.astype(F32))
    return dq, dk, dv, jnp.zeros_like(scale)


_attend.defvjp(_attend_fwd, _attend_bwd)


def native_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float | jax.Array) -> jax.Array:
    """Causal self-attention, q ``[B, T, N, H]``, k/v ``[B, T, K, H]`` (K divides N), float32.

    Same values as ``jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale)`` up
    to float rounding (``tests/test_native_attention.py``); ``scale`` may be traced (no
    gradient). Raises :class:`NativeAttentionUnavailable` where the kernel cannot be built.
    """
    if q.dtype != F32 or k.dtype != F32 or v.dtype != F32:
        raise TypeError(f"native attention is float32 only, got {q.dtype}/{k.dtype}/{v.dtype}")
    if q.ndim != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or q.shape[2] % k.shape[2]:
        raise ValueError(f"native attention: q {q.shape}, k {k.shape}, v {v.shape} are not causal self-attention shapes")
    load()
    return _attend(q, k, v, jnp.asarray(scale, F32))
