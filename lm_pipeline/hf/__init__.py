"""Hugging Face interop: export checkpoints as ``transformers`` models, import HF safetensors.

Export (:func:`export_hf`) writes a directory that ``AutoModelForCausalLM.from_pretrained``,
``AutoTokenizer.from_pretrained`` and ``pipeline("text-generation", model=out_dir)`` load with no
extra code; import (:func:`load_hf_checkpoint`) reads GPT-2 or Llama safetensors from a local
directory or the hub, never unpickling and never running remote code.

Modules: :mod:`~lm_pipeline.hf.config` (the ``export:`` section; light, no JAX),
:mod:`~lm_pipeline.hf.files` (file names, safetensors and tokenizer files of a model directory),
:mod:`~lm_pipeline.hf.export` (export, upload, the trainer hook) and
:mod:`~lm_pipeline.hf.load` (import). Every public name is importable from ``lm_pipeline.hf``;
the submodules load on first use, so importing the config stays light.

Nothing here imports ``transformers`` or ``torch``.
"""

from __future__ import annotations

from lm_pipeline.lazy import lazy_exports

# Public name -> its submodule. Loaded on first access (PEP 562) so that `lm_pipeline.config`,
# which imports `lm_pipeline.hf.config`, does not pull in JAX through this package.
_EXPORTS = {
    "ExportConfig": "config",
    "parse_size": "config",
    "UnsafeCheckpointError": "files",
    "read_safetensors_dir": "files",
    "export_hf": "export",
    "export_hook": "export",
    "export_state_dict": "export",
    "hf_save_dir": "export",
    "upload_hf": "export",
    "config_from_hf": "load",
    "load_hf_checkpoint": "load",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
