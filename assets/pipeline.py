"""The deployment as Dagster definitions: every experiment, shared stages merged.

Each experiment (a file of ``configs/experiments/``) has the lineage::

    data_sources -> raw_shards -> tokenizer -> token_cache -> train_ckpt -> eval_report, hf_export

with keys ``<experiment>/<stage>``, bare ``<stage>`` for the default experiment; stages that
experiments share are the same artifact in the store, built once (keys and sharing:
:mod:`assets.deployment`). Besides: ``<experiment>/checkpoint_eval`` (one dynamic partition per
training checkpoint; likewise ``checkpoint_<stage>`` for each other per-checkpoint evaluation
stage of the experiment, such as ``checkpoint_task_eval``; requested by ``new_checkpoint_sensor``
and re-run by the ``reevaluate_<experiment>`` schedules), ``experiments/comparison`` (every experiment's
evaluation side by side, refreshed by its automation condition when an input it reads is materialized), and the
asset checks of each artifact (:mod:`assets.checks`).

:func:`build_definitions` assembles the Definitions (assets, jobs, sensors and schedules,
resources, executor) from the modules of the layer, one concern each:

* :mod:`assets.stages` -- the asset factory: one asset per stage node, and the data sources;
* :mod:`assets.launch` -- how ``train_ckpt`` launches a training (in process, a Pipes
  subprocess, a Ray job) and streams its checkpoints back as observations;
* :mod:`assets.provenance` -- each asset's inputs checked and recorded before it builds;
* :mod:`assets.metadata` -- what each materialization shows;
* :mod:`assets.checkpoints` -- checkpoint partitions and the per-checkpoint evaluations;
* :mod:`assets.automation` -- sensors and schedules;
* :mod:`assets.comparison` -- the comparison of the experiments;
* :mod:`assets.checks` -- the asset checks (token ids, counts, losses, the export's logits);
* :mod:`assets.console` -- a deliberate failure printed as its one line on the console;
* :mod:`assets.names` -- job, pool and tag names; :mod:`assets.dead_runs` -- pool slots of dead runs.

The names tests and tools use are importable from here too (``__all__``).
"""

from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from assets.automation import build_automation, checkpoint_requests, latest_checkpoint_keys
from assets.checkpoints import (
    checkpoint_assets,
    checkpoint_key,
    checkpoints_partitions,
    parse_checkpoint_key,
)
from assets.checks import asset_checks
from assets.comparison import comparison_asset
from assets.deployment import COMPARISON_KEY, Deployment
from assets.experiment import Experiment, default_experiment, load_experiments
from assets.names import (
    CHECKPOINT_TAG,
    COMPARE_JOB,
    EVALUATION_POOL,
    LINEAGE,
    OBSERVE_JOB,
    PIPELINE_JOB,
    TRAINING_POOL,
    eval_job_name,
    experiment_job_name,
)
from assets.stages import stage_assets
from resources import (
    ArtifactStoreResource,
    JaxRuntimeResource,
    TokenizingResource,
    TrackingResource,
    TrainingLauncherResource,
)

__all__ = [
    # defined here
    "build_assets", "build_definitions", "default_executor", "default_resources", "lineage_selection",
    # the layer's names and checkpoint helpers, from their modules
    "CHECKPOINT_TAG", "EVALUATION_POOL", "LINEAGE", "OBSERVE_JOB", "PIPELINE_JOB", "TRAINING_POOL",
    "checkpoint_key", "checkpoint_requests", "latest_checkpoint_keys", "parse_checkpoint_key",
]


def build_assets(dep: Deployment, *, checks: bool = True) -> list:
    """The assets of the deployment: the data sources, every experiment's stages, its
    per-checkpoint evaluations and the comparison; with ``checks``, the asset checks of each artifact."""
    return [*stage_assets(dep), *checkpoint_assets(dep), comparison_asset(dep),
            *(asset_checks(dep) if checks else [])]


