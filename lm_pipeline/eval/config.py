"""The ``eval:`` section of a run config, and the dtype names it accepts.

Light on purpose: parsing a config imports this module, so it must not import JAX.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lm_pipeline.schema import ConfigError, field

__all__ = ["EvalConfig", "dtype_name", "resolve_dtype"]

# Spelling -> the canonical name of a JAX floating dtype.
_DTYPE_NAMES = {
    "float32": "float32", "f32": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "f16": "float16", "fp16": "float16",
}


@dataclass(frozen=True)
class EvalConfig:
    """Offline evaluation of checkpoints (``lm-pipeline eval``)."""

    batch_size: int = field(
        8, help="Rows per eval batch (with max_eval_batches it decides how many rows are evaluated).", semantic=True
    )
    max_eval_batches: int | None = field(None, help="Evaluate at most this many batches per validation set (the first rows, in order); null = all rows.")
    compute_dtype: str | None = field(None, help="Dtype of the forward pass ('float32', 'bfloat16', ...); null = the run's compute dtype (trainer.mp).")
    unigram_baseline: bool = field(True, help="Report a unigram baseline (add-one smoothed token frequencies of the training cache) beside the model.")
    report_dir: str | None = field(None, help="Where eval_report.parquet/.json are written; null = <run_dir>/eval.", semantic=False)

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ConfigError("batch_size", f"must be >= 1, got {self.batch_size}")
        if self.max_eval_batches is not None and self.max_eval_batches < 1:
            raise ConfigError("max_eval_batches", f"must be >= 1 or null, got {self.max_eval_batches}")
        if self.compute_dtype is not None:
            try:
                dtype_name(self.compute_dtype)
            except ValueError as e:
                raise ConfigError("compute_dtype", str(e)) from None


def dtype_name(spec: str) -> str:
    """The canonical name ('float32', 'bfloat16', 'float16') of a dtype spelling ('bf16', 'f32', ...)."""
    if spec.lower() not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {spec!r}; use one of float32, bfloat16, float16")
    return _DTYPE_NAMES[spec.lower()]


def resolve_dtype(spec: Any) -> Any:
    """A JAX dtype from a name ('bf16', 'bfloat16', 'float32', 'f16', ...) or a dtype."""
    import jax.numpy as jnp  # here, not at the top: config parsing imports this module

    if isinstance(spec, str):
        return getattr(jnp, dtype_name(spec))
    return jnp.dtype(spec)
