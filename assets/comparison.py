"""``experiments/comparison``: every experiment's final evaluation side by side, one table and
one plot (:mod:`lm_pipeline.steps.comparison`: its rows, its address over the evaluation reports
it reads, how it is built and what it shows).

It reads each experiment's ``train_ckpt``, ``eval_report`` and, where the experiment evaluates
tasks, ``task_eval`` (its deps), and what Dagster records
of them is what it read: before it builds, Dagster's latest materialization of each must be the
artifact at the experiment's current address (or, for an experiment not trained or evaluated yet,
neither built nor recorded), else the step fails in one line naming what to materialize first
(:func:`assets.provenance.require_recorded`), as a stage does. Its code version is the comparison's.
"""

import dagster as dg

from assets.dead_runs import tend
from assets.deployment import COMPARISON_GROUP, COMPARISON_KEY, Deployment
from assets.metadata import result, to_dagster
from assets.provenance import require_recorded
from lm_pipeline.steps import comparison
from resources import ArtifactStoreResource

#: The stages a row of the comparison reads (:func:`lm_pipeline.steps.comparison.experiment_row`;
#: the columns naming their fingerprints), where an experiment has them.
READS = ("train_ckpt", "eval_report", "task_eval")


def _reads(dep: Deployment, name: str) -> list[str]:
    return [s for s in READS if s in dep.stages_of(name)]


def comparison_deps(dep: Deployment) -> list[dg.AssetKey]:
    """Each experiment's training run, evaluation report and task evaluation: the comparison's inputs."""
    keys = {dep.key(n, stage) for n in dep.experiments for stage in _reads(dep, n)}
    return sorted(keys, key=lambda k: k.to_user_string())


def _verify(context, dep: Deployment, pipes) -> dict[str, str | None]:
    """Check Dagster records what the comparison reads (see the module docstring); returns, per
    input asset, the fingerprint read (None: not built, not recorded)."""
    read: dict[str, str | None] = {}
    for name, pipe in pipes.items():
        for stage in _reads(dep, name):
            key = dep.key(name, stage)
            require_recorded(context.instance, COMPARISON_KEY, key, pipe, stage, absent_ok=True,
                             named=f"{name}'s {stage}")
            found = pipe.cached(stage)
            read[key.to_user_string()] = found.fingerprint if found is not None else None
    return read


def _used(dep: Deployment, rows) -> dict[str, str | None]:
    """Per input asset, the fingerprint the comparison's rows name."""
    return {dep.key(r["experiment"], stage).to_user_string(): r.get(stage) for r in rows
            for stage in _reads(dep, r["experiment"])}


#: When the comparison refreshes: once after any input it reads (an experiment's training run,
#: evaluation report or task evaluation) is materialized again, not while one is in progress. An
#: experiment not built yet holds nothing back (it is shown as not evaluated).
REFRESH_ON_INPUT = (dg.AutomationCondition.any_deps_updated().since_last_handled()
                    & ~dg.AutomationCondition.any_deps_in_progress()
                    & ~dg.AutomationCondition.in_progress()).with_label("refresh when an input is materialized")


def comparison_asset(dep: Deployment):
    """``experiments/comparison``: every experiment's final evaluation side by side."""

    @dg.asset(key=COMPARISON_KEY, deps=comparison_deps(dep), group_name=COMPARISON_GROUP, kinds={"pandas"},
              code_version=str(comparison.CODE_VERSION), automation_condition=REFRESH_ON_INPUT,
              description="Every experiment's final evaluation side by side (loss, bits per byte vs the unigram "
                          "baseline, parameters, training tokens and wall time): a table and a plot, of the "
                          "training runs and evaluation reports Dagster records. Refreshed by declarative "
                          "automation (comparison_automation) when one of them is materialized.")
    def comparison_of_experiments(context: dg.AssetExecutionContext, store: ArtifactStoreResource) -> dg.MaterializeResult:
        tend(context)
        artifacts = store.store()  # the deployment's one store (build_definitions checks it)
        pipes = {name: exp.fresh_pipeline(artifacts) for name, exp in dep.experiments.items()}
        read = _verify(context, dep, pipes)
        res = comparison.compare(artifacts, pipes)
        used = _used(dep, res.manifest.get("rows") or [])
        if used != read:  # an artifact committed between the check and the read (a checkpoint evaluation)
            changed = ", ".join(k for k in used if used[k] != read.get(k))
            raise dg.Failure(f"experiments/comparison: {changed} changed while it was read; materialize it again",
                             allow_retries=False)
        context.log.info(f"comparison {res.fingerprint}: {'cache hit' if res.hit else 'written'} at {res.path}")
        shown = {k: to_dagster(v) for k, v in comparison.metadata(res).items()}
        return result(res, {**shown, "input_fingerprints": dg.MetadataValue.json(used)})

    return comparison_of_experiments
