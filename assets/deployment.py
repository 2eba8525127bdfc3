"""The deployment's asset graph: every experiment's stages, with the stages they share merged.

Each experiment contributes the six stages of the table (:data:`lm_pipeline.steps.STAGES`) and
a data source. Two experiments *share* a stage when it has the same config version (a hash of the
stage's semantic config and code version and of every stage before it; see
:meth:`lm_pipeline.steps.Pipeline.config_version`) over the same store: then they read the same
data, build the same artifact, and the deployment has one asset for it. Asset keys:

* ``<experiment>/<stage>`` -- a stage of one experiment only (``llama/train_ckpt``);
* ``shared/<stage>`` -- a stage several experiments share (``shared/tokenizer``); if
  experiments share that stage in two different ways (two data sets, each used by several),
  ``shared/<stage>_<experiment>_<experiment>...`` names each group by its experiments;
* ``<prefix>/data_sources`` -- the observable source data under a ``raw_shards`` (same prefix);
* ``<experiment>/checkpoint_eval`` -- the per-checkpoint evaluations of one experiment;
* ``experiments/comparison`` -- every experiment's evaluation side by side.

Keys follow sharing: when an edit makes a shared stage differ between its experiments, each gets
its own ``<experiment>/<stage>`` (a new asset; the artifacts stay in the store, content-addressed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from assets.experiment import Experiment

SHARED = "shared"
SOURCE = "data_sources"
COMPARISON_KEY = dg.AssetKey(["experiments", "comparison"])
COMPARISON_GROUP = "experiments"


@dataclass
class Node:
    """One asset of the graph: a stage address used by one or more experiments."""

    stage: str
    key: dg.AssetKey
    version: str  # the stage's config version (the asset's code_version)
    experiments: list[Experiment]  # those using it, sorted by name; experiments[0] builds it
    deps: list[dg.AssetKey] = field(default_factory=list)  # upstream stage assets (+ the data source)

    @property
    def owner(self) -> Experiment:
        return self.experiments[0]

    @property
    def shared(self) -> bool:
        return len(self.experiments) > 1

    @property
    def group(self) -> str:
        return SHARED if self.shared else self.owner.name

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.experiments]


class Deployment:
    """The merged asset graph of ``experiments`` (see the module docstring)."""

    def __init__(self, experiments: Sequence[Experiment]):
        if not experiments:
            raise ValueError("a deployment needs at least one experiment")
        names = [e.name for e in experiments]
        if len(set(names)) != len(names):
            raise ValueError(f"experiment names must be distinct, got {names}")
        self.experiments: dict[str, Experiment] = {e.name: e for e in sorted(experiments, key=lambda e: e.name)}
        self.stages: list[str] = list(next(iter(self.experiments.values())).pipeline().stages)
        self._by_address: dict[tuple[str, str, str], Node] = {}
        self._of: dict[tuple[str, str], Node] = {}
        self.sources: dict[dg.AssetKey, Node] = {}  # data_sources key -> its raw_shards node
        groups: dict[tuple[str, str, str], list[Experiment]] = {}
        for exp in self.experiments.values():
            pipe = exp.pipeline()
            for stage in self.stages:
                groups.setdefault((exp.store_root, stage, pipe.config_version(stage)), []).append(exp)
        shared_per_stage: dict[str, int] = {}
        for (_, stage, _), exps in groups.items():
            if len(exps) > 1:
                shared_per_stage[stage] = shared_per_stage.get(stage, 0) + 1
        for (root, stage, version), exps in groups.items():
            if len(exps) == 1:
                key = dg.AssetKey([exps[0].name, stage])
            elif shared_per_stage[stage] == 1:
                key = dg.AssetKey([SHARED, stage])
            else:
                key = dg.AssetKey([SHARED, "_".join([stage, *(e.name for e in exps)])])
            node = Node(stage, key, version, exps)
            self._by_address[(root, stage, version)] = node
            for e in exps:
                self._of[(e.name, stage)] = node
        for node in self.nodes():
            pipe = node.owner.pipeline()
            node.deps = [self.key(node.owner.name, up) for up in pipe.stage(node.stage).upstream]
        # Every address covers the data's content, so each stage depends on its data source directly
        # (Dagster does not carry a dependency's staleness further down by itself).
        for node in self.nodes():
            src = self.source_key(node.owner.name)
            if src not in node.deps:
                node.deps.append(src)
            if node.stage == "raw_shards":
                self.sources[src] = node

    def nodes(self) -> list[Node]:
        """Every stage asset, in stage order, then by key."""
        order = {s: i for i, s in enumerate(self.stages)}
        return sorted(self._by_address.values(), key=lambda n: (order[n.stage], n.key.to_user_string()))

    def node(self, experiment: str, stage: str) -> Node:
        try:
            return self._of[(experiment, stage)]
        except KeyError:
            raise KeyError(f"no stage {stage!r} of experiment {experiment!r}; experiments: "
                           f"{', '.join(self.experiments)}") from None

    def key(self, experiment: str, stage: str) -> dg.AssetKey:
        """The asset key of ``stage`` of ``experiment`` (shared or its own)."""
        return self.node(experiment, stage).key

    def source_key(self, experiment: str) -> dg.AssetKey:
        """The observable data source under the experiment's ``raw_shards``."""
        raw = self.key(experiment, "raw_shards")
        return dg.AssetKey([*raw.path[:-1], SOURCE + raw.path[-1].removeprefix("raw_shards")])

    def checkpoint_eval_key(self, experiment: str) -> dg.AssetKey:
        return dg.AssetKey([experiment, "checkpoint_eval"])

    def train_keys(self) -> dict[dg.AssetKey, list[str]]:
        """Each training asset and the experiments that train through it."""
        out: dict[dg.AssetKey, list[str]] = {}
        for name in self.experiments:
            out.setdefault(self.key(name, "train_ckpt"), []).append(name)
        return out

    def describe(self) -> dict[str, Any]:
        """Which asset each experiment's stages are (for docs, logs and tests)."""
        return {name: {s: self.key(name, s).to_user_string() for s in self.stages} for name in self.experiments}
