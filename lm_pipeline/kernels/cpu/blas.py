"""Intel oneMKL's ``cblas_sgemm`` for the native float32 product (``native/cpu_gemm.cc``).

On an Intel Xeon (AVX-512 + AMX) oneMKL's sgemm ran the medium benchmark step's float32 products
1.14-1.16x faster than XLA:CPU's own kernels (0.84-1.37x per product), and it reads a transposed
operand at full speed (``docs/benchmarks.md``).
The library comes from PyPI's ``mkl`` package (a dependency on x86-64 Linux); it is loaded once,
privately (``RTLD_LOCAL``: no symbol of it is seen by other libraries, PyTorch's statically linked
MKL included), with its sequential threading layer: the native call splits the rows over XLA's
own thread pool, so there is no second pool beside it.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.metadata
import logging
import os
import sys
from pathlib import Path

_log = logging.getLogger(__name__)

_SEQUENTIAL = 1  # MKL_THREADING_SEQUENTIAL
_LP64 = 0  # MKL_INTERFACE_LP64: 32-bit integers, as the native call passes them


class BlasUnavailable(RuntimeError):
    """oneMKL is not installed, or does not load on this machine."""


def library_path() -> Path | None:
    """``libmkl_rt.so.*`` of the installed ``mkl`` package (its files, else ``sys.prefix/lib``), or None."""
    candidates: list[Path] = []
    try:
        for f in importlib.metadata.files("mkl") or ():
            if f.name.startswith("libmkl_rt.so"):
                candidates.append(Path(f.locate()))
    except importlib.metadata.PackageNotFoundError:
        pass
    candidates += [Path(p) for p in sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))]
    for path in candidates:
        if path.exists():
            return path.resolve()
    return None


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    path = library_path()
    if path is None:
        return None, "the mkl package is not installed"
    try:
        lib = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL | os.RTLD_NOW)
        lib.MKL_Set_Interface_Layer(ctypes.c_int(_LP64))
        layer = lib.MKL_Set_Threading_Layer(ctypes.c_int(_SEQUENTIAL))
        if layer != _SEQUENTIAL:
            return None, f"{path}: its threading layer is {layer}, not sequential"
        lib.cblas_sgemm  # noqa: B018  (raises AttributeError when missing)
    except (OSError, AttributeError) as err:
        return None, f"{path}: {err}"
    return lib, ""


def available() -> bool:
    """Whether oneMKL loads here."""
    lib, why = _load()
    if lib is None:
        _log.debug("oneMKL unavailable: %s", why)
    return lib is not None


def sgemm_address() -> int:
    """The address of oneMKL's ``cblas_sgemm``; raises :class:`BlasUnavailable`."""
    lib, why = _load()
    if lib is None:
        raise BlasUnavailable(why)
    return ctypes.cast(lib.cblas_sgemm, ctypes.c_void_p).value
