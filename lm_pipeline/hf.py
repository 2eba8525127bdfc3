"""Hugging Face interop: export checkpoints as ``transformers`` models, import HF safetensors.

Export (:func:`export_hf`) writes a directory that ``transformers`` loads with no extra code::

    <out_dir>/
      config.json                     GPT2LMHeadModel / LlamaForCausalLM config (token ids from the tokenizer)
      generation_config.json
      model.safetensors               or model-0000i-of-0000n.safetensors + model.safetensors.index.json
      tokenizer.json, tokenizer_config.json, special_tokens_map.json   (copied from the checkpoint)

so ``AutoModelForCausalLM.from_pretrained(out_dir)``, ``AutoTokenizer.from_pretrained(out_dir)``
and ``pipeline("text-generation", model=out_dir)`` work. Weights are written with the
``safetensors`` library (metadata ``format: pt``), tied LM heads once (as ``save_pretrained``
does), and a vocabulary padded beyond the tokenizer's is sliced back to the tokenizer's size.
The directory is built under a temporary name beside the target and renamed into place, so a
reader never sees a half-written export. Writing the same weights twice gives byte-identical files.

Import (:func:`load_hf_checkpoint`) reads a local directory or a hub repo (``org/name[@revision]``)
holding a GPT-2 or Llama model in safetensors only: pickle-based weights (``.bin``, ``.pt``, ...)
are refused, never unpickled, and models that need ``trust_remote_code`` are refused. The model
config is derived from ``config.json`` (:func:`config_from_hf`, the ``use_hf_model_config``
semantics) or given explicitly. Export -> import -> export reproduces the weights byte for byte.

Nothing here imports ``transformers`` or ``torch``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from tqdm.auto import tqdm

from lm_pipeline import atomic
from lm_pipeline.faultpoints import faultpoint
from lm_pipeline.models.base import LmConfig, LmModel
from lm_pipeline.models.gpt2 import Gpt2Config
from lm_pipeline.models.hf_mapping import from_hf_state_dict, hf_config, to_hf_state_dict
from lm_pipeline.models.llama import LlamaConfig
from lm_pipeline.schema import ConfigError, field, from_dict

log = logging.getLogger(__name__)

__all__ = [
    "ExportConfig",
    "UnsafeCheckpointError",
    "config_from_hf",
    "export_hf",
    "export_hook",
    "export_state_dict",
    "load_hf_checkpoint",
    "parse_size",
    "read_safetensors_dir",
    "upload_hf",
]

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".msgpack", ".h5")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json",
)
_HUB_PATTERNS = [CONFIG_NAME, GENERATION_CONFIG_NAME, "*.safetensors", SAFE_WEIGHTS_INDEX_NAME, *TOKENIZER_FILES]
_EXPORT_DTYPES = ("float32", "bfloat16", "float16")
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*(/[A-Za-z0-9][A-Za-z0-9_.\-]*)?$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([KMGT]?i?B?)\s*$", re.IGNORECASE)


class UnsafeCheckpointError(ValueError):
    """The checkpoint would need unpickling or remote code: refused."""


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


# --------------------------------------------------------------------------------------------
# Configuration (for the lead to hook into RunConfig as `export:`)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportConfig:
    """Hugging Face exports of the trained model (Levanter's hf_save_* keys)."""

    hf_save_steps: int | None = field(None, help="Export a Hugging Face checkpoint every this many steps (and at the end of training); null = only on request (`lm-pipeline export`).", semantic=False)
    hf_save_path: str | None = field(None, help="Directory under which exports are written as step-<N>/; null = <run_dir>/hf.", semantic=False)
    hf_upload: str | None = field(None, help="Hub repo id ('org/name') to upload each export to; null = no upload.", semantic=False)
    hf_upload_private: bool = field(True, help="Create the hub repo as private if it does not exist.", semantic=False)
    max_shard_size: str = field("5GB", help="Largest safetensors file; bigger models are sharded with a model.safetensors.index.json ('500MB', '5GB', '2GiB').")
    dtype: Literal["float32", "bfloat16", "float16"] | None = field(None, help="Dtype of the exported weights; null = the checkpoint's parameter dtype.")

    def validate(self) -> None:
        if self.hf_save_steps is not None and self.hf_save_steps < 1:
            raise ConfigError("hf_save_steps", f"must be >= 1 or null, got {self.hf_save_steps}")
        if self.hf_save_path is not None and not self.hf_save_path.strip():
            raise ConfigError("hf_save_path", "must not be empty (or null for <run_dir>/hf)")
        if self.hf_upload is not None and not _REPO_RE.match(self.hf_upload):
            raise ConfigError("hf_upload", f"expected a hub repo id like 'org/name', got {self.hf_upload!r}")
        try:
            parse_size(self.max_shard_size)
        except ValueError as e:
            raise ConfigError("max_shard_size", str(e)) from None


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


def _np_dtype(name: str | None) -> np.dtype | None:
    if name is None:
        return None
    if name not in _EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_EXPORT_DTYPES)} or None, got {name!r}")
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _dtype_name(dt: np.dtype) -> str:
    return "bfloat16" if dt.name == "bfloat16" else dt.name


