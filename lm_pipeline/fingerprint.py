"""Canonical hashing: an artifact's address is the hash of what made it.

One scheme: ``fingerprint(stage, config, code_version, inputs)`` = short sha256 of the canonical
JSON of (stage name, the config's *semantic* fields, the stage's code version, the inputs).
Non-semantic fields (log cadence, worker counts, trackers, paths of the store) never enter it:
see the ``semantic`` flag on every config field. The same function gives a stage's address (its
inputs are its upstream stages' fingerprints, down to the shards' content hashes), its config
version (the upstream stages' config versions, no data read), and a training run's id.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from lm_pipeline.schema import to_dict

FINGERPRINT_LENGTH = 16


def _canonical(obj: Any) -> Any:
    if isinstance(obj, float):
        if not math.isfinite(obj):
            return repr(obj)
        return obj if not obj.is_integer() else int(obj)  # 1.0 and 1 hash alike
    if isinstance(obj, Mapping):
        return {str(k): _canonical(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    return obj


def canonical_json(obj: Any) -> str:
    """Deterministic JSON: sorted keys, no whitespace, integral floats as ints."""
    return json.dumps(_canonical(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def hash_json(obj: Any, length: int = FINGERPRINT_LENGTH) -> str:
    """The first ``length`` hex digits of the sha256 of ``obj``'s canonical JSON."""
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()[:length]


def sha256_file(path: str | os.PathLike) -> str:
    """The full hex sha256 of a local file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def semantic_view(cfg: Any) -> Any:
    """The semantic fields of a config dataclass, as plain data."""
    return to_dict(cfg, semantic_only=True)


def fingerprint(stage: str, config: Any, code_version: int, inputs: Mapping[str, Any] | None = None) -> str:
    """Short hex fingerprint of a stage's output (``FINGERPRINT_LENGTH`` hex digits)."""
    return hash_json(
        {
            "stage": stage,
            "config": semantic_view(config),
            "code_version": code_version,
            "inputs": dict(sorted((inputs or {}).items())),
        }
    )