def default_resources(exp: Experiment | Deployment) -> dict[str, Any]:
    root = exp.store_root if isinstance(exp, Experiment) else next(iter(exp.experiments.values())).store_root
    return {
        "store": ArtifactStoreResource(root=root),
        "training": TrainingLauncherResource.from_env(),
        "tokenizing": TokenizingResource.from_env(),
        "jax_runtime": JaxRuntimeResource(),
        "tracking": TrackingResource(),
    }


def default_executor(preload: tuple[str, ...] = ("assets._preload", "assets.definitions")):
    """Multiprocess (shard groups tokenize in parallel) with a forkserver that has imported the
    definitions and Dagster's storage layer once, so each step process starts quickly."""
    return dg.multiprocess_executor.configured(
        {"start_method": {"forkserver": {"preload_modules": list(preload)}}}, name="lm_pipeline_multiprocess")


def lineage_selection(dep: Deployment, experiments: Sequence[str] | None = None) -> list[dg.AssetKey]:
    """The data sources and lineage assets of ``experiments`` (default: all)."""
    names = list(experiments) if experiments is not None else list(dep.experiments)
    keys: list[dg.AssetKey] = []
    for name in names:
        for k in dep.lineage_keys(name):
            if k not in keys:
                keys.append(k)
    return keys


def build_definitions(experiments: Sequence[Experiment] | Experiment | None = None, *, default: str | None = None,
                      resources: Mapping[str, Any] | None = None, executor: Any = "default") -> dg.Definitions:
    """The Definitions of the deployment: every experiment (default: those of
    :func:`assets.experiment.load_experiments`), one store shared by them. ``default``: the
    experiment with bare keys (else :func:`assets.experiment.default_experiment`; one
    :class:`Experiment` given alone is the default)."""
    if isinstance(experiments, Experiment):
        default = default or experiments.name
        experiments = [experiments]
    exps = list(experiments) if experiments is not None else load_experiments()
    if default is None and experiments is None:
        default = default_experiment(exps)
    roots = {e.store_root for e in exps}
    if len(roots) > 1:
        raise ValueError(f"the experiments of one deployment share one store; got roots {sorted(roots)} "
                         f"(set store.root alike in {', '.join(e.path for e in exps)})")
    dep = Deployment(exps, default=default)
    assets = build_assets(dep)
    pipeline_job = dg.define_asset_job(
        PIPELINE_JOB, selection=dg.AssetSelection.assets(*lineage_selection(dep), COMPARISON_KEY),
        description="Observe the data, materialize every experiment's six lineage assets (an artifact "
                    "experiments share is built once, a cache hit for the others) and compare the experiments.")
    per_experiment = [dg.define_asset_job(experiment_job_name(n), selection=dg.AssetSelection.assets(*lineage_selection(dep, [n])),
                                          description=f"Observe the data and materialize the lineage of {n}.")
                      for n in dep.experiments]
    eval_jobs = {n: dg.define_asset_job(eval_job_name(n), selection=dg.AssetSelection.assets(*dep.checkpoint_stages(n).values()),
                                        partitions_def=checkpoints_partitions(n),
                                        description=f"Evaluate checkpoints of {n}.")
                 for n in dep.experiments}
    compare_job = dg.define_asset_job(COMPARE_JOB, selection=dg.AssetSelection.assets(COMPARISON_KEY),
                                      description="Compare every experiment's evaluation.")
    observe_job = dg.define_asset_job(OBSERVE_JOB, selection=dg.AssetSelection.assets(*dep.sources),
                                      description="Observe every data source (hash the shards).")
    sensors, schedules = build_automation(dep, eval_jobs, compare_job, observe_job)
    res = {**default_resources(dep), **(resources or {})}
    return dg.Definitions(
        assets=assets, jobs=[pipeline_job, *per_experiment, *eval_jobs.values(), compare_job, observe_job],
        sensors=sensors, schedules=schedules, resources=res,
        executor=default_executor() if executor == "default" else executor,
    )
