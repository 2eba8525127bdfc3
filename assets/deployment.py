"""The deployment's asset graph: every experiment's stages, each experiment with its own keys.

Each experiment contributes the six stages of the table (:data:`lm_pipeline.steps.STAGES`), its
data source and its per-checkpoint evaluation. Asset keys depend on the experiment's name only,
never on what other experiments do:

* the deployment's *default* experiment (:attr:`Deployment.default`: the one named ``default``,
  or the one file of ``$LM_PIPELINE_EXPERIMENT``) keeps the bare stage names: ``train_ckpt``,
  ``tokenizer``, ``data_sources``, ``checkpoint_eval`` -- so ``--select train_ckpt`` acts on it;
* every other experiment's are ``<experiment>/<stage>`` (``llama/train_ckpt``,
  ``llama/data_sources``, ``llama/checkpoint_eval``);
* ``experiments/comparison`` -- every experiment's evaluation side by side.

Sharing is the content address, not the graph. Two experiments *share* a stage when it has the
same config version (a hash of the stage's semantic config and code version and of every stage
before it; see :meth:`lm_pipeline.steps.Pipeline.config_version`) over the same store: both
assets name the same artifact, so whichever materializes second is a recorded cache hit with the
same data version (the fingerprint), and each asset says whom it shares with
(:meth:`Deployment.shared_with`, its ``shared_with`` metadata). Editing one experiment therefore
changes that experiment's code versions only: exactly its own stages downstream of the edit turn
stale, and no key, dependency or status of another experiment changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from assets.experiment import DEFAULT_NAME, Experiment
from assets.mixture import add_components
from lm_pipeline.steps import stage_table

SOURCE = "data_sources"
CHECKPOINT_EVAL = "checkpoint_eval"
COMPARISON_KEY = dg.AssetKey(["experiments", "comparison"])
COMPARISON_GROUP = "experiments"


def checkpoints_group(experiment: str) -> str:
    """The asset group of ``experiment``'s per-checkpoint evaluation, apart from its lineage: a
    partitioned asset in a group makes the group's "Materialize all" a backfill of partitions."""
    return f"{experiment}_checkpoints"


@dataclass
class Node:
    """One stage asset: a stage of one experiment."""

    stage: str
    key: dg.AssetKey
    version: str  # the stage's config version (the asset's code_version)
    experiment: Experiment
    shared_with: list[str] = field(default_factory=list)  # other experiments with the same address now
    deps: list[dg.AssetKey] = field(default_factory=list)  # upstream stage assets (+ the data source)
    component: str | None = None  # a data mixture's component whose artifact this is (assets/mixture.py)

    @property
    def owner(self) -> Experiment:
        return self.experiment

    @property
    def name(self) -> str:
        return self.experiment.name

    @property
    def group(self) -> str:
        return self.experiment.name


