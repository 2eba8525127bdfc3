"""Continued pretraining from a Hugging Face model: ``initialize_from_hf`` / ``use_hf_model_config``.

Light at import (no JAX): parsing a config that names ``initialize_from_hf`` with
``use_hf_model_config: true`` reads the directory's ``config.json`` (:func:`hf_model_config`) and
imports the model configs only. :func:`hf_weights_identity` names the weights by content (the
sha256 of each safetensors file of a local directory) or, for a hub repo, by the resolved commit,
so a run's fingerprint changes when the starting weights do and never when only their path does.
:func:`is_hf_model_dir` tells a Hugging Face model directory from a training checkpoint, so that
``eval``, ``export`` and ``generate`` accept either.
"""

from __future__ import annotations

import json
import os
from typing import Any

from lm_pipeline.schema import ConfigError

__all__ = ["hf_model_config", "hf_weights_identity", "is_hf_model_dir", "read_hf_config_json"]

_IDENTITY_CACHE: dict[tuple, str] = {}


def is_hf_model_dir(path: str | os.PathLike) -> bool:
    """A local directory with ``config.json`` and safetensors weights and no checkpoint marker."""
    p = os.fspath(path)
    if "://" in p or not os.path.isdir(p):
        return False
    names = os.listdir(p)
    return ("config.json" in names and "checkpoint.json" not in names
            and any(n.endswith(".safetensors") for n in names))


def _split(source: str) -> tuple[str, str | None]:
    if os.path.isdir(source):
        return source, None
    if "@" in source:
        repo, rev = source.rsplit("@", 1)
        return repo, rev or None
    return source, None


def read_hf_config_json(source: str) -> dict[str, Any]:
    """The ``config.json`` of a local directory or a hub repo (``org/name[@revision]``; needs
    the network, or the repo in the local Hugging Face cache)."""
    if os.path.isdir(source):
        path = os.path.join(source, "config.json")
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

    if os.path.isdir(source):
        files = sorted(n for n in os.listdir(source) if n.endswith(".safetensors"))
        if not files:
            raise ConfigError("initialize_from_hf", f"{source} holds no *.safetensors weights")
        stats = tuple((n, os.stat(os.path.join(source, n)).st_size, os.stat(os.path.join(source, n)).st_mtime_ns)
                      for n in files)
        key = (os.path.realpath(source), stats)
        if key not in _IDENTITY_CACHE:
            h = hashlib.sha256()
            for n in files:
                h.update(f"{n}\0{sha256_file(os.path.join(source, n))}\n".encode())
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
