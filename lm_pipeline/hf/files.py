"""What a Hugging Face model directory holds: file names, safetensors weights (read, and
written in shards), tokenizer files, and the tensor name of the input embedding.

Pickle-based weights (``.bin``, ``.pt``, ...) are refused, never unpickled.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from lm_pipeline.hf.config import parse_size
from lm_pipeline.models.config import Gpt2Config, LmConfig

__all__ = [
    "CONFIG_NAME", "GENERATION_CONFIG_NAME", "HUB_PATTERNS", "PICKLE_SUFFIXES", "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME", "TOKENIZER_FILES", "UnsafeCheckpointError", "copy_tokenizer", "embedding_names",
    "pickle_message", "read_safetensors_dir", "write_json", "write_safetensors",
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
HUB_PATTERNS = [CONFIG_NAME, GENERATION_CONFIG_NAME, "*.safetensors", SAFE_WEIGHTS_INDEX_NAME, *TOKENIZER_FILES]


class UnsafeCheckpointError(ValueError):
    """The checkpoint would need unpickling or remote code: refused."""



def embedding_names(cfg: LmConfig) -> tuple[str, ...]:
    """HF names of the input embedding and the LM head of ``cfg``'s family."""
    if isinstance(cfg, Gpt2Config):
        return ("transformer.wte.weight", "lm_head.weight")
    return ("model.embed_tokens.weight", "lm_head.weight")



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


def write_safetensors(state: Mapping[str, np.ndarray], out_dir: str, max_shard_size: int | str) -> list[str]:
    """Write ``state`` into ``out_dir`` as one ``model.safetensors`` or, past ``max_shard_size``
    (bytes or '5GB'), as shards plus an index; the names of the files written."""
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
    write_json(os.path.join(out_dir, SAFE_WEIGHTS_INDEX_NAME), index)
    return [*files, SAFE_WEIGHTS_INDEX_NAME]


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` to ``path`` as indented JSON with a final newline (keys in insertion order)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def copy_tokenizer(tokenizer_dir: str, out_dir: str) -> list[str]:
    """Copy the tokenizer files of ``tokenizer_dir`` into ``out_dir`` (never pickles or model
    configs); the names copied. A directory without ``tokenizer.json`` raises FileNotFoundError."""
    from lm_pipeline import fs

    copied = []
    for name, is_dir in sorted(fs.listdir(tokenizer_dir)):  # a local dir or a URL
        if not is_dir and not name.startswith("."):
            if name.endswith(PICKLE_SUFFIXES) or name in (CONFIG_NAME, GENERATION_CONFIG_NAME, "manifest.json"):
                continue
            with open(os.path.join(out_dir, name), "wb") as f:  # small files: read whole, wherever they are
                f.write(fs.read_bytes(fs.join(tokenizer_dir, name), missing_ok=False))
            copied.append(name)
    if "tokenizer.json" not in copied:
        raise FileNotFoundError(f"{tokenizer_dir} holds no tokenizer.json")
    return copied


def pickle_message(where: str, pickles: list[str]) -> str:
    """Why pickle-based weights at ``where`` are refused, and how to convert them."""
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
        raise UnsafeCheckpointError(pickle_message(local, pickles))
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
