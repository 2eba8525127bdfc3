"""Model families. Importing this package registers every member of :class:`LmConfig`."""

from lm_pipeline.models.base import LmConfig, LmModel
from lm_pipeline.models.gpt2 import Gpt2Config, Gpt2Model
from lm_pipeline.models.layers import KVCache
from lm_pipeline.models.llama import LlamaConfig, LlamaModel

__all__ = ["KVCache", "LmConfig", "LmModel", "Gpt2Config", "Gpt2Model", "LlamaConfig", "LlamaModel"]
