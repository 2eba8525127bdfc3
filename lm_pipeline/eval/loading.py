"""Loading a model from a training checkpoint, for evaluation, export and generation.

:func:`load_model_from_checkpoint` reads a checkpoint dir written by the trainer
(``<run_dir>/step-<N>/`` with ``config.yaml``, ``tokenizer/`` and the Orbax state, see
:mod:`lm_pipeline.train.checkpoint`) and restores only the ``model`` subtree of the train state,
on one device. The model's vocabulary size is read from the saved embedding's shape.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np

from lm_pipeline import fs
from lm_pipeline.config import RunConfig, load_config
from lm_pipeline.eval.config import resolve_dtype
from lm_pipeline.models.base import LmModel

__all__ = ["LoadedCheckpoint", "checkpoint_step", "load_model_from_checkpoint", "resolve_checkpoint"]

CONFIG_FILE = "config.yaml"
TOKENIZER_DIR = "tokenizer"
MODEL_SUBTREE = "model"


class LoadedCheckpoint(NamedTuple):
    """What :func:`load_model_from_checkpoint` returns (unpacks as a 4-tuple)."""

    config: RunConfig
    model: LmModel
    tokenizer_dir: str | None  # <step_dir>/tokenizer, or None if the checkpoint has none
    vocab_size: int  # rows of the model's embedding (may exceed the tokenizer's: padding)


def resolve_checkpoint(path: str | os.PathLike) -> str:
    """The complete checkpoint dir at ``path`` (a ``step-<N>`` dir) or the latest one under it;
    a local Hugging Face model directory (``config.json`` + safetensors) is its own checkpoint."""
    from lm_pipeline.hf.start import is_hf_model_dir
    from lm_pipeline.train.checkpoint import latest_checkpoint

    if is_hf_model_dir(path):
        return os.fspath(path)
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(
            f"no complete checkpoint at or under {os.fspath(path)} (a step-<N> dir with checkpoint.json)"
        )
    return found


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step recorded in a checkpoint's completion marker (0 for a Hugging Face directory)."""
    from lm_pipeline.hf.start import is_hf_model_dir
    from lm_pipeline.train.checkpoint import read_metadata

    if is_hf_model_dir(path):
        return 0
    return int(read_metadata(resolve_checkpoint(path))["step"])


def _is_shape(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def load_model_from_checkpoint(path: str | os.PathLike, *, dtype: Any = None) -> LoadedCheckpoint:
    """The run config, model, tokenizer dir and model vocabulary size of a checkpoint.

    ``path``: a complete ``step-<N>`` dir, or a run dir (its latest complete checkpoint is used).
    Only the ``model`` subtree of the saved train state is read (no optimizer state), onto the
    first local device. Parameters keep their saved dtype unless ``dtype`` is given.
    """
    from lm_pipeline.hf.start import is_hf_model_dir
    from lm_pipeline.train.checkpoint import load, read_metadata
    from lm_pipeline.train.checkpoint.remote import local_copy
    from lm_pipeline.train.optim import EMA_SUBTREE

    if is_hf_model_dir(path):
        return _load_hf_dir(os.fspath(path), dtype)
    step_dir = resolve_checkpoint(path)
    step_dir = local_copy(step_dir)  # itself; an object store's: a local copy (downloaded once)
    cfg_path = fs.local_path(fs.join(step_dir, CONFIG_FILE))
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{step_dir} has no {CONFIG_FILE}: cannot tell which model it holds")
    cfg = load_config(cfg_path)
    saved = read_metadata(step_dir).get("state", {}).get("arrays", {})
    subtree = MODEL_SUBTREE if cfg.optimizer.ema_beta is None else EMA_SUBTREE  # the weight average
    emb = saved.get(f"{subtree}.token_embeddings")
    if emb is None:
        raise ValueError(f"{step_dir}: the checkpoint holds no '{subtree}.token_embeddings' array")
    vocab_size = int(emb["shape"][0])

    skeleton = eqx.filter_eval_shape(cfg.model.build, vocab_size, key=jax.random.PRNGKey(0))
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def abstract(p, leaf):
        if not _is_shape(leaf):
            return leaf
        key = ".".join([subtree, *(e.name for e in p)])
        dt = np.dtype(saved[key]["dtype"]) if key in saved else leaf.dtype  # missing: load() names it
        return jax.ShapeDtypeStruct(leaf.shape, dt, sharding=device)

    target = jax.tree_util.tree_map_with_path(abstract, skeleton, is_leaf=_is_shape)
    model = load(step_dir, target, subtree=subtree)
    if dtype is not None:
        from lm_pipeline.train.trainer import cast_floating

        model = cast_floating(model, resolve_dtype(dtype))
    tok = os.path.join(step_dir, TOKENIZER_DIR)
    tok_dir = tok if os.path.isfile(os.path.join(tok, "tokenizer.json")) else None
    return LoadedCheckpoint(cfg, model, tok_dir, vocab_size)



def _load_hf_dir(path: str, dtype: Any) -> LoadedCheckpoint:
    """A Hugging Face model directory as a checkpoint: its model config (``config.json``), its
    weights, and its tokenizer when it holds ``tokenizer.json``."""
    from lm_pipeline.hf.load import load_hf_checkpoint

    model_cfg, model = load_hf_checkpoint(path, dtype=dtype)
    has_tok = os.path.isfile(os.path.join(path, "tokenizer.json"))
    overrides: dict[str, Any] = {"model": _model_dict(model_cfg)}
    if has_tok:
        overrides["data"] = {"tokenizer": path}
    cfg = load_config(None, [(k, v) for k, v in overrides.items()])
    vocab_size = int(model.token_embeddings.shape[0])
    return LoadedCheckpoint(cfg, model, path if has_tok else None, vocab_size)


def _model_dict(model_cfg: Any) -> dict[str, Any]:
    from lm_pipeline.schema import to_dict

    return to_dict(model_cfg)
