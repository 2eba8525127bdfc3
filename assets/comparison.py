"""``experiments/comparison``: every experiment's final evaluation side by side, one table and
one plot (:mod:`lm_pipeline.steps.comparison`: its rows, its address over the evaluation reports
it reads, how it is built and what it shows)."""

import dagster as dg

from assets.dead_runs import tend
from assets.deployment import COMPARISON_GROUP, COMPARISON_KEY, Deployment
from assets.metadata import result, to_dagster
from lm_pipeline.steps import comparison
from resources import ArtifactStoreResource


def comparison_asset(dep: Deployment):
    """``experiments/comparison``: every experiment's final evaluation side by side."""
    evals = sorted({dep.key(n, "eval_report") for n in dep.experiments}, key=lambda k: k.to_user_string())

    @dg.asset(key=COMPARISON_KEY, deps=evals, group_name=COMPARISON_GROUP, kinds={"pandas"},
              description="Every experiment's final evaluation side by side (loss, bits per byte vs the unigram "
                          "baseline, parameters, training tokens and wall time): a table and a plot. Refreshed by "
                          "comparison_sensor when an evaluation lands.")
    def comparison_of_experiments(context: dg.AssetExecutionContext, store: ArtifactStoreResource) -> dg.MaterializeResult:
        tend(context)
        artifacts = store.store()  # the deployment's one store (build_definitions checks it)
        res = comparison.compare(artifacts, {name: exp.fresh_pipeline(artifacts) for name, exp in dep.experiments.items()})
        context.log.info(f"comparison {res.fingerprint}: {'cache hit' if res.hit else 'written'} at {res.path}")
        return result(res, {k: to_dagster(v) for k, v in comparison.metadata(res).items()})

    return comparison_of_experiments
