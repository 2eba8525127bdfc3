"""Causal self-attention on the CPU as a native XLA FFI kernel, built at first use.

XLA:CPU runs attention's many small batched products (per batch x head) far below the
machine's matmul rate. ``native/cpu_attention.cc`` computes the whole causal attention of one
(batch, head) pair per task on XLA's own intra-op thread pool: query blocks of 64 rows,
register-blocked ``6 x 16`` products, the softmax (forward) and ``P * (dP - delta)`` (backward)
fused between them, reading q/k/v in the model's ``[B, T, heads, H]`` layout. Each product
computes only the blocks the causal mask leaves and reads ``P^T`` / ``dS^T`` in place.
Measurements are in ``docs/benchmarks.md``.

The same library holds a 2-D transpose (``native/cpu_transpose.cc``, :func:`transpose_target`)
that :func:`lm_pipeline.kernels.cpu.matmul.xt_g` puts in front of a weight gradient's product,
where XLA:CPU cannot fold it into the dot (see there).

The sources are compiled with the system C++ compiler (``$CXX``, else ``c++``, ``g++`` or
``clang++``) for an explicit instruction-set level, never ``-march=native``: on x86-64 the
levels of the psABI, ``x86-64-v4`` (AVX-512 F/BW/CD/DQ/VL), ``x86-64-v3`` (AVX2, FMA, BMI),
``x86-64-v2`` (SSE4.2) and ``x86-64``; elsewhere the compiler's default target. The best level
the CPU's flags allow is chosen at run time (:func:`runnable_isas`; ``$LM_PIPELINE_NATIVE_ISA``
names another one the CPU can run). Each level's library is built once into
``~/.cache/lm_pipeline/native`` (or ``$LM_PIPELINE_NATIVE_DIR``), keyed by a hash of the sources,
the compiler, the JAX version and the level (so machines of one level share a build), written
atomically. A compiler that cannot target a level falls back to the next one down. Without a
compiler, or when every build fails, a warning is logged once and the compute plan keeps the
blocked attention (same values; slower). Each level registers its own FFI targets
(``lm_pipeline_causal_attention_{fwd,bwd}_<level>``, ``lm_pipeline_transpose_<level>``), so one process can run several (the
tests compare every level the CPU can run with a float64 reference).

Chosen by :class:`lm_pipeline.compute.ComputePlan` (attention ``cpu_native``) for plain causal
self-attention (no packing mask, no dropout) in float32 on a mesh of one CPU device; the
forward's output and log-sum-exp carry the
:data:`~lm_pipeline.kernels.cpu.blocked_attention.ATTENTION_RESIDUALS` names so that the
layer remat policy keeps them.
"""

from __future__ import annotations

import ctypes
import functools
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

from lm_pipeline.hostinfo import cpu_flags
from lm_pipeline.kernels.cpu.blocked_attention import ATTENTION_RESIDUALS

_log = logging.getLogger(__name__)

F32 = jnp.float32
SOURCES = tuple(Path(__file__).parent / "native" / name for name in ("cpu_attention.cc", "cpu_transpose.cc", "cpu_gemm.cc"))
HEADERS = (Path(__file__).parent / "native" / "cpu_parallel.h",)  # included by the sources: part of the build's key
DIR_ENV = "LM_PIPELINE_NATIVE_DIR"
ISA_ENV = "LM_PIPELINE_NATIVE_ISA"
_FWD, _BWD = "lm_pipeline_causal_attention_fwd", "lm_pipeline_causal_attention_bwd"
_TRANSPOSE = "lm_pipeline_transpose"
_GEMM = "lm_pipeline_gemm_f32"
GENERIC = "generic"  # not x86-64: the compiler's default target for this architecture

# x86-64 psABI micro-architecture levels, best first, with the /proc/cpuinfo flags each needs on
# top of the level below it (GCC >= 11 and clang >= 12 take them as -march values).
X86_LEVELS: dict[str, frozenset[str]] = {
    "x86-64-v4": frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    "x86-64-v3": frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}),
    "x86-64-v2": frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}),
    "x86-64": frozenset(),
}

_lock = threading.Lock()
_state: dict[str, dict[str, object]] = {}  # per level: "ok": bool, "error": str, "path": Path


class NativeAttentionUnavailable(RuntimeError):
    """The native CPU attention kernel could not be built or loaded (the message says why)."""


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