def _embedding_names(cfg: LmConfig) -> tuple[str, ...]:
    if isinstance(cfg, Gpt2Config):
        return ("transformer.wte.weight", "lm_head.weight")
    return ("model.embed_tokens.weight", "lm_head.weight")


def _tied(cfg: LmConfig) -> bool:
    return isinstance(cfg, Gpt2Config) or bool(getattr(cfg, "tie_word_embeddings", False))


def export_state_dict(
    model: LmModel, cfg: LmConfig, *, vocab_size: int | None = None, dtype: str | None = None
) -> dict[str, np.ndarray]:
    """HF-named weights as written by :func:`export_hf`: the tied LM head once (under the input
    embedding's name), the vocabulary sliced to ``vocab_size`` (the tokenizer's, when the model's
    was padded), cast to ``dtype`` (None: the model's), C-contiguous numpy arrays."""
    state = to_hf_state_dict(model, cfg)
    model_vocab = int(state[_embedding_names(cfg)[0]].shape[0])
    vocab = model_vocab if vocab_size is None else int(vocab_size)
    if vocab > model_vocab:
        raise ValueError(f"the tokenizer has {vocab} tokens but the model only {model_vocab}: cannot export")
    if _tied(cfg):
        state.pop("lm_head.weight", None)
    target = _np_dtype(dtype)
    out = {}
    for name, value in state.items():
        arr = np.asarray(value)
        if name in _embedding_names(cfg) and vocab < model_vocab:
            arr = arr[:vocab]
        if target is not None and arr.dtype != target:
            arr = arr.astype(target)
        out[name] = np.ascontiguousarray(arr)
    return out


