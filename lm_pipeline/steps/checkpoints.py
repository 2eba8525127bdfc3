"""The complete checkpoints of a training run's directory, on any filesystem."""

from __future__ import annotations

import re
from typing import Any

from lm_pipeline import fs


def complete_checkpoints(run_dir: str) -> list[dict[str, Any]]:
    """The complete ``step-N`` checkpoints directly under ``run_dir``, by step: ``{step, path, kind}``."""
    from lm_pipeline.train.checkpoint import IncompleteCheckpointError, read_metadata

    out = []
    for name, _is_dir in fs.listdir(run_dir):
        m = re.fullmatch(r"step-(\d+)", name)
        if not m:
            continue
        path = fs.join(run_dir, name)
        try:
            marker = read_metadata(path)
        except (IncompleteCheckpointError, FileNotFoundError):
            continue
        out.append({"step": int(marker.get("step", m.group(1))), "path": path, "kind": marker.get("kind", "permanent")})
    return sorted(out, key=lambda c: c["step"])