def _is_x86_64(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in ("x86_64", "amd64")


def runnable_isas(flags: str | None = None, machine: str | None = None) -> list[str]:
    """The instruction-set levels this CPU can run, best first (``flags``: a ``/proc/cpuinfo``
    flags line or its words; default this machine's). ``['generic']`` off x86-64."""
    if not _is_x86_64(machine):
        return [GENERIC]
    have = set((cpu_flags() if flags is None else flags).split())
    levels = list(X86_LEVELS)
    runnable = []
    for i, level in enumerate(levels):
        if all(X86_LEVELS[lower] <= have for lower in levels[i:]):
            runnable.append(level)
    return runnable


def default_isa() -> str:
    """The level this process builds and runs: ``$LM_PIPELINE_NATIVE_ISA`` when set (it must be
    one this CPU can run), else the best one :func:`runnable_isas` gives."""
    runnable = runnable_isas()
    named = os.environ.get(ISA_ENV, "").strip()
    if not named:
        return runnable[0]
    if named not in runnable:
        raise NativeAttentionUnavailable(
            f"{ISA_ENV}={named!r}: this CPU runs {', '.join(runnable)}; unset it or name one of those"
        )
    return named


def cache_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or Path.home() / ".cache" / "lm_pipeline" / "native")


def _compile_flags(isa: str) -> list[str]:
    if isa == GENERIC:
        return ["-O3"]
    # -mtune=generic: the same code for every CPU of the level (no tuning for the build host).
    return ["-O3", f"-march={isa}", "-mtune=generic"]