def _shards(state: Mapping[str, np.ndarray], max_bytes: int) -> list[list[str]]:
    """Greedy, in order: a new shard starts when the next tensor would overflow ``max_bytes``."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, arr in state.items():
        if shards[-1] and size + arr.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += arr.nbytes
    return shards


def _write_safetensors(state: Mapping[str, np.ndarray], out_dir: str, max_shard_size: int | str) -> list[str]:
    from safetensors.numpy import save_file

    groups = _shards(state, parse_size(max_shard_size))
    if len(groups) == 1:
        save_file(dict(state), os.path.join(out_dir, SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
        return [SAFE_WEIGHTS_NAME]
    files, weight_map = [], {}
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: state[n] for n in names}, os.path.join(out_dir, fname), metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({n: fname for n in names})
    index = {
        "metadata": {"total_size": int(sum(a.nbytes for a in state.values()))},
        "weight_map": dict(sorted(weight_map.items())),
    }
    _write_json(os.path.join(out_dir, SAFE_WEIGHTS_INDEX_NAME), index)
    return [*files, SAFE_WEIGHTS_INDEX_NAME]


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def _token_ids(tokenizer_dir: str | None) -> dict[str, int | None]:
    if tokenizer_dir is None:
        return {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    from lm_pipeline.data.tokenizer import tokenizer_info

    info = tokenizer_info(tokenizer_dir)
    return {"bos_token_id": info.bos_id, "eos_token_id": info.eos_id, "pad_token_id": info.pad_id}


def _export_config_json(cfg: LmConfig, vocab: int, dtype: str, ids: Mapping[str, int | None]) -> dict[str, Any]:
    conf = hf_config(cfg, vocab)
    if isinstance(cfg, LlamaConfig):  # transformers >= 5 reads rope_parameters, 4.x rope_theta
        conf["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    conf.update(ids)  # explicit nulls too: HF's defaults (GPT-2: 50256) would be wrong here
    conf["dtype"] = dtype
    conf["use_cache"] = True
    return conf


def _copy_tokenizer(tokenizer_dir: str, out_dir: str) -> list[str]:
    copied = []
    for name in sorted(os.listdir(tokenizer_dir)):
        src = os.path.join(tokenizer_dir, name)
        if os.path.isfile(src) and not name.startswith("."):
            if name.endswith(PICKLE_SUFFIXES) or name in (CONFIG_NAME, GENERATION_CONFIG_NAME):
                continue
            shutil.copyfile(src, os.path.join(out_dir, name))
            copied.append(name)
    if "tokenizer.json" not in copied:
        raise FileNotFoundError(f"{tokenizer_dir} holds no tokenizer.json")
    return copied


def _replace_dir(tmp: str, out: str, overwrite: bool) -> None:
    if os.path.lexists(out):
        if not overwrite:
            raise FileExistsError(f"{out} exists (pass overwrite=True to replace it)")
        old = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.old-{uuid.uuid4().hex[:8]}")
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def export_hf(
    source: LmModel | str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    config: LmConfig | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = True,
    progress: bool | None = None,
) -> str:
    """Write a Hugging Face ``transformers`` model directory (see the module docstring).

    Args:
        source: a checkpoint dir (``step-<N>`` or a run dir: its latest checkpoint; model,
            config and ``tokenizer/`` come from it) or a model (then ``config`` defaults to
            ``model.config``).
        out_dir: the export directory (local); replaced atomically if it exists and ``overwrite``.
        tokenizer_dir: tokenizer files to copy (default: the checkpoint's); without one the
            export holds only the model and no token ids.
        vocab_size: vocabulary to export (default: the tokenizer's, else the model's); a model
            vocabulary padded beyond it is sliced off.
        dtype: 'float32', 'bfloat16' or 'float16'; None keeps the parameters' dtype.
        max_shard_size: the largest safetensors file before sharding ('5GB', '500MB', bytes).
        progress: a tqdm bar of the bytes written; None = only when stderr is a terminal.

    Returns the export directory.
    """
    if isinstance(source, LmModel):
        model = source
        cfg = config if config is not None else getattr(model, "config", None)
        if cfg is None:
            raise ValueError("pass config= for a model without a .config")
    else:
        from lm_pipeline.eval import load_model_from_checkpoint

        loaded = load_model_from_checkpoint(source)
        model, cfg = loaded.model, config if config is not None else loaded.config.model
        if tokenizer_dir is None:
            tokenizer_dir = loaded.tokenizer_dir
    tok = None if tokenizer_dir is None else os.fspath(tokenizer_dir)
    if vocab_size is None and tok is not None:
        from lm_pipeline.data.tokenizer import tokenizer_info

        vocab_size = tokenizer_info(tok).vocab_size
    state = export_state_dict(model, cfg, vocab_size=vocab_size, dtype=dtype)
    vocab = int(state[_embedding_names(cfg)[0]].shape[0])
    first = next(iter(state.values()))
    ids = _token_ids(tok)

    out = os.path.abspath(os.fspath(out_dir))
    if "://" in os.fspath(out_dir):
        raise ValueError(f"export_hf writes local directories; got {out_dir!r} (export locally, then upload)")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    atomic.remove_stale_temps(out)  # left by an export that was killed (exports of one directory run one at a time)
    tmp = atomic.temp_sibling(out)
    os.makedirs(tmp)
    nbytes = sum(int(a.nbytes) for a in state.values())
    bar = tqdm(total=nbytes, desc="export", unit="B", unit_scale=True, disable=None if progress is None else not progress)
    t0 = time.perf_counter()
    try:
        bar.set_postfix_str("weights", refresh=False)
        _write_safetensors(state, tmp, max_shard_size)
        bar.update(nbytes)
        faultpoint("export.after_weights")
        bar.set_postfix_str("config and tokenizer", refresh=False)
        _write_json(os.path.join(tmp, CONFIG_NAME), _export_config_json(cfg, vocab, _dtype_name(first.dtype), ids))
        gen = {"_from_model_config": True, **{k: v for k, v in ids.items() if v is not None}}
        _write_json(os.path.join(tmp, GENERATION_CONFIG_NAME), gen)
        if tok is not None:
            _copy_tokenizer(tok, tmp)
        _replace_dir(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    log.info("exported %s model (vocab %d, %s, %.1f MB) to %s in %.1fs", getattr(cfg, "type", "?"), vocab,
             _dtype_name(first.dtype), nbytes / 1e6, out, time.perf_counter() - t0)
    return out


def upload_hf(
    export_dir: str | os.PathLike,
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool | None = True,
    commit_message: str | None = None,
    token: str | None = None,
) -> str:
    """Upload an export directory to the hub repo ``repo_id`` (created if missing); returns the
    commit URL. Needs network access and a token (``HF_TOKEN`` or ``huggingface-cli login``)."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    if revision is not None:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    info = api.upload_folder(
        repo_id=repo_id, folder_path=os.fspath(export_dir), revision=revision,
        commit_message=commit_message or f"Upload {os.path.basename(os.fspath(export_dir))}",
    )
    return str(getattr(info, "commit_url", info))


