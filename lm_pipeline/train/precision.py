"""The mixed-precision policy (``trainer.mp``): its spellings, ``auto`` per platform, and the
:class:`Precision` (parameter, compute and output dtypes) a step computes with.

Light on purpose: parsing a config imports no JAX (dtype names until :func:`parse_mp`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lm_pipeline.schema import ConfigError

# Spelling -> JAX dtype name. Names, not dtypes, so that validating a config needs no JAX.
_DTYPES = {
    "f32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "f16": "float16",
    "float16": "float16",
}


@dataclass(frozen=True)
class Precision:
    """Mixed precision policy: parameter, compute and output dtypes; ``matmul``: the dtype the
    projections' and the LM head's operands are rounded to (products accumulate in float32 and
    return in the compute dtype), None for the compute dtype itself."""

    param: Any
    compute: Any
    output: Any
    matmul: Any = None

    @property
    def uses_loss_scaling(self) -> bool:
        import jax.numpy as jnp

        return self.compute == jnp.float16


#: ``trainer.mp: auto`` per platform (``docs/benchmarks.md``). GPUs and TPUs compute in bf16 with
#: f32 parameters (their matrix units run bf16 at several times the f32 rate). CPUs: see
#: :func:`auto_cpu_mp`.
AUTO_MP = "auto"
MP_FOR_PLATFORM = {"cpu": "f32", "gpu": "p=f32,c=bfloat16", "tpu": "p=f32,c=bfloat16"}
#: ``/proc/cpuinfo`` flags of bf16 dot-product instructions (AVX512-BF16; AMX's bf16 tiles).
BF16_DOT_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
#: ``auto`` on a CPU with one of :data:`BF16_DOT_FLAGS`: bf16 operands for the projections and the
#: LM head only (float32 accumulation and everything else float32, as ``torch.autocast`` on CPU).
CPU_BF16_MP = "p=f32,c=f32,m=bf16"


def auto_cpu_mp(flags: str | None = None) -> str:
    """``auto`` on a CPU with ``flags`` (default this machine's :func:`~lm_pipeline.hostinfo.cpu_flags`):
    :data:`CPU_BF16_MP` where the CPU has bf16 dot instructions (XLA:CPU then multiplies bf16
    operands at about twice its f32 rate, and that step measured faster than the f32 one at every
    benchmarked shape), else ``f32`` (without them XLA:CPU converts bf16 operands to f32, and the
    rounding would only cost time)."""
    from lm_pipeline.hostinfo import cpu_flags

    have = set((cpu_flags() if flags is None else flags).split())
    return CPU_BF16_MP if have & BF16_DOT_FLAGS else MP_FOR_PLATFORM["cpu"]


def resolve_mp(spec: str, platform: str | None = None) -> str:
    """``spec`` itself, or for ``'auto'`` the policy of ``platform`` (default: the platform this
    host trains on, :func:`lm_pipeline.hostinfo.detect_platform`): on CPU :func:`auto_cpu_mp`
    (``'p=f32,c=f32,m=bf16'`` with bf16 dot instructions, else ``'f32'``), ``'p=f32,c=bfloat16'``
    on GPU and TPU. Imports no JAX."""
    if spec.strip().lower() != AUTO_MP:
        return spec
    from lm_pipeline.hostinfo import detect_platform, platform_from_env

    name = detect_platform() if platform is None else platform_from_env(platform)  # 'cuda' -> 'gpu'
    if name not in MP_FOR_PLATFORM:
        raise ConfigError("", f"no automatic mixed precision for platform {platform!r}; set trainer.mp explicitly")
    return auto_cpu_mp() if name == "cpu" else MP_FOR_PLATFORM[name]


def parse_mp(spec: str) -> Precision:
    """Parse ``p=f32,c=bfloat16[,o=f32][,m=bf16]`` (jmp style, plus ``m``) or a single dtype name.

    A single name sets the compute dtype; parameters stay f32 and outputs follow compute.
    ``m`` (``matmul``) rounds the operands of the projections and the LM head to that dtype while
    everything else computes in ``c``: ``p=f32,c=f32,m=bf16`` is what ``torch.autocast`` does to a
    CPU model's linear layers (bf16 operands, float32 elsewhere), and on CPUs with bf16 dot
    instructions (AVX512-BF16, AMX) it is this trainer's fastest policy (``docs/benchmarks.md``).
    """
    import jax.numpy as jnp  # here, not at the top: validating a config must not import JAX

    names = _parse(spec)
    matmul = names.get("matmul")
    compute = names["compute"]
    return Precision(getattr(jnp, names["param"]), getattr(jnp, compute), getattr(jnp, names["output"]),
                     None if matmul in (None, compute) else getattr(jnp, matmul))


def parse_mp_names(spec: str) -> tuple[str, str, str]:
    """The (param, compute, output) dtype names of a :func:`parse_mp` policy, e.g.
    ``'p=f32,c=bf16'`` -> ``('float32', 'bfloat16', 'bfloat16')``; ConfigError if malformed."""
    names = _parse(spec)
    return names["param"], names["compute"], names["output"]


def _parse(spec: str) -> dict[str, str]:
    spec = spec.strip()
    if "=" not in spec:
        if spec not in _DTYPES:
            raise ConfigError("", f"unknown dtype {spec!r}; use one of f32, bf16, f16 or 'p=f32,c=bfloat16'")
        c = _DTYPES[spec]
        return {"param": "float32", "compute": c, "output": c}
    parts: dict[str, str] = {}
    names = {"p": "param", "params": "param", "c": "compute", "compute": "compute", "o": "output", "output": "output",
             "m": "matmul", "matmul": "matmul"}
    for item in spec.split(","):
        if "=" not in item:
            raise ConfigError("", f"bad mixed precision item {item!r}; expected key=dtype, e.g. p=f32,c=bfloat16")
        k, v = (s.strip() for s in item.split("=", 1))
        if k not in names:
            raise ConfigError("", f"unknown key {k!r} in mixed precision policy; use p, c, o, m")
        if v not in _DTYPES:
            raise ConfigError("", f"unknown dtype {v!r}; use one of {', '.join(sorted(_DTYPES))}")
        parts[names[k]] = _DTYPES[v]
    param = parts.get("param", "float32")
    compute = parts.get("compute", param)
    out = {"param": param, "compute": compute, "output": parts.get("output", compute)}
    if "matmul" in parts:
        if parts["matmul"] == "float16" and compute != "float16":
            raise ConfigError("", "m=f16 needs c=f16 (float16 operands need loss scaling); use m=bf16")
        out["matmul"] = parts["matmul"]
    return out
