"""The paths a run config names as its inputs, checked before any work: a tokenizer directory, a
Hugging Face model directory, a checkpoint to resume or start from.

Each ``*_problem`` function returns None when the input can be used, else one line that names
the file and says what is wrong and what to do (the caller adds the config field:
``ConfigError(field, problem)``). Only what can be told from the local filesystem is checked
here: a hub id (``gpt2``, ``org/name``) is left to the code that loads it (:mod:`lm_pipeline.hf.hub`),
and a URL to the object-store checks (:func:`lm_pipeline.fs.access_problem`).

Light at import (no JAX, no ``transformers``).
"""

from __future__ import annotations

import json
import os
import re

from lm_pipeline import fs

__all__ = [
    "checkpoint_problem",
    "hf_model_dir_problem",
    "hub_model_problem",
    "json_problem",
    "looks_like_path",
    "tokenizer_problem",
]

#: A hub repo id: ``name`` or ``org/name`` (what ``huggingface_hub`` accepts).
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*(/[A-Za-z0-9][A-Za-z0-9_.\-]*)?$")

#: What a slow (Python) tokenizer is saved as; ``transformers`` may convert one to a fast tokenizer.
_SLOW_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "spiece.model", "sentencepiece.bpe.model")

#: Files a tokenizer directory may hold besides ``tokenizer.json``, all JSON.
_TOKENIZER_JSON_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")

#: Weights that are pickles: never loaded (PyTorch ``.pt`` / ``.bin`` checkpoints and the like).
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def looks_like_path(text: str) -> bool:
    """Whether ``text`` can only be a filesystem path, never a hub id: absolute, ``~``, ``./`` or
    ``../``, more than one ``/``, a file name ending (``.json``), or anything a hub id cannot spell.
    ``org/name`` may be either; it is a path only when it exists."""
    name = text.split("@", 1)[0]
    return (text.startswith(("/", "~", "./", "../", "file://")) or text in (".", "..") or name.count("/") > 1
            or name.endswith((".json", ".safetensors", *_PICKLE_SUFFIXES)) or not _REPO_RE.match(name))


