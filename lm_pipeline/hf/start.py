"""Continued pretraining from a Hugging Face model: ``initialize_from_hf`` / ``use_hf_model_config``.

Light at import (no JAX): parsing a config that names ``initialize_from_hf`` with
``use_hf_model_config: true`` reads the directory's ``config.json`` (:func:`hf_model_config`) and
imports the model configs only. :func:`hf_weights_identity` names the weights by content (the
sha256 of each safetensors file of a local directory) or, for a hub repo, by the resolved commit,
so a run's fingerprint changes when the starting weights do and never when only their path does.
:func:`is_hf_model_dir` tells a Hugging Face model directory from a training checkpoint, so that
``eval``, ``export`` and ``generate`` accept either.

What the run keeps of its starting model: :func:`model_vocab_size` keeps a padded vocabulary (an
embedding with more rows than the tokenizer has tokens, as many published checkpoints have), and
:func:`hf_source_files` records the starting model's ``config.json`` in every checkpoint
(``hf_source.json``), from which an export takes the position count and the vocabulary size the
model had (:func:`read_hf_source`).
"""

from __future__ import annotations

import json
import os
from typing import Any

from lm_pipeline import fs
from lm_pipeline.schema import ConfigError

__all__ = ["HF_SOURCE_FILE", "hf_model_config", "hf_source", "hf_source_config", "hf_source_files",
           "hf_weights_identity", "is_hf_model_dir", "model_vocab_size", "read_hf_config_json", "read_hf_source"]

#: The file of a checkpoint that records the Hugging Face model its run started from:
#: ``{"source": <dir or repo id>, "config": <its config.json>}``.
HF_SOURCE_FILE = "hf_source.json"

_IDENTITY_CACHE: dict[tuple, str] = {}


def is_hf_model_dir(path: str | os.PathLike) -> bool:
    """A local directory with ``config.json`` and safetensors weights and no checkpoint marker."""
    if not fs.is_local_dir(path):
        return False
    names = os.listdir(fs.local_path(path))
    return ("config.json" in names and "checkpoint.json" not in names
            and any(n.endswith(".safetensors") for n in names))


def _local_dir(source: str) -> str | None:
    """The absolute path of ``source`` when it is a directory on this machine, else None (a hub id)."""
    return fs.local_path(source) if fs.is_local_dir(source) else None


def _split(source: str) -> tuple[str, str | None]:
    if fs.is_local_dir(source):
        return source, None
    if "@" in source:
        repo, rev = source.rsplit("@", 1)
        return repo, rev or None
    return source, None


