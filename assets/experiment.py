"""Which experiments the Dagster definitions describe, read each time the code location loads.

* Every ``*.yaml`` file in ``configs/experiments/`` (or ``$LM_PIPELINE_EXPERIMENTS_DIR``) is one
  experiment, named by its file name (``llama.yaml`` -> ``llama``). Adding a file and reloading the
  code location (the UI's "Reload", or a new ``dagster`` command) shows it.
* ``LM_PIPELINE_EXPERIMENT``: the path of one experiment YAML: only that one is loaded (handy for a
  one-off run of a config that lives elsewhere), as the deployment's default experiment.
* The *default* experiment (:func:`default_experiment`: ``default.yaml``, or the one file of
  ``LM_PIPELINE_EXPERIMENT``) has the bare stage names as asset keys (``train_ckpt``); every other
  experiment's keys are prefixed with its name (``llama/train_ckpt``).
* ``LM_PIPELINE_OVERRIDES``: field overrides applied to every loaded experiment,
  whitespace-separated ``section.field=value`` (values parsed as YAML; quote as in a shell),
  e.g. ``"model.num_layers=2 optimizer.learning_rate=1e-3"``.

They are read when the code location loads, never from run config, so every asset's
``code_version`` (and therefore the UI's stale flags) reflects the experiment actually run. A
relative ``store.root`` is resolved against the working directory at load time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS_DIR = REPO_ROOT / "configs" / "experiments"
DEFAULT_EXPERIMENT = EXPERIMENTS_DIR / "default.yaml"
#: The deployment's default experiment (its asset keys are the bare stage names: ``train_ckpt``).
DEFAULT_NAME = "default"
EXPERIMENT_ENV = "LM_PIPELINE_EXPERIMENT"
EXPERIMENTS_DIR_ENV = "LM_PIPELINE_EXPERIMENTS_DIR"
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
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
        """The experiment's name: its file name without ``.yaml`` (the first part of its asset keys)."""
        return Path(self.path).stem

    def fresh_pipeline(self, store):
        """A new :class:`~lm_pipeline.steps.Pipeline` over ``store`` that computes every address
        from the data as it is now (a step of a run must never use addresses computed when the
        code location loaded: the shards may have changed since)."""
        from lm_pipeline.steps import Pipeline

        return Pipeline(self.cfg, store, progress=False)

    @property
    def store_root(self) -> str:
        return self.cfg.store.root

    def pipeline(self, store=None, *, progress: bool = False):
        """The experiment's :class:`~lm_pipeline.steps.Pipeline` over ``store`` (default: its own
        store root), made once per store root: its addresses are computed once per process."""
        from lm_pipeline.steps import Pipeline
        from lm_pipeline.store import open_store

        store = open_store(store or self.store_root)
        key = (store.root, progress)
        if key not in self._pipelines:
            self._pipelines[key] = Pipeline(self.cfg, store, progress=progress)
        return self._pipelines[key]

    def describe(self) -> str:
        extra = " with " + " ".join(f"{k}={json.dumps(v, default=str)}" for k, v in self.overrides) if self.overrides else ""
        return f"{self.path}{extra}"


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
    from lm_pipeline import fs

    root = fs.norm(cfg.store.root)  # the store's one spelling: relative and ~ paths made absolute
    if root != cfg.store.root:  # a plain string field: replaced without parsing the config again
        cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, root=root))
    return Experiment(os.path.abspath(chosen), tuple(pairs), cfg)


def experiment_name(path: str | os.PathLike) -> str:
    """The name of the experiment in file ``path``; a clear error if it cannot name assets."""
    name = Path(path).stem
    if not _NAME_RE.match(name) or name in RESERVED_NAMES:
        raise ValueError(f"{path}: experiment file names become Dagster asset key prefixes: use letters, digits "
                         f"and '_' (starting with a letter), not one of {sorted(RESERVED_NAMES)}; rename the file, "
                         f"e.g. to {re.sub(r'[^A-Za-z0-9_]', '_', name).strip('_') or 'experiment'}.yaml")
    return name


#: Key prefixes the deployment uses itself (see :mod:`assets.deployment`).
RESERVED_NAMES = frozenset({"experiments"})


def default_experiment(experiments: Sequence[Experiment], env: Mapping[str, str] | None = None) -> str | None:
    """The name of the deployment's default experiment, whose asset keys are the bare stage names
    (``dagster asset materialize --select train_ckpt``): the one file of ``$LM_PIPELINE_EXPERIMENT``
    when that is set, else the experiment named ``default`` (``configs/experiments/default.yaml``),
    else none. It depends on no other experiment: adding or editing one never renames another's assets."""
    env = os.environ if env is None else env
    names = [e.name for e in experiments]
    if (env.get(EXPERIMENT_ENV) or "").strip() and len(names) == 1:
        return names[0]
    return DEFAULT_NAME if DEFAULT_NAME in names else None


def default_experiments_dir() -> Path:
    """``configs/experiments`` of the working directory (where ``dagster dev`` runs, like a relative
    ``store.root``) when it has one, else this repository's."""
    here = Path.cwd() / "configs" / "experiments"
    return here if here.is_dir() else EXPERIMENTS_DIR


def experiment_files(directory: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> list[Path]:
    """The experiment files to load: ``$LM_PIPELINE_EXPERIMENT`` alone, else every ``*.yaml`` of
    ``directory`` (default ``$LM_PIPELINE_EXPERIMENTS_DIR``, else :func:`default_experiments_dir`), sorted."""
    env = os.environ if env is None else env
    single = (env.get(EXPERIMENT_ENV) or "").strip()
    if directory is None and single:
        return [Path(single)]
    folder = Path(directory if directory is not None else (env.get(EXPERIMENTS_DIR_ENV) or "").strip() or default_experiments_dir())
    if not folder.is_dir():
        raise FileNotFoundError(f"experiments folder {folder} does not exist (${EXPERIMENTS_DIR_ENV}); create it "
                                "with one YAML file per experiment, or name one file with $" + EXPERIMENT_ENV)
    files = sorted(p for p in folder.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
    if not files:
        raise FileNotFoundError(f"no experiment in {folder}: add a YAML file per experiment "
                                f"(e.g. copy {DEFAULT_EXPERIMENT.relative_to(REPO_ROOT)})")
    return files


def load_experiments(directory: str | os.PathLike | None = None, overrides: Sequence[str] | str | None = None,
                     env: Mapping[str, str] | None = None) -> list[Experiment]:
    """Every experiment of the deployment (see :func:`experiment_files`), each with the overrides
    (default ``$LM_PIPELINE_OVERRIDES``); names are checked to be usable and distinct."""
    exps = []
    seen: dict[str, Path] = {}
    for path in experiment_files(directory, env):
        name = experiment_name(path)
        if name in seen:
            raise ValueError(f"two experiments are named {name!r}: {seen[name]} and {path}; rename one")
        seen[name] = path
        exps.append(load_experiment(path, overrides, env))
    return exps
