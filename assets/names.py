"""The names the deployment gives Dagster besides asset keys (those: :mod:`assets.deployment`):
its jobs, pools and run tags. Sensors, schedules, the command line and the UI find things by
these names, so they change only with all of them.
"""

from __future__ import annotations

from lm_pipeline.steps import STAGES

#: The stages of every experiment's lineage as the table declares them, in order: those that apply
#: to every experiment (the deployment reads the table itself: :attr:`assets.deployment.Deployment.stages`).
LINEAGE = tuple(s.name for s in STAGES if s.not_applicable is None)

#: The command that runs Dagster on this code location with a persistent instance (assets/__main__.py).
ASSETS_COMMAND = "python -m assets"

PIPELINE_JOB = "pipeline"
COMPARE_JOB = "compare_experiments"
OBSERVE_JOB = "observe_data_sources"

#: Pools (one slot each by default): one training and one evaluation at a time per deployment.
TRAINING_POOL = "lm_pipeline_training"
EVALUATION_POOL = "lm_pipeline_evaluation"
#: The Dagster pool of each pool a stage declares (:data:`lm_pipeline.steps.stage.POOLS`).
POOLS = {"training": TRAINING_POOL, "evaluation": EVALUATION_POOL}

#: Run tags: the checkpoint directory a per-checkpoint evaluation reads, the experiment it is for.
CHECKPOINT_TAG = "lm_pipeline/checkpoint"
EXPERIMENT_TAG = "lm_pipeline/experiment"


def experiment_job_name(experiment: str) -> str:
    """The job that materializes one experiment's lineage (its data source observed first)."""
    return f"pipeline_{experiment}"


def eval_job_name(experiment: str) -> str:
    """The job that evaluates checkpoints of ``experiment`` (one partition per checkpoint)."""
    return f"evaluate_{experiment}"


def reevaluation_schedule_name(experiment: str) -> str:
    """The schedule that re-evaluates the latest checkpoints of ``experiment``."""
    return f"reevaluate_{experiment}"