def read_hf_config_json(source: str) -> dict[str, Any]:
    """The ``config.json`` of a local directory or a hub repo (``org/name[@revision]``; needs
    the network, or the repo in the local Hugging Face cache)."""
    local = _local_dir(source)
    if local is not None:
        path = os.path.join(local, "config.json")
        if not os.path.isfile(path):
            raise ConfigError("initialize_from_hf", f"{source} has no config.json: not a Hugging Face model directory")
    else:
        from lm_pipeline.hf.config import REPO_RE

        repo, rev = _split(source)
        if not REPO_RE.match(repo):
            raise ConfigError("initialize_from_hf", f"{source!r} is neither a local directory nor a hub repo id "
                              "('org/name[@revision]')")
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download(repo, "config.json", revision=rev)
        except Exception as e:  # offline, unknown repo, gated
            raise ConfigError("initialize_from_hf", f"cannot read config.json of hub repo {source!r}: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    from lm_pipeline.inputs import json_problem

    problem = json_problem(path)
    if problem:
        raise ConfigError("initialize_from_hf", f"{problem}; fix it, or download the model again")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def hf_model_config(source: str) -> Any:
    """Our model config (``LmConfig``) for the Hugging Face model at ``source``."""
    from lm_pipeline.hf.load import config_from_hf

    hf = read_hf_config_json(source)
    if hf.get("auto_map"):
        raise ConfigError("initialize_from_hf", f"{source}: config.json has an auto_map (custom modelling code); "
                          "refusing to run it")
    try:
        return config_from_hf(hf)
    except ConfigError as e:
        raise ConfigError("initialize_from_hf", f"{source}: config.json {e.path}: {e.message}") from None


def hf_weights_identity(source: str) -> str:
    """What names the starting weights in a run's fingerprint: ``sha256:<hash>`` of the local
    directory's safetensors files (names and contents; computed once per process per file
    state), or ``hub:<repo>@<commit>`` for a hub repo (the revision resolved to its commit)."""
    import hashlib

    from lm_pipeline.fingerprint import sha256_file

    local = _local_dir(source)
    if local is not None:
        files = sorted(n for n in os.listdir(local) if n.endswith(".safetensors"))
        if not files:
            raise ConfigError("initialize_from_hf", f"{source} holds no *.safetensors weights")
        stats = tuple((n, os.stat(os.path.join(local, n)).st_size, os.stat(os.path.join(local, n)).st_mtime_ns)
                      for n in files)
        key = (os.path.realpath(local), stats)
        if key not in _IDENTITY_CACHE:
            h = hashlib.sha256()
            for n in files:
                h.update(f"{n}\0{sha256_file(os.path.join(local, n))}\n".encode())
            _IDENTITY_CACHE[key] = "sha256:" + h.hexdigest()
        return _IDENTITY_CACHE[key]
    repo, rev = _split(source)
    key = (repo, rev)
    if key not in _IDENTITY_CACHE:
        commit = None
        try:
            from huggingface_hub import HfApi

            commit = HfApi().model_info(repo, revision=rev).sha
        except Exception:  # offline: the locally cached snapshot's commit
            try:
                from huggingface_hub import snapshot_download

                commit = os.path.basename(snapshot_download(repo, revision=rev, local_files_only=True).rstrip("/"))
            except Exception:
                raise ConfigError("initialize_from_hf", f"cannot resolve hub repo {source!r} to a commit (no network "
                                  "and not in the local Hugging Face cache)") from None
        _IDENTITY_CACHE[key] = f"hub:{repo}@{commit}"
    return _IDENTITY_CACHE[key]


def hf_source(cfg: Any) -> tuple[str, str] | None:
    """(field, source) of the Hugging Face model a run starts from: ``initialize_from_hf``, or
    ``trainer.initialize_from`` naming a local Hugging Face directory; None for other runs."""
    if getattr(cfg, "initialize_from_hf", None):
        return "initialize_from_hf", cfg.initialize_from_hf
    start = getattr(cfg.trainer, "initialize_from", None)
    if start and is_hf_model_dir(start):
        return "trainer.initialize_from", start
    return None


def hf_source_config(cfg: Any) -> dict[str, Any] | None:
    """The ``config.json`` of the Hugging Face model the run starts from (:func:`hf_source`), or
    the one recorded by the checkpoint ``trainer.initialize_from`` names; None when there is none."""
    found = hf_source(cfg)
    if found is not None:
        return read_hf_config_json(found[1])
    start = getattr(cfg.trainer, "initialize_from", None)
    if start:
        record = read_hf_source(start)
        return None if record is None else record.get("config")
    return None


def hf_source_files(cfg: Any) -> dict[str, str]:
    """``{HF_SOURCE_FILE: json}`` for every checkpoint of a run that starts from a Hugging Face
    model (directly, or through a checkpoint that recorded one); ``{}`` otherwise."""
    found = hf_source(cfg)
    if found is not None:
        record = {"source": found[1], "config": read_hf_config_json(found[1])}
    else:
        start = getattr(cfg.trainer, "initialize_from", None)
        record = read_hf_source(start) if start else None
    if record is None:
        return {}
    return {HF_SOURCE_FILE: json.dumps(record, indent=2, sort_keys=True) + "\n"}


def read_hf_source(checkpoint: str | os.PathLike) -> dict[str, Any] | None:
    """What a checkpoint recorded of the Hugging Face model its run started from
    (``{"source", "config"}``), or None: a ``step-<N>`` dir or a run dir (its latest checkpoint);
    a Hugging Face directory is its own source."""
    path = os.fspath(checkpoint)
    if is_hf_model_dir(path):
        return {"source": path, "config": read_hf_config_json(path)}
    from lm_pipeline.train.checkpoint import latest_checkpoint

    found = latest_checkpoint(path)
    if found is None:
        return None
    data = fs.read_bytes(fs.join(found, HF_SOURCE_FILE))
    return None if data is None else json.loads(data.decode("utf-8"))


def model_vocab_size(cfg: Any, tokenizer_vocab: int) -> int:
    """The embedding rows of a run's model: the tokenizer's vocabulary, or, for a run that starts
    from a Hugging Face model (:func:`hf_source`, or a checkpoint that recorded one) with a padded
    vocabulary, that model's rows (the tokenizer's ids are the first of them; the padding rows
    stay, as in the model). A tokenizer with more tokens than the model has rows is refused: its
    last ids would have no embedding."""
    found = hf_source(cfg)
    if found is not None:
        where, source = found
        rows = read_hf_config_json(source).get("vocab_size")
    elif getattr(cfg.trainer, "initialize_from", None):  # a checkpoint of a run that started from one
        where, source = "trainer.initialize_from", cfg.trainer.initialize_from
        rows = (hf_source_config(cfg) or {}).get("vocab_size")
    else:
        return tokenizer_vocab
    if not isinstance(rows, int) or rows == tokenizer_vocab:
        return tokenizer_vocab
    if rows < tokenizer_vocab:
        raise ConfigError(where, f"{source} has {rows} embedding rows but the tokenizer has {tokenizer_vocab} tokens: "
                          "ids beyond the model's rows would have no embedding; train with the model's own "
                          "tokenizer (leave data.tokenizer unset with use_hf_model_config: true, or point it at "
                          "the model's directory)")
    return rows
