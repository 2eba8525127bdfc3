"""The deployment's automation: sensors and schedules.

* ``new_checkpoint_sensor``: each new complete (permanent) checkpoint reported by a training asset
  (an observation, :mod:`assets.launch`) becomes a partition of each experiment training through it
  and a run of the experiment's evaluation job for it (``<experiment>/checkpoint_eval``, and
  ``checkpoint_task_eval`` where it has tasks), exactly once (:func:`checkpoint_requests`);
* ``comparison_automation``: declarative automation (the comparison's ``AutomationCondition``,
  :data:`assets.comparison.REFRESH_ON_INPUT`): a new materialization of a training run, evaluation
  report or task evaluation that the comparison reads refreshes ``experiments/comparison``. The
  checkpoint evaluations stay with the sensor above: a checkpoint is a new dynamic partition,
  which only a sensor can add, and "exactly once per checkpoint" is its cursor;
* ``observe_data_sources`` (every 15 minutes): hashes every data source, so an edit to the data
  shows the stages built from it as stale;
* ``reevaluate_<experiment>`` (daily): re-evaluates the latest checkpoint of the experiment's most
  recent runs (:func:`reevaluation_requests`).
"""

import json
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from assets.checkpoints import checkpoints_partitions, parse_checkpoint_key
from assets.deployment import Deployment
from assets.names import CHECKPOINT_TAG, EXPERIMENT_TAG, eval_job_name, reevaluation_schedule_name


def checkpoint_requests(instance: dg.DagsterInstance, cursor: str | None, *, limit: int = 500,
                        kinds: tuple[str, ...] = ("permanent",),
                        train_keys: Mapping[dg.AssetKey, Sequence[str]] | None = None) -> dg.SensorResult:
    """One run request per newly reported complete checkpoint and experiment: the observations
    of each training asset in ``train_keys`` (key -> the experiments training through it; default
    ``{train_ckpt: [""]}``, one experiment with unprefixed names) after the cursor, each exactly
    once: its partition key is added to the experiment's checkpoints and used in the run key, and
    keys that already exist are skipped. The cursor is a JSON map of asset key -> storage id."""
    train_keys = dict(train_keys) if train_keys is not None else {dg.AssetKey("train_ckpt"): [""]}
    try:
        cursors = json.loads(cursor) if cursor else {}
        if not isinstance(cursors, dict):
            cursors = {}
    except json.JSONDecodeError:
        cursors = {}
    requests: list[dg.RunRequest] = []
    adds: dict[str, list[str]] = {}
    for asset, experiments in train_keys.items():
        user_key = asset.to_user_string()
        after = cursors.get(user_key)
        result = instance.fetch_observations(
            dg.AssetRecordsFilter(asset_key=asset, after_storage_id=after), limit=limit, ascending=True)
        for rec in result.records:
            cursors[user_key] = rec.storage_id
            obs = rec.asset_observation
            meta = obs.metadata if obs is not None else {}
            if meta.get("checkpoint_key") is None or meta.get("checkpoint_path") is None:
                continue
            key = str(meta["checkpoint_key"].value)
            kind = str(meta["kind"].value) if meta.get("kind") is not None else "permanent"
            if kind not in kinds:
                continue
            for name in experiments:
                parts = checkpoints_partitions(name).name if name else "checkpoints"
                if key in adds.get(parts, []) or instance.has_dynamic_partition(parts, key):
                    continue
                adds.setdefault(parts, []).append(key)
                requests.append(dg.RunRequest(
                    run_key=f"{name}:{key}" if name else key, partition_key=key,
                    job_name=eval_job_name(name) if name else None,
                    tags={CHECKPOINT_TAG: str(meta["checkpoint_path"].value), **({EXPERIMENT_TAG: name} if name else {})}))
    return dg.SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=[dg.AddDynamicPartitionsRequest(parts, keys) for parts, keys in adds.items()],
        cursor=json.dumps(cursors, sort_keys=True) if cursors else cursor,
    )


