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

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_EXPERIMENT = REPO_ROOT / "configs" / "default.yaml"
EXPERIMENT_ENV = "LM_PIPELINE_EXPERIMENT"
OVERRIDES_ENV = "LM_PIPELINE_OVERRIDES"


def parse_override_text(text: str | None) -> list[tuple[str, Any]]:
    """``"a.b=1 c.d='x y'"`` -> ``[("a.b", 1), ("c.d", "x y")]``: the command line's parser
    (:func:`lm_pipeline.config.parse_override_text`), errors naming ``$LM_PIPELINE_OVERRIDES``."""
    from lm_pipeline.config import parse_override_text as parse

    return parse(text, source=f"${OVERRIDES_ENV}")


@dataclass(frozen=True)
class Experiment:
    """An experiment config as loaded for the definitions."""

    path: str
    overrides: tuple[tuple[str, Any], ...]  # (dotted key, value) pairs applied to the file
    cfg: Any  # RunConfig
    # One Pipeline per store root, so a process computes each stage's address once.
    _pipelines: dict[tuple[str, bool], Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def name(self) -> str:
        return Path(self.path).stem

    @property
    def store_root(self) -> str:
        return self.cfg.store.root

    def pipeline(self, store=None, *, progress: bool = False):
        """The experiment's :class:`~lm_pipeline.steps.Pipeline` over ``store`` (default: its own
        store root), made once per store root: its addresses are computed once per process."""
        from lm_pipeline.steps import Pipeline
        from lm_pipeline.store import ArtifactStore

        store = store or ArtifactStore(self.store_root)
        key = (store.root, progress)
        if key not in self._pipelines:
            self._pipelines[key] = Pipeline(self.cfg, store, progress=progress)
        return self._pipelines[key]

    def describe(self) -> str:
        extra = " with " + " ".join(f"{k}={json.dumps(v, default=str)}" for k, v in self.overrides) if self.overrides else ""
        return f"{self.path}{extra}"


def _absolute_root(root: str) -> str:
    if "://" in root and not root.startswith("file://"):
        return root
    local = root[len("file://") :] if root.startswith("file://") else root
    return os.path.abspath(os.path.expanduser(local))


def load_experiment(path: str | os.PathLike | None = None, overrides: Sequence[str] | str | None = None,
                    env: Mapping[str, str] | None = None) -> Experiment:
    """Load the experiment: explicit arguments, else the environment, else the default."""
    from lm_pipeline.config import load_config, parse_overrides

    env = os.environ if env is None else env
    chosen = os.fspath(path) if path is not None else (env.get(EXPERIMENT_ENV) or "").strip() or str(DEFAULT_EXPERIMENT)
    if overrides is None:
        pairs = parse_override_text(env.get(OVERRIDES_ENV))
    elif isinstance(overrides, str):
        pairs = parse_override_text(overrides)
    else:
        pairs = parse_overrides([o if o.startswith("--") else f"--{o}" for o in overrides])
    cfg = load_config(chosen, pairs)
    root = _absolute_root(cfg.store.root)
    if root != cfg.store.root:  # a plain string field: replaced without parsing the config again
        cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, root=root))
    return Experiment(os.path.abspath(chosen), tuple(pairs), cfg)