def json_problem(path: str) -> str | None:
    """Why the local file ``path`` is not a JSON object (with the line and column of a syntax
    error), or None when it is one (or does not exist)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        return f"'{path}' is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
    except UnicodeDecodeError as e:
        return f"'{path}' is not valid JSON (not UTF-8 text: {e.reason} at byte {e.start})"
    except OSError as e:
        return f"'{path}' cannot be read ({e.strerror or e})"
    if not isinstance(data, dict):
        return f"'{path}' holds a JSON {type(data).__name__}, not an object"
    return None


def _tokenizer_file_problem(path: str) -> str | None:
    problem = json_problem(path)
    if problem is None:
        from tokenizers import Tokenizer

        try:
            with open(path, encoding="utf-8") as f:
                Tokenizer.from_str(f.read())
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file
            first = (str(e).splitlines() or [type(e).__name__])[0]
            problem = f"'{path}' is not a tokenizer the tokenizers library can load ({first})"
    return problem


def tokenizer_problem(name_or_path: str, field: str = "data.tokenizer") -> str | None:
    """Why the local tokenizer ``name_or_path`` cannot be loaded: it does not exist, is a file, is
    a directory without ``tokenizer.json`` (nor a slow tokenizer's files), or its files are
    corrupt; None when it looks loadable, or is a hub id or URL (not checked here)."""
    local = fs.as_local(name_or_path)
    if local is None:
        return None
    hint = (f"point {field} at a directory holding tokenizer.json (as tokenizer.save_pretrained writes it), "
            "or at a hub id such as 'gpt2'")
    if not os.path.exists(local):
        return f"'{name_or_path}' does not exist; {hint}" if looks_like_path(name_or_path) else None
    if not os.path.isdir(local):
        if os.path.basename(local) == "tokenizer.json":
            return (f"'{name_or_path}' is a file; {field} takes the directory that holds it: "
                    f"'{os.path.dirname(name_or_path) or '.'}'")
        return f"'{name_or_path}' is a file, not a tokenizer directory; {hint}"
    names = set(os.listdir(local))
    if "tokenizer.json" not in names:
        if names.intersection(_SLOW_TOKENIZER_FILES):
            return None  # a slow tokenizer: transformers converts it (or says why not)
        return f"'{name_or_path}' is a directory without tokenizer.json; {hint}"
    problem = _tokenizer_file_problem(os.path.join(local, "tokenizer.json"))
    for name in _TOKENIZER_JSON_FILES:
        if problem is None and name in names:
            problem = json_problem(os.path.join(local, name))
    if problem is not None:
        return f"{problem}; replace the tokenizer directory with an intact copy (save_pretrained it again)"
    return None


def hf_model_dir_problem(source: str, field: str, *, weights: bool = True) -> str | None:
    """Why the local Hugging Face model ``source`` cannot be used: it does not exist, is a file
    (a file is never a model, whatever its name), has no ``config.json`` or an invalid one, or
    (``weights``) no ``*.safetensors``; None when it looks usable, or is a hub id or URL."""
    local = fs.as_local(source)
    if local is None:
        return None
    kinds = "a Hugging Face model directory (config.json and *.safetensors weights) or a hub repo id 'org/name[@revision]'"
    if not os.path.exists(local):
        return f"'{source}' does not exist; {field} takes {kinds}" if looks_like_path(source) else None
    if not os.path.isdir(local):
        pickle = " (pickled weights are never loaded: convert them to safetensors)" if local.endswith(_PICKLE_SUFFIXES) else ""
        return f"'{source}' is a file, not a directory{pickle}; {field} takes {kinds}"
    config = os.path.join(local, "config.json")
    if not os.path.isfile(config):
        return f"'{source}' has no config.json: not a Hugging Face model directory; {field} takes {kinds}"
    problem = json_problem(config)
    if problem is not None:
        return f"{problem}; fix it, or download the model again"
    if weights and not any(n.endswith(".safetensors") for n in os.listdir(local)):
        return (f"'{source}' holds no *.safetensors weights (pickled .bin/.pt weights are never loaded: convert "
                "them to safetensors)")
    return None


def hub_model_problem(source: str, field: str) -> str | None:
    """Why the hub model ``source`` ('org/name[@revision]') cannot be read: the hub cannot be
    reached (checked once, in seconds: :mod:`lm_pipeline.hf.hub`) and the local Hugging Face cache
    does not hold its config.json; None when it can be, or ``source`` is a local path or URL."""
    local = fs.as_local(source)
    if local is None or os.path.exists(local) or looks_like_path(source):
        return None
    from lm_pipeline.hf import hub

    why = hub.unreachable()
    repo, _, revision = source.partition("@")
    if why is None or hub.in_cache(repo, ("config.json",), revision or None):
        return None
    return hub.offline_message("model", source, why, f"point {field} at a local copy (a directory holding its "
                               "config.json and *.safetensors, as save_pretrained writes it)")


def checkpoint_problem(path: str, field: str) -> str | None:
    """Why no checkpoint can be loaded from ``path`` (a run's ``step-<N>`` directory, or any
    directory above such: the latest complete one is used): it does not exist, is a file (a
    PyTorch ``.pt`` is never loaded), or holds no complete checkpoint; None when it holds one."""
    local = fs.as_local(path)
    kinds = "a checkpoint written by a training run (a step-<N> directory, or a directory above them)"
    if local is not None:
        if not os.path.exists(local):
            return f"'{path}' does not exist; point {field} at {kinds}, or remove it"
        if not os.path.isdir(local):
            pickle = (" (PyTorch and other pickled checkpoints are never loaded; to start from Hugging Face "
                      "weights use initialize_from_hf)") if local.endswith(_PICKLE_SUFFIXES) else ""
            return f"'{path}' is a file, not a checkpoint directory{pickle}; point {field} at {kinds}"
    from lm_pipeline.train.checkpoint import latest_checkpoint

    if latest_checkpoint(path) is None:
        return f"no complete checkpoint at or under '{path}'; point {field} at {kinds}, or remove it"
    return None