def export_hook(
    export_cfg: ExportConfig,
    *,
    run_dir: str,
    tokenizer_dir: str | os.PathLike | None = None,
) -> Any:
    """A trainer :class:`~lm_pipeline.train.trainer.Hook` exporting every ``hf_save_steps`` to
    ``<hf_save_path or run_dir/hf>/step-<N>`` (and uploading with ``hf_upload``), or None when
    ``hf_save_steps`` is null. The final export at the end of training is the caller's."""
    if export_cfg.hf_save_steps is None:
        return None
    import jax

    from lm_pipeline.train.trainer import Hook

    base = export_cfg.hf_save_path or os.path.join(run_dir, "hf")

    def fn(info: Any) -> dict[str, float] | None:
        model = info.state.model
        if jax.process_count() > 1:  # every process takes part in the gather; process 0 writes
            from jax.experimental import multihost_utils

            model = multihost_utils.process_allgather(model, tiled=True)
            if jax.process_index() != 0:
                return None
        out = export_hf(model, os.path.join(base, f"step-{info.step}"), tokenizer_dir=tokenizer_dir,
                        dtype=export_cfg.dtype, max_shard_size=export_cfg.max_shard_size)
        if export_cfg.hf_upload:
            upload_hf(out, export_cfg.hf_upload, private=export_cfg.hf_upload_private,
                      commit_message=f"step {info.step}")
        return None

    return Hook(fn, every=export_cfg.hf_save_steps)


# --------------------------------------------------------------------------------------------
# Import
# --------------------------------------------------------------------------------------------


_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu_fast": "gelu_new",
                "gelu": "gelu", "relu": "relu", "silu": "silu", "swish": "silu"}


