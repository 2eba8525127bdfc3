"""Which experiment the Dagster definitions describe, read once when the definitions load.

* ``LM_PIPELINE_EXPERIMENT``: path of the experiment YAML (default: ``configs/default.yaml`` of
  this repository).
* ``LM_PIPELINE_OVERRIDES``: field overrides, whitespace-separated ``section.field=value`` (values
  parsed as YAML; quote as in a shell), e.g. ``"model.num_layers=2 optimizer.learning_rate=1e-3"``.

They are read when the code location loads, never from run config, so every asset's
``code_version`` (and therefore the UI's stale flags) reflects the experiment actually run. A
relative ``store.root`` is resolved against the working directory at load time.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_EXPERIMENT = REPO_ROOT / "configs" / "default.yaml"
EXPERIMENT_ENV = "LM_PIPELINE_EXPERIMENT"
OVERRIDES_ENV = "LM_PIPELINE_OVERRIDES"


def parse_override_text(text: str | None) -> list[str]:
    """``"a.b=1 c.d='x y'"`` -> ``["--a.b=1", "--c.d=x y"]`` (the CLI's override form)."""
    out = []
    for item in shlex.split(text or ""):
        item = item[2:] if item.startswith("--") else item
        if "=" not in item or item.startswith("="):
            raise ValueError(f"${OVERRIDES_ENV}: expected section.field=value, got {item!r}")
        out.append(f"--{item}")
    return out


@dataclass(frozen=True)
class Experiment:
    """An experiment config as loaded for the definitions."""

    path: str
    overrides: tuple[str, ...]
    cfg: Any  # RunConfig

    @property
    def name(self) -> str:
        return Path(self.path).stem

    @property
    def store_root(self) -> str:
        return self.cfg.store.root

    def pipeline(self, store=None, *, progress: bool = False):
        from lm_pipeline.steps import Pipeline

        return Pipeline(self.cfg, store, progress=progress)

    def describe(self) -> str:
        extra = f" with {' '.join(o[2:] for o in self.overrides)}" if self.overrides else ""
        return f"{self.path}{extra}"


def _absolute_root(root: str) -> str:
    if "://" in root and not root.startswith("file://"):
        return root
    local = root[len("file://") :] if root.startswith("file://") else root
    return os.path.abspath(os.path.expanduser(local))


def load_experiment(path: str | os.PathLike | None = None, overrides: Sequence[str] | str | None = None,
                    env: Mapping[str, str] | None = None) -> Experiment:
    """Load the experiment: explicit arguments, else the environment, else the default."""
    from lm_pipeline.config import load_config
    from lm_pipeline.schema import from_dict, to_dict

    env = os.environ if env is None else env
    chosen = os.fspath(path) if path is not None else (env.get(EXPERIMENT_ENV) or "").strip() or str(DEFAULT_EXPERIMENT)
    if overrides is None:
        args = parse_override_text(env.get(OVERRIDES_ENV))
    elif isinstance(overrides, str):
        args = parse_override_text(overrides)
    else:
        args = [o if o.startswith("--") else f"--{o}" for o in overrides]
    cfg = load_config(chosen, args)
    root = _absolute_root(cfg.store.root)
    if root != cfg.store.root:
        raw = to_dict(cfg)
        raw["store"]["root"] = root
        cfg = from_dict(type(cfg), raw)
    return Experiment(os.path.abspath(chosen), tuple(args), cfg)
