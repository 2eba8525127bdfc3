"""A training run's checkpoints, on any filesystem: where step N of a run lives, and the complete
ones of its directory."""

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


def checkpoint_dir(store, run_fingerprint: str, step: int) -> str:
    """Where step ``step`` of the run ``train_ckpt/<run_fingerprint>`` of ``store`` is saved: under
    the run directory its manifest records (``trainer.checkpointer.base_path`` moves runs), else
    under its store address (a run still training)."""
    from lm_pipeline.train.checkpoint.marker import step_dir_name

    manifest = store.manifest("train_ckpt", run_fingerprint) or {}
    run_dir = manifest.get("run_dir") or store.artifact("train_ckpt", run_fingerprint).path
    return fs.join(run_dir, step_dir_name(step))