class Deployment:
    """The asset graph of ``experiments`` (see the module docstring). ``default``: the experiment
    whose keys are the bare stage names (None: the one named ``default``, if any)."""

    def __init__(self, experiments: Sequence[Experiment], default: str | None = None):
        if not experiments:
            raise ValueError("a deployment needs at least one experiment")
        names = [e.name for e in experiments]
        if len(set(names)) != len(names):
            raise ValueError(f"experiment names must be distinct, got {names}")
        self.experiments: dict[str, Experiment] = {e.name: e for e in sorted(experiments, key=lambda e: e.name)}
        if default is not None and default not in self.experiments:
            raise ValueError(f"default experiment {default!r} is not one of {', '.join(self.experiments)}")
        self.default: str | None = default if default is not None else (
            DEFAULT_NAME if DEFAULT_NAME in self.experiments else None)
        # each experiment's stages (a stage may not apply to one: Stage.not_applicable); all, in table order
        self._stages_of = {name: list(exp.pipeline().stages) for name, exp in self.experiments.items()}
        self.stages: list[str] = [s for s in stage_table() if any(s in own for own in self._stages_of.values())]
        addresses: dict[tuple[str, str, str], list[str]] = {}
        for exp in self.experiments.values():
            pipe = exp.pipeline()
            for stage in self.stages_of(exp.name):
                addresses.setdefault((exp.store_root, stage, pipe.config_version(stage)), []).append(exp.name)
        self._of: dict[tuple[str, str], Node] = {}
        self.sources: dict[dg.AssetKey, Node] = {}  # data_sources key -> its experiment's raw_shards node
        for exp in self.experiments.values():
            pipe = exp.pipeline()
            for stage in self.stages_of(exp.name):
                version = pipe.config_version(stage)
                others = [n for n in addresses[(exp.store_root, stage, version)] if n != exp.name]
                node = Node(stage, self.key(exp.name, stage), version, exp, others)
                # Every address covers the data's content, so each stage depends on its data source
                # directly (Dagster does not carry a dependency's staleness further down by itself).
                node.deps = [*(self.key(exp.name, up) for up in pipe.stage(stage).upstream), self.source_key(exp.name)]
                self._of[(exp.name, stage)] = node
                if stage == "raw_shards":
                    self.sources[self.source_key(exp.name)] = node
            add_components(self, exp, pipe)  # a data mixture: per-component sources and caches

    def stages_of(self, experiment: str) -> list[str]:
        """The stages of ``experiment`` (those of the table that apply to it), in table order."""
        return self._stages_of[experiment]

    def checkpoint_stages(self, experiment: str) -> dict[str, dg.AssetKey]:
        """Each per-checkpoint evaluation stage of ``experiment`` (per checkpoint, in the evaluation
        pool) -> its partitioned asset: ``checkpoint_eval`` for eval_report, ``checkpoint_<stage>``
        for another."""
        pipe = self.experiments[experiment].pipeline()
        return {s: self.key(experiment, CHECKPOINT_EVAL if s == "eval_report" else f"checkpoint_{s}")
                for s in self.stages_of(experiment) if pipe.stage(s).per_checkpoint and pipe.stage(s).pool == "evaluation"}

    def prefix(self, experiment: str) -> list[str]:
        """The key prefix of ``experiment``'s assets: none for the default experiment."""
        if experiment not in self.experiments:
            raise KeyError(f"no experiment {experiment!r}; experiments: {', '.join(self.experiments)}")
        return [] if experiment == self.default else [experiment]

    def nodes(self) -> list[Node]:
        """Every stage asset (a mixture's component caches included), in stage order, then by experiment."""
        order = {s: i for i, s in enumerate(self.stages)}
        return sorted(self._of.values(), key=lambda n: (order[n.stage], n.name, n.component or ""))

    def add_node(self, node: Node) -> None:
        """Add a mixture component's asset (:func:`assets.mixture.add_components`)."""
        self._of[(node.name, f"{node.stage}[{node.component}]")] = node

    def components(self, experiment: str) -> list[Node]:
        """The component cache assets of ``experiment``'s data mixture (none without one)."""
        return [n for n in self.nodes() if n.name == experiment and n.component is not None]

    def lineage_keys(self, experiment: str) -> list[dg.AssetKey]:
        """The data sources, component caches and stage assets of ``experiment``."""
        sources = [k for k, n in self.sources.items() if n.name == experiment]
        return [*sources, *(n.key for n in self.components(experiment)), *(self.key(experiment, s) for s in self.stages_of(experiment))]

    def node(self, experiment: str, stage: str) -> Node:
        try:
            return self._of[(experiment, stage)]
        except KeyError:
            raise KeyError(f"no stage {stage!r} of experiment {experiment!r}; experiments: "
                           f"{', '.join(self.experiments)}") from None

    def key(self, experiment: str, stage: str) -> dg.AssetKey:
        """The asset key of ``stage`` of ``experiment``: ``<experiment>/<stage>``, or ``<stage>``
        for the default experiment."""
        return dg.AssetKey([*self.prefix(experiment), stage])

    def source_key(self, experiment: str) -> dg.AssetKey:
        """The observable data source under the experiment's ``raw_shards``."""
        return self.key(experiment, SOURCE)

    def checkpoint_eval_key(self, experiment: str) -> dg.AssetKey:
        """``<experiment>/checkpoint_eval`` (in the group :func:`checkpoints_group`)."""
        return self.key(experiment, CHECKPOINT_EVAL)

    def shared_with(self, experiment: str, stage: str) -> list[str]:
        """The other experiments whose ``stage`` is the same artifact (same address) as ``experiment``'s."""
        return list(self.node(experiment, stage).shared_with)

    def train_keys(self) -> dict[dg.AssetKey, list[str]]:
        """Each training asset and the experiment that trains through it."""
        return {self.key(name, "train_ckpt"): [name] for name in self.experiments}

    def describe(self) -> dict[str, Any]:
        """Which asset each experiment's stages are (for docs, logs and tests)."""
        return {name: {s: self.key(name, s).to_user_string() for s in self.stages_of(name)} for name in self.experiments}
