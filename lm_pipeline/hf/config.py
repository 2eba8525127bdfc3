"""The ``export:`` section of a run config (Hugging Face exports), and size strings like '5GB'.

Light on purpose: parsing a config imports this module, so it must not import JAX.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from lm_pipeline.schema import ConfigError, field

__all__ = ["REPO_RE", "ExportConfig", "parse_size"]

#: A hub repo id: ``name`` or ``org/name``.
REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*(/[A-Za-z0-9][A-Za-z0-9_.\-]*)?$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([KMGT]?i?B?)\s*$", re.IGNORECASE)


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or '500MB', '5GB' (powers of 1000), '2GiB' (powers of 1024)."""
    if isinstance(size, bool):
        raise ValueError(f"invalid size {size!r}")
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        return size
    m = _SIZE_RE.match(str(size))
    if not m:
        raise ValueError(f"invalid size {size!r}: expected bytes or a number with a unit, e.g. '500MB', '5GB', '2GiB'")
    number, unit = float(m.group(1)), m.group(2).upper()
    prefix = unit[:1] if unit[:1] in "KMGT" else ""
    base = 1024 if "I" in unit else 1000
    value = int(number * base ** ("KMGT".index(prefix) + 1 if prefix else 0))
    if value <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return value


@dataclass(frozen=True)
class ExportConfig:
    """Hugging Face exports of the trained model (Levanter's hf_save_* keys; `hf_save_steps`, `hf_save_path`, `hf_upload` are also accepted at the top level, as Levanter writes them)."""

    hf_save_steps: int | None = field(None, help="Export a Hugging Face checkpoint every this many steps (and at the end of training); null = only on request (`lm-pipeline export`).", semantic=False)
    hf_save_path: str | None = field(None, help="Directory under which each run's exports are written, as <hf_save_path>/<run id>/step-<N>/ (runs sharing it keep apart); null = <run_dir>/hf/step-<N>/.", semantic=False)
    hf_upload: str | None = field(None, help="Hub repo id ('org/name') to upload each export to; null = no upload.", semantic=False)
    hf_upload_private: bool = field(True, help="Create the hub repo as private if it does not exist.", semantic=False)
    max_shard_size: str = field("5GB", help="Largest safetensors file; bigger models are sharded with a model.safetensors.index.json ('500MB', '5GB', '2GiB').")
    dtype: Literal["float32", "bfloat16", "float16"] | None = field(None, help="Dtype of the exported weights; null = the checkpoint's parameter dtype.")

    def validate(self) -> None:
        if self.hf_save_steps is not None and self.hf_save_steps < 1:
            raise ConfigError("hf_save_steps", f"must be >= 1 or null, got {self.hf_save_steps}")
        if self.hf_save_path is not None and not self.hf_save_path.strip():
            raise ConfigError("hf_save_path", "must not be empty (or null for <run_dir>/hf)")
        if self.hf_upload is not None and not REPO_RE.match(self.hf_upload):
            raise ConfigError("hf_upload", f"expected a hub repo id like 'org/name', got {self.hf_upload!r}")
        try:
            parse_size(self.max_shard_size)
        except ValueError as e:
            raise ConfigError("max_shard_size", str(e)) from None