def latest_checkpoint_keys(keys: list[str], max_runs: int = 5) -> list[str]:
    """Per training run, the key of its latest checkpoint (the ``max_runs`` most recently added runs)."""
    latest: dict[str, tuple[int, str]] = {}
    order: list[str] = []
    for key in keys:
        try:
            fp, step = parse_checkpoint_key(key)
        except ValueError:
            continue
        if fp not in latest or step > latest[fp][0]:
            latest[fp] = (step, key)
        if fp in order:
            order.remove(fp)
        order.append(fp)
    return [latest[fp][1] for fp in order[-max_runs:]]


def reevaluation_requests(instance: dg.DagsterInstance, experiments: Sequence[str], tick: str,
                          max_runs: int = 5) -> list[dg.RunRequest]:
    """Per experiment, a run request re-evaluating the latest checkpoint of each of its most
    recent runs; run keys ``<experiment>:<partition>@<tick>`` (one per checkpoint per tick)."""
    out = []
    for name in experiments:
        keys = latest_checkpoint_keys(list(instance.get_dynamic_partitions(checkpoints_partitions(name).name)), max_runs)
        out += [dg.RunRequest(run_key=f"{name}:{k}@{tick}", partition_key=k, job_name=eval_job_name(name),
                              tags={"lm_pipeline/reason": "scheduled re-evaluation", EXPERIMENT_TAG: name})
                for k in keys]
    return out


def build_automation(dep: Deployment, eval_jobs: Mapping[str, Any], compare_job, observe_job) -> tuple[list, list]:
    """(sensors, schedules) of the deployment; ``eval_jobs``: experiment -> its evaluation job."""
    train_keys = dep.train_keys()

    @dg.sensor(name="new_checkpoint_sensor", jobs=list(eval_jobs.values()), minimum_interval_seconds=30,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Requests the evaluations of <experiment> (checkpoint_eval, ...) for each new complete (permanent) checkpoint "
                           "reported by a training asset, exactly once per experiment, also while it trains.")
    def new_checkpoint_sensor(context: dg.SensorEvaluationContext):
        return checkpoint_requests(context.instance, context.cursor, train_keys=train_keys)

    comparison_automation = dg.AutomationConditionSensorDefinition(
        "comparison_automation", target=compare_job.selection, default_status=dg.DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=30,
        description="Evaluates experiments/comparison's automation condition: refreshes it once after a training "
                    "run, evaluation report or task evaluation it reads is materialized.")

    @dg.schedule(name="observe_data_sources", cron_schedule="*/15 * * * *", target=observe_job,
                 default_status=dg.DefaultScheduleStatus.RUNNING,
                 description="Observes every data source (hashes the shards) so an edit to the data shows the "
                             "stages built from it as stale. On demand: the UI's 'Observe sources', or "
                             "the observe_data_sources job.")
    def observe_data_sources(context: dg.ScheduleEvaluationContext):
        return dg.RunRequest(run_key=f"observe@{context.scheduled_execution_time.isoformat()}")

    def reevaluate(name: str, job):
        @dg.schedule(name=reevaluation_schedule_name(name), cron_schedule="0 3 * * *", target=job,
                     default_status=dg.DefaultScheduleStatus.RUNNING,
                     description=f"Re-evaluates the latest checkpoint of {name}'s most recent runs (a cache hit "
                                 "unless the evaluation settings or code changed).")
        def _schedule(context: dg.ScheduleEvaluationContext):
            tick = context.scheduled_execution_time.strftime("%Y-%m-%dT%H:%M")
            requests = reevaluation_requests(context.instance, [name], tick)
            if not requests:
                return dg.SkipReason(f"no checkpoint of {name} has been reported yet")
            return requests

        return _schedule

    return ([new_checkpoint_sensor, comparison_automation],
            [observe_data_sources, *(reevaluate(name, job) for name, job in eval_jobs.items())])