def _build(cxx: str, isa: str) -> Path:
    src = b"\0".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    flags = _compile_flags(isa)
    key = hashlib.sha256(
        b"\0".join([src, version.encode(), jax.__version__.encode(), " ".join(flags).encode(),
                    platform.machine().encode()])
    ).hexdigest()[:16]
    out = cache_dir() / f"cpu_attention-{isa}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *flags, "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise NativeAttentionUnavailable(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: a reader never loads a half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def build(isa: str | None = None) -> Path:
    """The kernel's shared library for ``isa`` (default :func:`default_isa`), compiled unless the
    cache has it; raises :class:`NativeAttentionUnavailable` (no compiler, or the compiler's error
    output)."""
    cxx = _compiler()
    if cxx is None:
        raise NativeAttentionUnavailable("no C++ compiler found ($CXX, c++, g++, clang++)")
    return _build(cxx, isa or default_isa())


def target_names(isa: str) -> tuple[str, str]:
    """The FFI target names (forward, backward) the library of ``isa`` is registered under."""
    tag = isa.replace("-", "_")
    return f"{_FWD}_{tag}", f"{_BWD}_{tag}"


def transpose_target(isa: str) -> str:
    """The FFI target name of the library's 2-D transpose (``native/cpu_transpose.cc``) for ``isa``."""
    return f"{_TRANSPOSE}_{isa.replace('-', '_')}"


def gemm_target(isa: str) -> str:
    """The FFI target name of the library's float32 product (``native/cpu_gemm.cc``) for ``isa``;
    it computes with the sgemm handed to :func:`library` ``(isa).LmpSetSgemm``
    (:func:`lm_pipeline.kernels.cpu.matmul.gemm` does that)."""
    return f"{_GEMM}_{isa.replace('-', '_')}"


def library(isa: str) -> ctypes.CDLL:
    """The loaded library of ``isa`` (after :func:`load`)."""
    return _registered[isa][1]


_registered: dict[str, tuple[Path, ctypes.CDLL]] = {}  # XLA keeps a target's first registration


def _register(isa: str) -> Path:
    path = build(isa)
    if isa not in _registered:
        lib = ctypes.cdll.LoadLibrary(str(path))
        fwd, bwd = target_names(isa)
        jax.ffi.register_ffi_target(fwd, jax.ffi.pycapsule(lib.LmpCausalAttentionFwd), platform="cpu")
        jax.ffi.register_ffi_target(bwd, jax.ffi.pycapsule(lib.LmpCausalAttentionBwd), platform="cpu")
        jax.ffi.register_ffi_target(transpose_target(isa), jax.ffi.pycapsule(lib.LmpTranspose), platform="cpu")
        jax.ffi.register_ffi_target(gemm_target(isa), jax.ffi.pycapsule(lib.LmpGemmF32), platform="cpu")
        _registered[isa] = (path, lib)
    _state[isa] = {"ok": True, "path": _registered[isa][0]}
    return path


_ERRORS = (NativeAttentionUnavailable, OSError, subprocess.SubprocessError, AttributeError)


def _load_level(isa: str) -> None:
    if isa not in _state:
        try:
            _register(isa)
        except _ERRORS as err:
            _state[isa] = {"ok": False, "error": str(err)}
    if not _state[isa]["ok"]:
        raise NativeAttentionUnavailable(f"{isa}: {_state[isa]['error']}")


def _load_default() -> str:
    """:func:`default_isa`, or the next level down when the compiler cannot target it (unless
    ``$LM_PIPELINE_NATIVE_ISA`` named it); warns once when it falls back or fails."""
    first = default_isa()
    runnable = runnable_isas()
    named = bool(os.environ.get(ISA_ENV, "").strip())
    errors = []
    if _compiler() is None:
        raise NativeAttentionUnavailable("no C++ compiler found ($CXX, c++, g++, clang++)")
    for level in [first] if named else runnable[runnable.index(first):]:
        try:
            _load_level(level)
        except NativeAttentionUnavailable as err:
            errors.append(str(err))
            continue
        if errors:
            _log.warning("native CPU attention built for %s (the CPU runs %s, which failed: %s)",
                         level, first, "; ".join(errors))
        return level
    raise NativeAttentionUnavailable("; ".join(errors))


def load(isa: str | None = None) -> str:
    """Build (once per level and machine) and register the kernel with XLA (once per process);
    returns the level loaded: ``isa``, or by default :func:`default_isa` (falling back to lower
    levels when the compiler cannot target it). Raises :class:`NativeAttentionUnavailable`."""
    with _lock:
        if isa is not None:
            _load_level(isa)
            return isa
        if "default" not in _state:
            try:
                _state["default"] = {"ok": True, "isa": _load_default()}
            except NativeAttentionUnavailable as err:
                _state["default"] = {"ok": False, "error": str(err)}
                _log.warning("native CPU attention unavailable, using the blocked attention (slower): %s", err)
        if not _state["default"]["ok"]:
            raise NativeAttentionUnavailable(str(_state["default"]["error"]))
        return str(_state["default"]["isa"])


def available(isa: str | None = None) -> bool:
    """Whether the kernel is built and registered (builds it on the first call)."""
    try:
        load(isa)
        return True
    except NativeAttentionUnavailable:
        return False


def _scale_arg(scale) -> jax.Array:
    return jax.lax.stop_gradient(jnp.asarray(scale, F32)).reshape(1)


@functools.cache
def _attention_of(isa: str):
    """The causal attention with a custom VJP that calls the FFI targets of ``isa``."""
    fwd_name, bwd_name = target_names(isa)

    def fwd_call(q, k, v, scale):
        b, t, n, _ = q.shape
        out_types = (jax.ShapeDtypeStruct(q.shape, F32), jax.ShapeDtypeStruct((b, n, t), F32))
        return jax.ffi.ffi_call(fwd_name, out_types, vmap_method="sequential")(q, k, v, _scale_arg(scale))

    def bwd_call(q, k, v, scale, out, lse, g):
        out_types = tuple(jax.ShapeDtypeStruct(x.shape, F32) for x in (q, k, v))
        return jax.ffi.ffi_call(bwd_name, out_types, vmap_method="sequential")(q, k, v, _scale_arg(scale), out, lse, g)

    @jax.custom_vjp
    def attend(q, k, v, scale):
        return fwd_call(q, k, v, scale)[0]

    def attend_fwd(q, k, v, scale):
        out, lse = fwd_call(q, k, v, scale)
        out = checkpoint_name(out, ATTENTION_RESIDUALS[0])
        lse = checkpoint_name(lse, ATTENTION_RESIDUALS[1])
        return out, (q, k, v, scale, out, lse)

    def attend_bwd(res, g):
        q, k, v, scale, out, lse = res
        dq, dk, dv = bwd_call(q, k, v, scale, out, lse, g.astype(F32))
        return dq, dk, dv, jnp.zeros_like(scale)

    attend.defvjp(attend_fwd, attend_bwd)
    attend.fwd = attend_fwd  # for tests: the forward rule with its residual names
    return attend


def native_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float | jax.Array,
                            isa: str | None = None) -> jax.Array:
    """Causal self-attention, q ``[B, T, N, H]``, k/v ``[B, T, K, H]`` (K divides N), float32.

    Same values as ``jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale)`` up
    to float rounding, and as close to a float64 reference (``tests/test_native_attention.py``);
    ``scale`` may be traced (no gradient). ``isa``: the instruction-set level whose build runs
    (default :func:`default_isa`). Raises :class:`NativeAttentionUnavailable` where the kernel
    cannot be built.
    """
    if q.dtype != F32 or k.dtype != F32 or v.dtype != F32:
        raise TypeError(f"native attention is float32 only, got {q.dtype}/{k.dtype}/{v.dtype}")
    if q.ndim != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or q.shape[2] % k.shape[2]:
        raise ValueError(f"native attention: q {q.shape}, k {k.shape}, v {v.shape} are not causal self-attention shapes")
    level = load(isa)
    return _attention_of(level)(q, k, v, jnp.asarray(scale, F32))
