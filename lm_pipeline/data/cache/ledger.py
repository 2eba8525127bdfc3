"""The ledger: a cache's committed state (format, tokenizer, settings, shard plan, counts), and
the checks that a ledger matches what a build or a reader expects.

A ledger is a JSON object: ``format`` / ``format_version``; ``tokenizer.fingerprint``;
``settings`` (the tokenization settings); ``plan`` (:func:`shard_plan`); ``committed`` counts
(shards, docs, tokens, UTF-8 bytes); ``shards`` (one record per committed shard: name,
fingerprint, doc and token start and count, bytes); ``complete``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from lm_pipeline.data.encode import Shard, TokenizerInfo

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "format_problem",
    "incompatibility",
    "new_ledger",
    "settings_problem",
    "shard_plan",
]

FORMAT = "lm_pipeline.token_cache"
FORMAT_VERSION = 1


def shard_plan(shards: Sequence[Shard]) -> dict[str, Any]:
    """``{num_shards, fingerprint}``: sha256 over the shards' names and fingerprints, in order."""
    h = hashlib.sha256()
    for s in shards:
        h.update(json.dumps([s.name, s.fingerprint]).encode("utf-8"))
        h.update(b"\n")
    return {"num_shards": len(shards), "fingerprint": h.hexdigest()}


def new_ledger(info: TokenizerInfo, plan: dict[str, Any], chat: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ledger of an empty cache for tokenizer ``info`` and shard ``plan`` (``chat``: a chat
    source's settings, kept as ``settings.chat``; a text cache's ledger has no such key)."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tokenizer": {"fingerprint": info.fingerprint},
        "settings": {**info.settings(), **({"chat": chat} if chat else {})},
        "plan": plan,
        "committed": {"shards": 0, "docs": 0, "tokens": 0, "bytes": 0},
        "shards": [],
        "complete": False,
    }


def format_problem(ledger: Mapping[str, Any]) -> str | None:
    """Why ``ledger`` is not one this code reads (another format or version), or None."""
    if ledger.get("format") != FORMAT:
        return f"not a token cache ledger (format {ledger.get('format')!r})"
    if ledger.get("format_version") != FORMAT_VERSION:
        return (
            f"cache format version {ledger.get('format_version')!r} but this code reads version "
            f"{FORMAT_VERSION}; rebuild the cache"
        )
    return None


def settings_problem(ledger: Mapping[str, Any], settings: Mapping[str, Any]) -> str | None:
    """Which of ``settings`` the ledger disagrees with, or None."""
    have = ledger.get("settings", {})
    diffs = [f"{k}: cache has {have.get(k)!r}, expected {v!r}" for k, v in settings.items() if have.get(k) != v]
    return "settings differ (" + "; ".join(diffs) + ")" if diffs else None


def incompatibility(ledger: Mapping[str, Any], info: TokenizerInfo, plan: Mapping[str, Any],
                    chat: Mapping[str, Any] | None = None) -> str | None:
    """Why a cache with ``ledger`` is not the one tokenizer ``info`` builds from ``plan`` (a chat
    source's with settings ``chat``), or None."""
    problem = format_problem(ledger)
    if problem:
        return problem
    have_chat = ledger.get("settings", {}).get("chat")
    if (have_chat or None) != (dict(chat) if chat else None):
        return f"chat settings differ (cache has {have_chat!r}, expected {dict(chat) if chat else None!r})"
    have = ledger["tokenizer"]["fingerprint"]
    if have != info.fingerprint:
        return f"built with tokenizer {have[:16]}…, not {info.fingerprint[:16]}… ({info.path})"
    problem = settings_problem(ledger, info.settings())
    if problem:
        return problem
    if ledger["plan"] != plan:
        return (
            f"built from other shards ({ledger['plan']['num_shards']} shards, plan {ledger['plan']['fingerprint'][:16]}…; "
            f"now {plan['num_shards']} shards, plan {plan['fingerprint'][:16]}…)"
        )
    return None