def _activation(hf: Mapping[str, Any], key: str, default: str) -> str:
    act = hf.get(key, default)
    if act not in _ACTIVATIONS:
        raise ConfigError(key, f"activation {act!r} is not supported; supported: {', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[act]


def _rope_theta(hf: Mapping[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for where, p in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in (None, "default"):
            raise ConfigError(where, f"rope type {kind!r} is not supported (only the default rotary embedding)")
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    return float(theta)


def config_from_hf(hf: Mapping[str, Any]) -> LmConfig:
    """Our model config for a Hugging Face ``config.json`` (GPT-2 or Llama); raises
    :class:`ConfigError` for settings our models do not implement."""
    kind = hf.get("model_type")
    if kind == "gpt2":
        d = int(hf["n_embd"])
        inner = hf.get("n_inner") or 4 * d
        if inner % d:
            raise ConfigError("n_inner", f"must be a multiple of n_embd ({d}), got {inner}")
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
            "mlp_scale": int(inner // d),
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


def _resolve_source(source: str | os.PathLike, revision: str | None, cache_dir: str | None, token: str | None) -> str:
    """A local directory holding the checkpoint (downloaded from the hub if needed)."""
    text = os.fspath(source)
    if os.path.isdir(text):
        return text
    repo, rev = _split_revision(text, revision)
    if os.path.isdir(repo):
        return repo
    if not _REPO_RE.match(repo):
        raise FileNotFoundError(f"{text!r} is neither a local directory nor a hub repo id ('org/name[@revision]')")
    from huggingface_hub import snapshot_download

    local = snapshot_download(repo, revision=rev, allow_patterns=_HUB_PATTERNS, cache_dir=cache_dir, token=token)
    if not any(n.endswith(".safetensors") for n in os.listdir(local)):
        from huggingface_hub import HfApi

        files = HfApi(token=token).list_repo_files(repo, revision=rev)
        pickles = [f for f in files if f.endswith(PICKLE_SUFFIXES)]
        if pickles:
            raise UnsafeCheckpointError(_pickle_message(f"hub repo {repo}", pickles))
        raise FileNotFoundError(f"hub repo {repo} has no safetensors weights (files: {files[:10]})")
    return local


def _pickle_message(where: str, pickles: list[str]) -> str:
    return (
        f"{where} holds only pickle-based weights ({', '.join(sorted(pickles)[:5])}); refusing to unpickle "
        "them (loading a pickle can run arbitrary code). Convert the model to safetensors first, e.g. in a "
        "sandbox: AutoModelForCausalLM.from_pretrained(src).save_pretrained(dst, safe_serialization=True)"
    )


def _weight_files(local: str) -> list[str]:
    names = os.listdir(local)
    if SAFE_WEIGHTS_INDEX_NAME in names:
        with open(os.path.join(local, SAFE_WEIGHTS_INDEX_NAME), encoding="utf-8") as f:
            index = json.load(f)
        files = sorted(set(index["weight_map"].values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(local, f))]
        if missing:
            raise FileNotFoundError(f"{local}: {SAFE_WEIGHTS_INDEX_NAME} names missing files {missing[:5]}")
        return files
    if SAFE_WEIGHTS_NAME in names:
        return [SAFE_WEIGHTS_NAME]
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise UnsafeCheckpointError(_pickle_message(local, pickles))
    raise FileNotFoundError(f"{local} has no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}")


def read_safetensors_dir(local: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a HF model directory's safetensors weights (single file or sharded), as
    numpy arrays (bfloat16 via ``ml_dtypes``). Pickle-based weights raise :class:`UnsafeCheckpointError`."""
    from safetensors import safe_open

    local = os.fspath(local)
    state: dict[str, np.ndarray] = {}
    for fname in _weight_files(local):
        with safe_open(os.path.join(local, fname), framework="np") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open handles have no __iter__)
                state[key] = f.get_tensor(key)
    return state


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
    cfg_path = os.path.join(local, CONFIG_NAME)
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{local} has no {CONFIG_NAME}")
    with open(cfg_path, encoding="utf-8") as f:
        hf = json.load(f)
    if hf.get("auto_map"):
        raise UnsafeCheckpointError(
            f"{local}: config.json has an auto_map (custom modelling code, trust_remote_code); refusing to run it"
        )
    hf_cfg = config_from_hf(hf)
    if use_hf_model_config or config is None:
        cfg = hf_cfg
    else:
        if type(config) is not type(hf_cfg):
            raise ConfigError("model.type", f"is {config.type!r} but {local} holds a {hf_cfg.type!r} model")
        cfg = config
    state = read_safetensors_dir(local)
    emb = _embedding_names(cfg)[0]
    if emb not in state and isinstance(cfg, Gpt2Config) and "wte.weight" in state:
        emb = "wte.weight"
    if emb not in state:
        raise ValueError(f"{local}: no {emb!r} tensor; is this a {cfg.type} causal LM checkpoint?")
    vocab = int(state[emb].shape[0])
    model = from_hf_state_dict(cfg, state, vocab)
    if dtype is not None:
        from lm_pipeline.eval import resolve_dtype
        from lm_pipeline.train.trainer import cast_floating

        model = cast_floating(model, resolve_dtype(dtype))
    return cfg, model

