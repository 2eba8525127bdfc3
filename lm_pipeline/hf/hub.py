"""The Hugging Face hub from this machine: reachable or not, checked once per process.

Offline, ``transformers``, ``datasets`` and ``huggingface_hub`` retry each request for 25 to 50
seconds before they fail with a traceback. Before anything here loads a hub id (a tokenizer, a
dataset, a starting model), :func:`unreachable` opens one connection to the hub's endpoint
(``$HF_ENDPOINT``, default https://huggingface.co; through the proxy of the standard variables),
waiting at most :data:`lm_pipeline.fs.CONNECT_TIMEOUT_S` seconds. When it cannot, the process
goes offline as ``HF_HUB_OFFLINE=1`` would have it: what the local Hugging Face cache holds is
used, and anything else fails at once; :func:`offline_message` is the one line that says so and
how to point at a local copy instead. ``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE`` /
``HF_DATASETS_OFFLINE``) set by the user skips the check: the cache only, as they asked.

Light at import: no ``huggingface_hub`` until offline mode is switched on.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["cache_dir", "endpoint", "go_offline", "in_cache", "offline_by_env", "offline_message", "unreachable"]

log = logging.getLogger(__name__)

_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
_TRUE = ("1", "on", "yes", "true")

#: The check's answer for this process: absent until checked, then None (reachable) or why not.
_CHECKED: dict[str, str | None] = {}


def endpoint() -> str:
    """The hub's URL (``$HF_ENDPOINT``, as ``huggingface_hub`` reads it)."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def offline_by_env() -> bool:
    """Whether the user switched the hub off (``HF_HUB_OFFLINE=1`` or its older spellings)."""
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in _OFFLINE_VARS)


def unreachable() -> str | None:
    """Why the hub cannot be used from this process (one line), or None when it can. The first
    call opens one connection (a few seconds at most); when it fails the process goes offline
    (:func:`go_offline`), so the libraries read the local cache instead of retrying."""
    if offline_by_env():
        return "HF_HUB_OFFLINE=1 is set"
    if "hub" not in _CHECKED:
        from lm_pipeline.fs import connect_problem

        why = connect_problem(endpoint())
        _CHECKED["hub"] = None if why is None else f"cannot reach {endpoint()}: {why}"
        if why is not None:
            log.warning("the Hugging Face hub is unreachable (%s): using the local Hugging Face cache only, "
                        "as with HF_HUB_OFFLINE=1", why)
            go_offline()
    return _CHECKED["hub"]


def go_offline() -> None:
    """Offline mode for the rest of the process, as ``HF_HUB_OFFLINE=1`` at start-up: the variable
    for the libraries not imported yet (and child processes), the flag they read at import for
    those already imported."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    config = sys.modules.get("datasets.config")
    if config is not None:
        config.HF_HUB_OFFLINE = True
        config.HF_DATASETS_OFFLINE = True


def cache_dir() -> str:
    """Where the local Hugging Face caches are (``$HF_HOME``, default ``~/.cache/huggingface``)."""
    return os.path.expanduser(os.environ.get("HF_HOME")
                              or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"))


def in_cache(repo_id: str, filenames: tuple[str, ...], revision: str | None = None) -> bool:
    """Whether the local Hugging Face cache holds one of ``filenames`` of the model repo
    ``repo_id`` (at ``revision``, default its main branch): asked before loading a library that
    would take seconds to import only to find nothing there."""
    from huggingface_hub import try_to_load_from_cache

    for name in filenames:
        try:
            if isinstance(try_to_load_from_cache(repo_id, name, revision=revision), str):
                return True
        except Exception:  # noqa: BLE001 - an id the cache cannot spell: not there
            return False
    return False


def offline_message(kind: str, ident: str, why: str, local_copy: str) -> str:
    """One line: the ``kind`` ``ident`` is on the hub, which cannot be used (``why``), and is not in
    the local cache; ``local_copy`` says what to point the config at instead."""
    return (f"the {kind} {ident!r} is a Hugging Face hub id, the hub cannot be used from here ({why}) and the "
            f"local Hugging Face cache ({cache_dir()}) does not hold it; {local_copy}, or download it where there "
            "is network (into the same cache) and run with HF_HUB_OFFLINE=1")
