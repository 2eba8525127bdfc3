"""Hugging Face export: a checkpoint or model as a directory ``transformers`` loads with no extra code.

::

    <out_dir>/
      config.json                     GPT2LMHeadModel / LlamaForCausalLM config (token ids from the tokenizer)
      generation_config.json
      model.safetensors               or model-0000i-of-0000n.safetensors + model.safetensors.index.json
      tokenizer.json, tokenizer_config.json, special_tokens_map.json   (copied from the checkpoint)

Weights are written with the ``safetensors`` library (metadata ``format: pt``), tied LM heads
once (as ``save_pretrained`` does), and a vocabulary padded beyond the tokenizer's is sliced back
to the tokenizer's size, unless the run started from a Hugging Face model whose vocabulary was
padded so: then the export has that model's rows, as it had. The position count is what the model
holds: GPT-2's ``n_positions`` is its learned position table's rows; a Llama's
``max_position_embeddings`` is the larger of its ``seq_len`` and that of the Hugging Face model
its run started from (a run trained at a shorter length keeps the model's context). What the run
started from is read from the checkpoint's ``hf_source.json`` (see :mod:`lm_pipeline.hf.start`).
The directory is built under a temporary name beside the target and renamed into place, so a
reader never sees a half-written export. Writing the same weights twice gives byte-identical files.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from lm_pipeline import atomic, fs
from lm_pipeline.eval.loading import load_model_from_checkpoint
from lm_pipeline.faultpoints import faultpoint
from lm_pipeline.hf.config import ExportConfig
from lm_pipeline.hf.files import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    copy_tokenizer,
    embedding_names,
    write_json,
    write_safetensors,
)
from lm_pipeline.models.base import LmModel
from lm_pipeline.models.config import Gpt2Config, LlamaConfig, LmConfig
from lm_pipeline.models.hf_mapping import hf_config, to_hf_state_dict

log = logging.getLogger(__name__)

__all__ = ["export_hf", "export_hook", "export_state_dict", "hf_save_dir", "upload_hf"]

_EXPORT_DTYPES = ("float32", "bfloat16", "float16")


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



def _tied(cfg: LmConfig) -> bool:
    return isinstance(cfg, Gpt2Config) or bool(getattr(cfg, "tie_word_embeddings", False))


def export_state_dict(
    model: LmModel, cfg: LmConfig, *, vocab_size: int | None = None, dtype: str | None = None
) -> dict[str, np.ndarray]:
    """HF-named weights as written by :func:`export_hf`: the tied LM head once (under the input
    embedding's name), the vocabulary sliced to ``vocab_size`` (the tokenizer's, when the model's
    was padded), cast to ``dtype`` (None: the model's), C-contiguous numpy arrays."""
    state = to_hf_state_dict(model, cfg)
    model_vocab = int(state[embedding_names(cfg)[0]].shape[0])
    vocab = model_vocab if vocab_size is None else int(vocab_size)
    if vocab > model_vocab:
        raise ValueError(f"the tokenizer has {vocab} tokens but the model only {model_vocab}: cannot export")
    if _tied(cfg):
        state.pop("lm_head.weight", None)
    target = _np_dtype(dtype)
    out = {}
    for name, value in state.items():
        arr = np.asarray(value)
        if name in embedding_names(cfg) and vocab < model_vocab:
            arr = arr[:vocab]
        if target is not None and arr.dtype != target:
            arr = arr.astype(target)
        out[name] = np.ascontiguousarray(arr)
    return out


def _token_ids(tokenizer_dir: str | None) -> dict[str, int | None]:
    if tokenizer_dir is None:
        return {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    from lm_pipeline.data.tokenizer import tokenizer_info

    info = tokenizer_info(tokenizer_dir)
    return {"bos_token_id": info.bos_id, "eos_token_id": info.eos_id, "pad_token_id": info.pad_id}


def _source_of(cfg: LmConfig, hf_source: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The starting model's config.json when it is of ``cfg``'s family, else {}."""
    return hf_source if hf_source and hf_source.get("model_type") == getattr(cfg, "type", None) else {}


def _positions(cfg: LmConfig, state: Mapping[str, np.ndarray], hf_source: Mapping[str, Any] | None) -> int:
    """The exported position count: GPT-2's learned table's rows; a Llama's seq_len, or the larger
    ``max_position_embeddings`` of the Hugging Face model its run started from."""
    if "transformer.wpe.weight" in state:
        return int(state["transformer.wpe.weight"].shape[0])
    source = _source_of(cfg, hf_source).get("max_position_embeddings")
    return max(int(cfg.seq_len), int(source) if isinstance(source, int) else 0)


def _export_config_json(cfg: LmConfig, vocab: int, dtype: str, ids: Mapping[str, int | None],
                        positions: int | None = None) -> dict[str, Any]:
    conf = hf_config(cfg, vocab)
    if positions is not None:
        conf["n_positions" if isinstance(cfg, Gpt2Config) else "max_position_embeddings"] = positions
    if isinstance(cfg, LlamaConfig):  # transformers >= 5 reads rope_parameters, 4.x rope_theta
        conf["rope_parameters"] = cfg.rope_parameters()
    conf.update(ids)  # explicit nulls too: HF's defaults (GPT-2: 50256) would be wrong here
    conf["dtype"] = dtype
    conf["use_cache"] = True
    return conf


def _replace_dir(tmp: str, out: str) -> None:
    if os.path.lexists(out):
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
    hf_source: Mapping[str, Any] | None = None,
) -> str:
    """Write a Hugging Face ``transformers`` model directory (see the module docstring).

    Args:
        source: a checkpoint dir (``step-<N>`` or a run dir: its latest checkpoint; model,
            config and ``tokenizer/`` come from it) or a model (then ``config`` defaults to
            ``model.config``).
        out_dir: the export directory; replaced atomically if it exists and ``overwrite``. A URL
            (``s3://``, ``gs://``, ...): written locally, then uploaded (``config.json`` last).
        tokenizer_dir: tokenizer files to copy (default: the checkpoint's); without one the
            export holds only the model and no token ids.
        vocab_size: vocabulary to export (default: the tokenizer's, else the model's; the
            model's when ``hf_source`` had as many rows); a model vocabulary padded beyond it is
            sliced off.
        dtype: 'float32', 'bfloat16' or 'float16'; None keeps the parameters' dtype.
        max_shard_size: the largest safetensors file before sharding ('5GB', '500MB', bytes).
        progress: a tqdm bar of the bytes written; None = only when stderr is a terminal.
        hf_source: the ``config.json`` of the Hugging Face model the weights' run started from
            (its position count and padded vocabulary are kept); default: what the checkpoint
            recorded (``hf_source.json``), or a Hugging Face directory's own ``config.json``.

    Returns the export directory.
    """
    model, cfg, tok, recorded = _export_source(source, config, tokenizer_dir)
    hf_source = recorded if hf_source is None else hf_source
    target = fs.norm(out_dir)
    if not overwrite and fs.exists(target):
        raise FileExistsError(f"{target} exists (pass overwrite=True to replace it)")
    # An object store: written in a local staging directory, then uploaded with config.json last
    # (after the old one is deleted), so a directory with a config.json is a complete export.
    with fs.staged(target, last=(CONFIG_NAME,), clear=True) as local:
        _write_local(model, cfg, tok, local, hf_source, vocab_size=vocab_size, dtype=dtype,
                     max_shard_size=max_shard_size, progress=progress)
        faultpoint("export.before_upload")
    return target


def _export_vocab(model: LmModel, cfg: LmConfig, tok: str | None, hf_source: Mapping[str, Any] | None,
                  vocab_size: int | None) -> int | None:
    """The vocabulary to export: ``vocab_size`` if given, else the tokenizer's (the model's own
    rows when the Hugging Face model the run started from had them padded so), else None (the model's)."""
    if vocab_size is not None or tok is None:
        return vocab_size
    from lm_pipeline.data.tokenizer import tokenizer_info

    vocab_size = tokenizer_info(tok).vocab_size
    rows = int(model.token_embeddings.shape[0])
    if rows > vocab_size and _source_of(cfg, hf_source).get("vocab_size") == rows:
        return rows  # the starting model's padded vocabulary, as it was
    return vocab_size


def _write_local(model: LmModel, cfg: LmConfig, tok: str | None, out: str, hf_source: Mapping[str, Any] | None, *,
                 vocab_size: int | None, dtype: str | None, max_shard_size: int | str, progress: bool | None) -> None:
    """Write the export into the local directory ``out``: built under a temporary sibling and
    renamed into place (an existing ``out`` replaced)."""
    state = export_state_dict(model, cfg, vocab_size=_export_vocab(model, cfg, tok, hf_source, vocab_size), dtype=dtype)
    vocab = int(state[embedding_names(cfg)[0]].shape[0])
    weights_dtype = _dtype_name(next(iter(state.values())).dtype)
    ids = _token_ids(tok)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    atomic.remove_stale_temps(out)  # left by an export that was killed (exports of one directory run one at a time)
    tmp = atomic.temp_sibling(out)
    os.makedirs(tmp)
    nbytes = sum(int(a.nbytes) for a in state.values())
    bar = tqdm(total=nbytes, desc="export", unit="B", unit_scale=True, disable=None if progress is None else not progress)
    t0 = time.perf_counter()
    try:
        conf = _export_config_json(cfg, vocab, weights_dtype, ids, _positions(cfg, state, hf_source))
        _write_export(tmp, state, max_shard_size, conf, ids, tok, bar)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    log.info("exported %s model (vocab %d, %s, %.1f MB) to %s in %.1fs", getattr(cfg, "type", "?"), vocab,
             weights_dtype, nbytes / 1e6, out, time.perf_counter() - t0)


def _export_source(
    source: LmModel | str | os.PathLike, config: LmConfig | None, tokenizer_dir: str | os.PathLike | None
) -> tuple[LmModel, LmConfig, str | None, Mapping[str, Any] | None]:
    """(model, its config, tokenizer dir or None, the starting Hugging Face model's config.json
    or None) of :func:`export_hf`'s ``source``."""
    recorded = None
    if isinstance(source, LmModel):
        model = source
        cfg = config if config is not None else getattr(model, "config", None)
        if cfg is None:
            raise ValueError("pass config= for a model without a .config")
    else:
        loaded = load_model_from_checkpoint(source)
        model, cfg = loaded.model, config if config is not None else loaded.config.model
        if tokenizer_dir is None:
            tokenizer_dir = loaded.tokenizer_dir
        recorded = _recorded_source(source, loaded.config)
    return model, cfg, None if tokenizer_dir is None else os.fspath(tokenizer_dir), recorded


def _recorded_source(source: str | os.PathLike, run_cfg: Any) -> Mapping[str, Any] | None:
    """The starting Hugging Face model's config.json of a checkpoint: recorded in it, else (a
    checkpoint written before runs recorded it) read from its run config's source if reachable."""
    from lm_pipeline.hf.start import hf_source_config, read_hf_source

    record = read_hf_source(source)
    if record is not None:
        return record.get("config")
    try:
        return hf_source_config(run_cfg)
    except Exception as e:  # noqa: BLE001 - gone, offline: export with the run's own sizes
        log.warning("export: cannot read the Hugging Face model the run started from (%s); the export's position "
                    "count and vocabulary are the run's own", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None


def _write_export(
    tmp: str, state: Mapping[str, np.ndarray], max_shard_size: int | str, config_json: Mapping[str, Any],
    ids: Mapping[str, int | None], tok: str | None, bar: Any,
) -> None:
    """Fill the staging dir ``tmp``: weights, config.json, generation_config.json, tokenizer files."""
    bar.set_postfix_str("weights", refresh=False)
    write_safetensors(state, tmp, max_shard_size)
    bar.update(bar.total)
    faultpoint("export.after_weights")
    bar.set_postfix_str("config and tokenizer", refresh=False)
    write_json(os.path.join(tmp, CONFIG_NAME), config_json)
    gen = {"_from_model_config": True, **{k: v for k, v in ids.items() if v is not None}}
    write_json(os.path.join(tmp, GENERATION_CONFIG_NAME), gen)
    if tok is not None:
        copy_tokenizer(tok, tmp)


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
    run_id: str | None = None,
    hf_source: Mapping[str, Any] | None = None,
) -> Any:
    """A trainer :class:`~lm_pipeline.train.trainer.Hook` exporting every ``hf_save_steps`` to
    :func:`hf_save_dir` ``/step-<N>`` (and uploading with ``hf_upload``), or None when
    ``hf_save_steps`` is null. The final export at the end of training is the caller's.
    ``run_id`` (default: the run dir's name) names the run under ``hf_save_path``;
    ``hf_source``: as for :func:`export_hf`."""
    if export_cfg.hf_save_steps is None:
        return None
    import jax

    from lm_pipeline.train.trainer import Hook

    base = hf_save_dir(export_cfg, run_dir, run_id)

    def fn(info: Any) -> dict[str, float] | None:
        model = info.state.model
        if jax.process_count() > 1:  # every process takes part in the gather; process 0 writes
            from jax.experimental import multihost_utils

            model = multihost_utils.process_allgather(model, tiled=True)
            if jax.process_index() != 0:
                return None
        with fs.staged(fs.join(base, f"step-{info.step}"), last=(CONFIG_NAME,), clear=True) as local:
            out = export_hf(model, local, tokenizer_dir=tokenizer_dir, dtype=export_cfg.dtype,
                            max_shard_size=export_cfg.max_shard_size, hf_source=hf_source)
            if export_cfg.hf_upload:
                upload_hf(out, export_cfg.hf_upload, private=export_cfg.hf_upload_private,
                          commit_message=f"step {info.step}")
        return None

    return Hook(fn, every=export_cfg.hf_save_steps)


def hf_save_dir(export_cfg: ExportConfig, run_dir: str, run_id: str | None = None) -> str:
    """Where a run's ``hf_save_steps`` exports go (as ``step-<N>/``): ``<hf_save_path>/<run id>``,
    so that runs sharing an ``hf_save_path`` keep apart, or ``<run_dir>/hf`` without one."""
    if not export_cfg.hf_save_path:
        return fs.join(run_dir, "hf")
    rid = run_id or fs.basename(fs.norm(run_dir).rstrip("/"))
    return fs.join(export_cfg.hf_save_path, rid)
