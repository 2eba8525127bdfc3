"""Conversion between our models and Hugging Face ``GPT2LMHeadModel`` / ``LlamaForCausalLM``.

State dicts are plain ``{hf_name: np.ndarray}`` (no torch needed here). The layouts are listed
in the docstrings of :mod:`lm_pipeline.models.gpt2` and :mod:`lm_pipeline.models.llama`.
Tied LM heads are written under both names (``lm_head.weight`` too), as ``state_dict()`` does;
a safetensors writer should drop the duplicate. Biases absent from our model (``use_bias:
false``) are written as zeros for GPT-2 (whose HF model always has them) and ignored on import.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import numpy as np

from lm_pipeline.models.base import LmModel
from lm_pipeline.models.config import Gpt2Config, LlamaConfig, LmConfig
from lm_pipeline.models.params import named_params, replace_params


def hf_config(cfg: LmConfig, vocab_size: int) -> dict[str, Any]:
    """The HF ``config.json`` fields (with ``model_type`` and ``architectures``) for ``cfg``."""
    if isinstance(cfg, Gpt2Config):
        return {
            "model_type": "gpt2",
            "architectures": ["GPT2LMHeadModel"],
            "vocab_size": vocab_size,
            "n_positions": cfg.seq_len,
            "n_embd": cfg.hidden_dim,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_heads,
            "n_inner": cfg.mlp_dim,
            "activation_function": cfg.activation_function,
            "resid_pdrop": cfg.resid_pdrop,
            "embd_pdrop": cfg.embed_pdrop,
            "attn_pdrop": cfg.attn_pdrop,
            "layer_norm_epsilon": cfg.layer_norm_epsilon,
            "initializer_range": cfg.initializer_range,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": cfg.scale_attn_by_inverse_layer_idx,
            "reorder_and_upcast_attn": cfg.upcast_attn,
            "tie_word_embeddings": True,
        }
    if isinstance(cfg, LlamaConfig):
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab_size,
            "hidden_size": cfg.hidden_dim,
            "intermediate_size": cfg.intermediate_dim,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_size,
            "hidden_act": cfg.activation_function,
            "max_position_embeddings": cfg.seq_len,
            "initializer_range": cfg.initializer_range,
            "rms_norm_eps": cfg.layer_norm_epsilon,
            "rope_theta": cfg.rope_theta,
            **({"rope_scaling": cfg.rope_parameters()} if cfg.rope_scaling is not None else {}),
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "attention_bias": cfg.use_bias,
            "mlp_bias": cfg.use_bias,
        }
    raise TypeError(f"no Hugging Face mapping for {type(cfg).__name__}")


def to_hf_state_dict(model: LmModel, cfg: LmConfig) -> dict[str, np.ndarray]:
    """Our model's weights under HF names and layouts (numpy, in the model's dtype)."""
    named = {k: np.asarray(v) for k, v in named_params(model).items()}
    if isinstance(cfg, Gpt2Config):
        return _gpt2_to_hf(cfg, named)
    if isinstance(cfg, LlamaConfig):
        return _llama_to_hf(cfg, named)
    raise TypeError(f"no Hugging Face mapping for {type(cfg).__name__}")


class _Reading(dict):
    """A state dict that remembers the last tensor read (to name it when a reshape fails)."""

    last: str | None = None

    def __getitem__(self, key):
        self.last = key
        return super().__getitem__(key)


def from_hf_state_dict(cfg: LmConfig, state: dict[str, Any], vocab_size: int) -> LmModel:
    """A model for ``cfg`` holding the HF weights in ``state`` (values: numpy or array-likes;
    CPU torch tensors work). Parameters are float32, as from ``cfg.build``."""
    state = _Reading((k, np.asarray(v, dtype=np.float32)) for k, v in state.items())
    try:
        if isinstance(cfg, Gpt2Config):
            named = _gpt2_from_hf(cfg, state)
        elif isinstance(cfg, LlamaConfig):
            named = _llama_from_hf(cfg, state)
        else:
            raise TypeError(f"no Hugging Face mapping for {type(cfg).__name__}")
    except ValueError as e:  # a reshape that does not fit: name the tensor
        if state.last is None:
            raise
        shape = tuple(dict.__getitem__(state, state.last).shape)
        raise ValueError(f"tensor {state.last!r} of shape {shape} does not fit the model config: {e}") from None
    skeleton = eqx.filter_eval_shape(cfg.build, vocab_size, key=jax.random.PRNGKey(0))
    wanted = named_params(skeleton)
    return replace_params(skeleton, {k: v for k, v in named.items() if k in wanted})


# ----------------------------------------------------------------------------- GPT-2


def _gpt2_to_hf(cfg: Gpt2Config, named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    d = cfg.hidden_dim
    te = named["token_embeddings"]
    dtype = te.dtype
    out = {"transformer.wte.weight": te, "lm_head.weight": te, "transformer.wpe.weight": named["position_embeddings"]}

    def bias(name: str, i: int | None, size: int) -> np.ndarray:
        if name not in named:
            return np.zeros((size,), dtype)
        value = named[name] if i is None else named[name][i]
        return value.reshape(size)

    for i in range(cfg.num_layers):
        p = f"transformer.h.{i}."
        a = "blocks.attn."
        out[p + "ln_1.weight"] = named["blocks.ln_1.weight"][i]
        out[p + "ln_1.bias"] = bias("blocks.ln_1.bias", i, d)
        out[p + "attn.c_attn.weight"] = np.concatenate([named[a + w][i].reshape(d, d) for w in ("q_proj", "k_proj", "v_proj")], axis=1)
        out[p + "attn.c_attn.bias"] = np.concatenate([bias(a + b, i, d) for b in ("q_bias", "k_bias", "v_bias")])
        out[p + "attn.c_proj.weight"] = named[a + "o_proj"][i].reshape(d, d)
        out[p + "attn.c_proj.bias"] = bias(a + "o_bias", i, d)
        out[p + "ln_2.weight"] = named["blocks.ln_2.weight"][i]
        out[p + "ln_2.bias"] = bias("blocks.ln_2.bias", i, d)
        out[p + "mlp.c_fc.weight"] = named["blocks.mlp.up_proj"][i]
        out[p + "mlp.c_fc.bias"] = bias("blocks.mlp.up_bias", i, cfg.mlp_dim)
        out[p + "mlp.c_proj.weight"] = named["blocks.mlp.down_proj"][i]
        out[p + "mlp.c_proj.bias"] = bias("blocks.mlp.down_bias", i, d)
    out["transformer.ln_f.weight"] = named["ln_f.weight"]
    out["transformer.ln_f.bias"] = bias("ln_f.bias", None, d)
    return out


def _gpt2_from_hf(cfg: Gpt2Config, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    d, n, h = cfg.hidden_dim, cfg.num_heads, cfg.head_dim
    if "transformer.wte.weight" not in state and "wte.weight" in state:  # saved from GPT2Model (hub "gpt2")
        state = {f"transformer.{k}": v for k, v in state.items()}

    def stack(fmt: str, fn=lambda x: x) -> np.ndarray:
        return np.stack([fn(state[fmt.format(i=i)]) for i in range(cfg.num_layers)])

    layer = "transformer.h.{i}."
    named = {
        "token_embeddings": state["transformer.wte.weight"],
        "position_embeddings": state["transformer.wpe.weight"],
        "ln_f.weight": state["transformer.ln_f.weight"],
        "ln_f.bias": state["transformer.ln_f.bias"],
        "blocks.attn.o_proj": stack(layer + "attn.c_proj.weight", lambda w: w.reshape(n, h, d)),
        "blocks.attn.o_bias": stack(layer + "attn.c_proj.bias"),
        "blocks.mlp.up_proj": stack(layer + "mlp.c_fc.weight"),
        "blocks.mlp.up_bias": stack(layer + "mlp.c_fc.bias"),
        "blocks.mlp.down_proj": stack(layer + "mlp.c_proj.weight"),
        "blocks.mlp.down_bias": stack(layer + "mlp.c_proj.bias"),
    }
    for ln in ("ln_1", "ln_2"):
        for kind in ("weight", "bias"):
            named[f"blocks.{ln}.{kind}"] = stack(layer + f"{ln}.{kind}")
    for j, name in enumerate("qkv"):
        cols = slice(j * d, (j + 1) * d)
        named[f"blocks.attn.{name}_proj"] = stack(layer + "attn.c_attn.weight", lambda w, c=cols: w[:, c].reshape(d, n, h))
        named[f"blocks.attn.{name}_bias"] = stack(layer + "attn.c_attn.bias", lambda b, c=cols: b[c].reshape(n, h))
    return named


# ----------------------------------------------------------------------------- Llama


_LLAMA_ATTN = ("q", "k", "v")
_LLAMA_MLP = ("gate", "up", "down")


def _llama_to_hf(cfg: LlamaConfig, named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    d = cfg.hidden_dim
    te = named["token_embeddings"]
    out = {
        "model.embed_tokens.weight": te,
        "model.norm.weight": named["norm.weight"],
        "lm_head.weight": te if cfg.tie_word_embeddings else named["lm_head"],
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = "blocks.self_attn."
        out[p + "input_layernorm.weight"] = named["blocks.input_layernorm.weight"][i]
        out[p + "post_attention_layernorm.weight"] = named["blocks.post_attention_layernorm.weight"][i]
        for x in _LLAMA_ATTN:
            out[p + f"self_attn.{x}_proj.weight"] = named[a + f"{x}_proj"][i].reshape(d, -1).T
        out[p + "self_attn.o_proj.weight"] = named[a + "o_proj"][i].reshape(-1, d).T
        for x in _LLAMA_MLP:
            out[p + f"mlp.{x}_proj.weight"] = named[f"blocks.mlp.{x}_proj"][i].T
        if cfg.use_bias:
            for x in (*_LLAMA_ATTN, "o"):
                out[p + f"self_attn.{x}_proj.bias"] = named[a + f"{x}_bias"][i].reshape(-1)
            for x in _LLAMA_MLP:
                out[p + f"mlp.{x}_proj.bias"] = named[f"blocks.mlp.{x}_bias"][i]
    return out


def _llama_from_hf(cfg: LlamaConfig, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    d, h = cfg.hidden_dim, cfg.head_size
    heads = {"q": cfg.num_heads, "k": cfg.num_kv_heads, "v": cfg.num_kv_heads}

    def stack(fmt: str, fn=lambda x: x) -> np.ndarray:
        return np.stack([fn(state[fmt.format(i=i)]) for i in range(cfg.num_layers)])

    layer = "model.layers.{i}."
    named = {
        "token_embeddings": state["model.embed_tokens.weight"],
        "norm.weight": state["model.norm.weight"],
        "blocks.input_layernorm.weight": stack(layer + "input_layernorm.weight"),
        "blocks.post_attention_layernorm.weight": stack(layer + "post_attention_layernorm.weight"),
        "blocks.self_attn.o_proj": stack(layer + "self_attn.o_proj.weight", lambda w: w.T.reshape(cfg.num_heads, h, d)),
    }
    if not cfg.tie_word_embeddings:
        named["lm_head"] = state["lm_head.weight"]
    for x, n in heads.items():
        named[f"blocks.self_attn.{x}_proj"] = stack(layer + f"self_attn.{x}_proj.weight", lambda w, n=n: w.T.reshape(d, n, h))
    for x in _LLAMA_MLP:
        named[f"blocks.mlp.{x}_proj"] = stack(layer + f"mlp.{x}_proj.weight", lambda w: w.T)
    if cfg.use_bias:
        for x, n in heads.items():
            named[f"blocks.self_attn.{x}_bias"] = stack(layer + f"self_attn.{x}_proj.bias", lambda b, n=n: b.reshape(n, h))
        named["blocks.self_attn.o_bias"] = stack(layer + "self_attn.o_proj.bias")
        for x in _LLAMA_MLP:
            named[f"blocks.mlp.{x}_bias"] = stack(layer + f"mlp.{x}_proj.bias")
    return named
