"""Model families. Importing this package registers every member of :class:`LmConfig`.

The configs (:mod:`~lm_pipeline.models.config`) are light and load with the package; the
Equinox modules (:class:`LmModel`, :class:`Gpt2Model`, :class:`LlamaModel`, :class:`KVCache`)
load on first use, so parsing a run config imports no JAX.
"""

from __future__ import annotations

from lm_pipeline.lazy import lazy_exports
from lm_pipeline.models.config import Gpt2Config, LlamaConfig, LmConfig

# Heavy public name -> its submodule, loaded on first access (PEP 562).
_LAZY = {
    "LmModel": "base",
    "Gpt2Model": "gpt2",
    "LlamaModel": "llama",
    "KVCache": "layers",
}

__all__ = ["KVCache", "LmConfig", "LmModel", "Gpt2Config", "Gpt2Model", "LlamaConfig", "LlamaModel"]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
