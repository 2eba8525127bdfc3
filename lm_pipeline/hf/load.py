"""Hugging Face import: a GPT-2 or Llama checkpoint in safetensors as one of our models.

:func:`load_hf_checkpoint` reads a local directory or a hub repo (``org/name[@revision]``) holding
a GPT-2 or Llama model in safetensors only: pickle-based weights (``.bin``, ``.pt``, ...) are
refused, never unpickled, and models that need ``trust_remote_code`` are refused. The model
config is derived from ``config.json`` (:func:`config_from_hf`, the ``use_hf_model_config``
semantics) or given explicitly. Export -> import -> export reproduces the weights byte for byte.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from lm_pipeline import fs
from lm_pipeline.eval.config import resolve_dtype
from lm_pipeline.hf.config import REPO_RE
from lm_pipeline.hf.files import (
    CONFIG_NAME,
    HUB_PATTERNS,
    PICKLE_SUFFIXES,
    UnsafeCheckpointError,
    embedding_names,
    pickle_message,
    read_safetensors_dir,
)
from lm_pipeline.models.base import LmModel
from lm_pipeline.models.config import Gpt2Config, LlamaConfig, LmConfig
from lm_pipeline.models.hf_mapping import from_hf_state_dict
from lm_pipeline.schema import ConfigError, from_dict

__all__ = ["HfWeightsError", "config_from_hf", "load_hf_checkpoint"]


_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu_fast": "gelu_new",
                "gelu": "gelu", "relu": "relu", "silu": "silu", "swish": "silu"}


def _activation(hf: Mapping[str, Any], key: str, default: str) -> str:
    act = hf.get(key, default)
    if act not in _ACTIVATIONS:
        raise ConfigError(key, f"activation {act!r} is not supported; supported: {', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[act]


#: transformers' rope_parameters keys of the scaled rotary embeddings our Llama implements.
_ROPE_SCALING_KEYS = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
                      "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")


def _rope_scaling(hf: Mapping[str, Any]) -> dict[str, Any] | None:
    """``model.rope_scaling`` for a config.json's ``rope_parameters`` (or the older ``rope_scaling``):
    None for the default rope; linear, llama3 and yarn carried; any other type refused."""
    where = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = hf.get(where) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind not in ("linear", "llama3", "yarn") or params.get("truncate", True) is not True:
        raise ConfigError(where, f"rope type {kind!r} is not supported (default, linear, llama3, yarn)")
    out = {"type": kind, **{k: params[k] for k in _ROPE_SCALING_KEYS if params.get(k) is not None}}
    if kind != "linear":  # transformers falls back to max_position_embeddings
        out.setdefault("original_max_position_embeddings", int(hf.get("max_position_embeddings", 2048)))
    return out


def _rope_theta(hf: Mapping[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    top, nested = hf.get("rope_theta"), params.get("rope_theta")
    if top is not None and nested is not None and float(top) != float(nested):
        raise ConfigError("rope_theta", f"config.json sets rope_theta {top} and rope_parameters.rope_theta {nested}; "
                          "transformers uses rope_parameters.rope_theta -- make the two agree (or drop the "
                          "top-level one)")
    theta = nested if nested is not None else top if top is not None else 10000.0
    return float(theta)


def config_from_hf(hf: Mapping[str, Any]) -> LmConfig:
    """Our model config for a Hugging Face ``config.json`` (GPT-2 or Llama); raises
    :class:`ConfigError` for settings our models do not implement."""
    kind = hf.get("model_type")
    if kind == "gpt2":
        d = int(hf["n_embd"])
        inner = int(hf.get("n_inner") or 4 * d)
        if not hf.get("scale_attn_weights", True):
            raise ConfigError("scale_attn_weights", "false is not supported")
        if hf.get("add_cross_attention"):
            raise ConfigError("add_cross_attention", "cross attention is not supported")
        if not hf.get("tie_word_embeddings", True):
            raise ConfigError("tie_word_embeddings", "our GPT-2 always ties the LM head to the token embeddings")
        data = {
            "type": "gpt2",
            "seq_len": int(hf.get("n_positions", hf.get("n_ctx", 1024))),
            "hidden_dim": d,
            "num_layers": int(hf["n_layer"]),
            "num_heads": int(hf["n_head"]),
            "mlp_scale": inner // d if inner % d == 0 else inner / d,  # any n_inner: a fractional scale
            "initializer_range": float(hf.get("initializer_range", 0.02)),
            "embed_pdrop": float(hf.get("embd_pdrop", 0.1)),
            "resid_pdrop": float(hf.get("resid_pdrop", 0.1)),
            "attn_pdrop": float(hf.get("attn_pdrop", 0.1)),
            "layer_norm_epsilon": float(hf.get("layer_norm_epsilon", 1e-5)),
            "activation_function": _activation(hf, "activation_function", "gelu_new"),
            "scale_attn_by_inverse_layer_idx": bool(hf.get("scale_attn_by_inverse_layer_idx", False)),
            "upcast_attn": bool(hf.get("reorder_and_upcast_attn", False)),
            "use_bias": True,
        }
        return from_dict(Gpt2Config, data)
    if kind == "llama":
        d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim")
        if head_dim is not None and int(head_dim) == d // heads and d % heads == 0:
            head_dim = None
        attn_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
        if attn_bias != mlp_bias:
            raise ConfigError("mlp_bias", f"attention_bias ({attn_bias}) and mlp_bias ({mlp_bias}) must agree (one use_bias)")
        data = {
            "type": "llama",
            "seq_len": int(hf.get("max_position_embeddings", 2048)),
            "hidden_dim": d,
            "intermediate_dim": int(hf["intermediate_size"]),
            "num_layers": int(hf["num_hidden_layers"]),
            "num_heads": heads,
            "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
            "head_dim": None if head_dim is None else int(head_dim),
            "activation_function": _activation(hf, "hidden_act", "silu"),
            "initializer_range": float(hf.get("initializer_range", 0.02)),
            "layer_norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
            "rope_theta": _rope_theta(hf),
            "rope_scaling": _rope_scaling(hf),
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "use_bias": attn_bias,
        }
        return from_dict(LlamaConfig, data)
    raise ConfigError("model_type", f"{kind!r} is not supported; supported: 'gpt2', 'llama'")


def _split_revision(source: str, revision: str | None) -> tuple[str, str | None]:
    if "@" in source and revision is None:
        repo, rev = source.rsplit("@", 1)
        return repo, rev or None
    return source, revision


def _download_export(url: str, cache_dir: str | None) -> str:
    """A local copy of the HF model directory ``url`` (object store), downloaded into
    ``cache_dir`` (default: a temporary directory). Only complete exports are read: one without
    ``config.json`` (uploaded last, see :func:`lm_pipeline.hf.export.export_hf`) is refused. Downloaded
    once per content: a rewritten export (other sizes or versions) gets a new copy."""
    import tempfile

    url = fs.norm(url)
    if not fs.exists(fs.join(url, CONFIG_NAME)):
        raise FileNotFoundError(f"{url} holds no {CONFIG_NAME}: not a (complete) Hugging Face model directory")
    return fs.local_copy(url, cache_dir=os.path.join(cache_dir or tempfile.gettempdir(), "lm-pipeline-hf"))


def _resolve_source(source: str | os.PathLike, revision: str | None, cache_dir: str | None, token: str | None) -> str:
    """A local directory holding the checkpoint (downloaded from the hub if needed)."""
    text = os.fspath(source)
    if fs.is_local_dir(text):
        return fs.local_path(text)
    if fs.scheme(text):  # a URL that is no local directory: an export on an object store, read from a local copy
        return _download_export(text, cache_dir)
    repo, rev = _split_revision(text, revision)
    if os.path.isdir(repo):
        return repo
    if not REPO_RE.match(repo):
        raise FileNotFoundError(f"{text!r} is neither a local directory nor a hub repo id ('org/name[@revision]')")
    from huggingface_hub import snapshot_download

    local = snapshot_download(repo, revision=rev, allow_patterns=HUB_PATTERNS, cache_dir=cache_dir, token=token)
    if not any(n.endswith(".safetensors") for n in os.listdir(local)):
        from huggingface_hub import HfApi

        files = HfApi(token=token).list_repo_files(repo, revision=rev)
        pickles = [f for f in files if f.endswith(PICKLE_SUFFIXES)]
        if pickles:
            raise UnsafeCheckpointError(pickle_message(f"hub repo {repo}", pickles))
        raise FileNotFoundError(f"hub repo {repo} has no safetensors weights (files: {files[:10]})")
    return local


class HfWeightsError(ValueError):
    """A Hugging Face checkpoint whose weights do not fit its config (a tensor missing or of
    another shape); the message names the tensor."""


def load_hf_checkpoint(
    source: str | os.PathLike,
    *,
    config: LmConfig | None = None,
    use_hf_model_config: bool = True,
    revision: str | None = None,
    dtype: Any = None,
    cache_dir: str | None = None,
    token: str | None = None,
) -> tuple[LmConfig, LmModel]:
    """(model config, model) of a Hugging Face GPT-2 / Llama checkpoint in safetensors.

    Args:
        source: a local directory, or a hub repo id with an optional ``@revision``
            (``org/name@main``, ``org/name@<commit sha>``); downloads fetch only configs,
            tokenizer files and ``*.safetensors``.
        config / use_hf_model_config: with ``use_hf_model_config`` (or no ``config``) the model
            config comes from ``config.json`` (:func:`config_from_hf`); otherwise ``config`` is
            used and the weights must fit it (e.g. to keep our seq_len or dropout settings).
        dtype: cast the parameters (default float32).

    Never unpickles and never runs remote code: ``.bin``/``.pt`` weights and configs with an
    ``auto_map`` raise :class:`UnsafeCheckpointError`.
    """
    local = _resolve_source(source, revision, cache_dir, token)
    hf_cfg = config_from_hf(_read_config_json(local))
    if use_hf_model_config or config is None:
        cfg = hf_cfg
    else:
        if type(config) is not type(hf_cfg):
            raise ConfigError("model.type", f"is {config.type!r} but {local} holds a {hf_cfg.type!r} model")
        cfg = config
    model = _model_from_weights(local, cfg)
    if dtype is not None:
        from lm_pipeline.train.trainer import cast_floating

        model = cast_floating(model, resolve_dtype(dtype))
    return cfg, model


def _read_config_json(local: str) -> dict[str, Any]:
    """The ``config.json`` of the local model directory ``local``; one that names custom modelling
    code (``auto_map``) is refused."""
    cfg_path = os.path.join(local, CONFIG_NAME)
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{local} has no {CONFIG_NAME}")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            hf = json.load(f)
    except json.JSONDecodeError as e:
        raise HfWeightsError(f"'{cfg_path}' is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); fix it, "
                             "or download the model again") from None
    if not isinstance(hf, dict):
        raise HfWeightsError(f"'{cfg_path}' holds a JSON {type(hf).__name__}, not an object: not a model config")
    if hf.get("auto_map"):
        raise UnsafeCheckpointError(
            f"{local}: config.json has an auto_map (custom modelling code, trust_remote_code); refusing to run it"
        )
    return hf


def _model_from_weights(local: str, cfg: LmConfig) -> LmModel:
    """The model of config ``cfg`` with the safetensors weights of ``local``; weights that do not
    fit the config raise :class:`HfWeightsError` naming the tensor."""
    state = read_safetensors_dir(local)
    emb = embedding_names(cfg)[0]
    if emb not in state and isinstance(cfg, Gpt2Config) and "wte.weight" in state:
        emb = "wte.weight"
    if emb not in state:
        raise ValueError(f"{local}: no {emb!r} tensor; is this a {cfg.type} causal LM checkpoint?")
    vocab = int(state[emb].shape[0])
    try:
        model = from_hf_state_dict(cfg, state, vocab)
    except KeyError as e:
        raise HfWeightsError(f"{local}: the weights have no tensor {e.args[0]!r}, which the {cfg.type} of the config "
                             f"({cfg.num_layers} layers) needs; the weights and the config do not match") from None
    except ValueError as e:
        raise HfWeightsError(f"{local}: {str(e).splitlines()[0]} ({cfg.type}, hidden {cfg.hidden_dim}, "
                             f"{cfg.num_heads} heads, {cfg.num_layers} layers); the weights and the config do not "
                             "match") from None
    return model

