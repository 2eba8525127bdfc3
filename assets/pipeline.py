"""The pipeline as Dagster software-defined assets.

Lineage (group ``pipeline``; job ``pipeline`` materializes all six)::

    raw_shards -> tokenizer -> token_cache -> train_ckpt -> eval_report, hf_export

(``token_cache`` also reads ``raw_shards``; ``eval_report`` also reads ``token_cache``),

plus ``checkpoint_eval`` (group ``evaluation``): one dynamic partition per training checkpoint,
requested by the ``new_checkpoint_sensor`` and re-run by the ``reevaluate_latest_checkpoints``
schedule (job ``evaluate_checkpoints``).

Every asset is a thin shell around :class:`lm_pipeline.steps.Pipeline`: it computes its
fingerprint, returns at once on a cache hit (a complete artifact at
``<store>/<stage>/<fingerprint>/``), else calls the core. Each returns a ``MaterializeResult`` whose
``data_version`` is the fingerprint and whose metadata says what was built; its ``code_version``
is :meth:`Pipeline.config_version`, a hash of the semantic config of the stage *and of all stages
before it*, so a config edit marks exactly the assets whose artifacts it changes as stale. Assets
pass nothing through Dagster's IO manager but a few small dicts: artifacts stay in the store.

``token_cache`` is a graph: ``token_cache_plan`` fans out one ``token_cache_group`` step per shard
group (dynamic outputs; run in parallel by the multiprocess executor), ``token_cache_commit``
assembles and commits the cache. ``train_ckpt`` runs through the ``training`` resource -- by
default its own process through Dagster Pipes -- reports each checkpoint as an observation of
``train_ckpt`` as it lands, and is retried by a ``RetryPolicy``; a retry resumes from the run's
latest checkpoint.
"""


import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import dagster as dg

from assets import metadata as md
from assets.experiment import Experiment, load_experiment
from lm_pipeline.steps import STAGE_NAMES
from resources import (
    ArtifactStoreResource,
    JaxRuntimeResource,
    TrackingResource,
    TrainingLauncherResource,
    apply_runtime_overrides,
)

GROUP = "pipeline"
EVAL_GROUP = "evaluation"
PIPELINE_JOB = "pipeline"
EVAL_JOB = "evaluate_checkpoints"
LINEAGE = STAGE_NAMES
CHECKPOINTS = dg.DynamicPartitionsDefinition(name="checkpoints")
CHECKPOINT_TAG = "lm_pipeline/checkpoint"
TRAIN_RETRIES = 2

_KEY_RE = re.compile(r"^(?P<fp>[0-9A-Za-z_.\-]+)-step(?P<step>\d+)$")


def checkpoint_key(run_fingerprint: str, step: int) -> str:
    """The ``checkpoints`` partition key of a run's checkpoint: ``<train fingerprint>-step<N>``."""
    return f"{run_fingerprint}-step{int(step):07d}"


def parse_checkpoint_key(key: str) -> tuple[str, int]:
    m = _KEY_RE.match(key)
    if not m:
        raise ValueError(f"not a checkpoint partition key: {key!r} (expected <fingerprint>-step<N>)")
    return m.group("fp"), int(m.group("step"))


def _result(res, metadata: Mapping[str, Any]) -> dg.MaterializeResult:
    return dg.MaterializeResult(metadata=dict(metadata), data_version=dg.DataVersion(res.fingerprint))


def _require_trained(pipe):
    """The checkpoint readers never train: training runs only through ``train_ckpt`` (its resource)."""
    if pipe.cached("train_ckpt") is None:
        fp = pipe.address("train_ckpt").fingerprint
        raise dg.Failure(f"train_ckpt {fp} is not materialized yet; materialize it first "
                         "(e.g. --select 'train_ckpt+' or the 'pipeline' job)")
    return pipe


def _log(context, res) -> None:
    if res.hit:
        context.log.info(f"{res.stage} {res.fingerprint}: cache hit, no work ({res.path})")
    else:
        context.log.info(f"{res.stage} {res.fingerprint}: built in {res.seconds:.1f}s at {res.path}")


def _observation(c: Mapping[str, Any], run_fingerprint: str) -> dg.AssetObservation:
    key = checkpoint_key(run_fingerprint, int(c["step"]))
    return dg.AssetObservation(asset_key="train_ckpt", metadata=md.checkpoint_observation(
        c, run_fingerprint=run_fingerprint, partition_key=key))


# --------------------------------------------------------------------------------------------
# training: in this process, or its own process through Pipes
# --------------------------------------------------------------------------------------------


def _train_in_process(context, pipe, fp: str, poll: float) -> Iterator[Any]:
    from lm_pipeline.pipes_train import CheckpointWatcher, fault_hooks
    from lm_pipeline.train.trainer import Hook

    run_dir = pipe.run_dir()
    watcher = CheckpointWatcher(run_dir)

    def log_metrics(info):
        shown = ", ".join(f"{k}={float(v):.4g}" for k, v in (info.metrics or {}).items() if k.startswith(("train/", "eval/")))
        if shown:
            context.log.info(f"step {info.step}: {shown}")

    hooks = [Hook(log_metrics, every=pipe.cfg.trainer.log_every), *fault_hooks(run_dir)]
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="train") as pool:
        fut = pool.submit(pipe.train_ckpt, hooks)
        while True:
            done, _ = concurrent.futures.wait([fut], timeout=poll)
            for c in watcher.poll():
                yield _observation(c, fp)
            if done:
                break
        res = fut.result()
    for c in watcher.poll():
        yield _observation(c, fp)
    return res, {}


def _train_with_pipes(context, pipe, fp: str, cfg, store: ArtifactStoreResource, training: TrainingLauncherResource,
                      jax_runtime: JaxRuntimeResource) -> Iterator[Any]:
    from lm_pipeline.config import dump_config

    extras = {"config": dump_config(cfg), "store_root": store.root, "expected_fingerprint": fp,
              "poll_seconds": training.poll_seconds, "attempt": context.retry_number}
    seen = 0
    t0 = time.perf_counter()

    def drain(session) -> Iterator[dg.AssetObservation]:
        nonlocal seen
        msgs = session.get_custom_messages()
        for m in msgs[seen:]:
            if isinstance(m, Mapping) and m.get("type") == "checkpoint":
                yield _observation(m, str(m.get("run_fingerprint") or fp))
        seen = len(msgs)

    stack = contextlib.ExitStack()
    with warnings.catch_warnings():  # Pipes' message handler uses a preview API internally
        warnings.filterwarnings("ignore", message=r".*expected_writer_count")
        session = stack.enter_context(dg.open_pipes_session(
            context=context, context_injector=dg.PipesTempFileContextInjector(),
            message_reader=dg.PipesTempFileMessageReader(), extras=extras))
    with stack:
        env = {**os.environ, **training.child_env(), **jax_runtime.env(), **session.get_bootstrap_env_vars()}
        context.log.info(f"train_ckpt {fp}: launching {' '.join(training.command())} through Pipes"
                         + (f" (LD_PRELOAD={env['LD_PRELOAD']})" if env.get("LD_PRELOAD") else ""))
        proc = subprocess.Popen(training.command(), env=env, cwd=os.getcwd())
        try:
            while True:
                rc = proc.poll()
                yield from drain(session)
                if rc is not None:
                    break
                time.sleep(training.poll_seconds)
        except BaseException:  # interrupted or terminated: stop the training process too
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            raise
    yield from drain(session)
    if rc != 0:
        raise dg.Failure(f"training process exited with code {rc}; a retry resumes from the latest checkpoint",
                         allow_retries=True)
    reported = [r for r in session.get_reported_results() if isinstance(r, dg.MaterializeResult)]
    if not reported:
        raise dg.Failure("the training process reported no materialization of train_ckpt")
    got = reported[-1].data_version.value if reported[-1].data_version else None
    if got != fp:
        raise dg.Failure(f"the training process reported data version {got}, expected {fp}")
    res = pipe.cached("train_ckpt")
    if res is None:
        raise dg.Failure(f"train_ckpt {fp}: the process finished but the artifact has no manifest")
    child = dict(reported[-1].metadata)
    res.hit = bool(child["cache_hit"].value) if "cache_hit" in child else False
    res.seconds = time.perf_counter() - t0
    child.pop("seconds", None)  # the orchestrator's wall time (process start included) replaces it
    return res, child  # what the process reported (metrics, checkpoints) joins the materialization


# --------------------------------------------------------------------------------------------
# the assets
# --------------------------------------------------------------------------------------------


#: What each stage's materialization shows in the UI (assets/metadata.py), by stage.
METADATA = {"raw_shards": md.raw_shards, "tokenizer": md.tokenizer, "token_cache": md.token_cache,
            "train_ckpt": md.train_ckpt, "eval_report": md.eval_report, "hf_export": md.hf_export}


def build_assets(exp: Experiment) -> list:
    """The assets of the experiment: one per stage of the table (``lm_pipeline.steps.STAGES``),
    plus ``checkpoint_eval``. ``token_cache`` (fanned out) and ``train_ckpt`` (a training process)
    have their own factories; every other stage is a plain asset around its build function."""
    base = exp.pipeline()
    special = {"token_cache": _token_cache_asset, "train_ckpt": _train_ckpt_asset}
    assets = []
    for stage in base.stages.values():
        spec = {"group_name": GROUP, "code_version": base.config_version(stage.name), "kinds": {stage.kind},
                "description": stage.description,
                "metadata": {"experiment": dg.MetadataValue.text(exp.describe()),
                             "semantic_config": dg.MetadataValue.json(
                                 json.loads(json.dumps(base.stage_config(stage.name), default=str))),
                             "fingerprint_inputs": dg.MetadataValue.text(
                                 ", ".join(base.input_stages(stage.name)) or "the data's content")}}
        assets.append(special.get(stage.name, _stage_asset)(exp, stage, spec))
    assets.append(_checkpoint_eval_asset(exp))
    return assets


def _stage_asset(exp: Experiment, stage, spec: dict[str, Any]):
    """A stage as one asset: build it (a hit does no work); checkpoint readers never train."""

    @dg.asset(key=stage.name, deps=list(stage.upstream), **spec)
    def _asset(context: dg.AssetExecutionContext, store: ArtifactStoreResource) -> dg.MaterializeResult:
        pipe = exp.pipeline(store.store())
        if stage.per_checkpoint:
            _require_trained(pipe)
        res = pipe.build(stage.name)
        _log(context, res)
        return _result(res, METADATA[stage.name](res))

    return _asset


def _token_cache_asset(exp: Experiment, stage, spec: dict[str, Any]):
    """``token_cache`` as a graph: a plan op fans out one op per shard group, a commit op joins them."""
    from lm_pipeline.steps import CacheGroup

    @dg.op(name="token_cache_plan", ins={up: dg.In(dg.Nothing) for up in stage.upstream},
           out=dg.DynamicOut(dict), description="Hit: nothing to do. Miss: one output per shard group.")
    def token_cache_plan(context: dg.OpExecutionContext, store: ArtifactStoreResource):
        pipe = exp.pipeline(store.store())
        hit = pipe.cached("token_cache")
        if hit is not None:
            context.log.info(f"token_cache {hit.fingerprint}: cache hit, no shard group to tokenize")
            return
        groups = pipe.token_cache_groups()
        context.log.info(f"token_cache {pipe.address('token_cache').fingerprint}: {len(groups)} shard groups to tokenize")
        for g in groups:
            yield dg.DynamicOutput(g.to_dict(), mapping_key=g.key)

    @dg.op(name="token_cache_group", description="Tokenize one shard group into its part of the cache.")
    def token_cache_group(context: dg.OpExecutionContext, group: dict, store: ArtifactStoreResource) -> dict:
        info = exp.pipeline(store.store()).token_cache_part(CacheGroup.from_dict(group))
        context.log.info(f"group {info['group']}: {info.get('num_docs')} docs, {info.get('num_tokens')} tokens "
                         f"in {info['seconds']:.1f}s")
        return info

    @dg.op(name="token_cache_commit", out=dg.Out(dg.Nothing),
           description="Assemble the groups' parts into the token cache and commit it (a hit if complete).")
    def token_cache_commit(context: dg.OpExecutionContext, parts: list, store: ArtifactStoreResource):
        res = exp.pipeline(store.store()).token_cache_commit(parts)
        _log(context, res)
        meta = METADATA["token_cache"](res)
        meta["groups_tokenized_in_this_run"] = dg.MetadataValue.int(len(parts))
        with warnings.catch_warnings():  # Output(data_version=...) is marked beta
            warnings.simplefilter("ignore")
            return dg.Output(None, data_version=dg.DataVersion(res.fingerprint), metadata=meta)

    spec = {**spec, "description": spec["description"][:-1] + ", fanned out over shard groups."}

    @dg.graph_asset(name=stage.name, ins={up: dg.AssetIn(up, dagster_type=dg.Nothing) for up in stage.upstream},
                    **spec)
    def token_cache(raw_shards, tokenizer):
        groups = token_cache_plan(raw_shards=raw_shards, tokenizer=tokenizer)
        return token_cache_commit(groups.map(token_cache_group).collect())

    return token_cache


def _train_ckpt_asset(exp: Experiment, stage, spec: dict[str, Any]):
    """``train_ckpt``: through the ``training`` resource (Pipes or in-process), retried; each
    checkpoint is reported as an observation as it lands."""
    spec = {**spec, "description": spec["description"] + " Each checkpoint is reported as an observation "
                                                          "as it lands."}

    @dg.asset(key=stage.name, deps=list(stage.upstream), retry_policy=dg.RetryPolicy(max_retries=TRAIN_RETRIES, delay=2),
              **spec)
    def train_ckpt(context: dg.AssetExecutionContext, store: ArtifactStoreResource, training: TrainingLauncherResource,
                   jax_runtime: JaxRuntimeResource, tracking: TrackingResource):
        pipe = exp.pipeline(store.store())
        fp = pipe.address("train_ckpt").fingerprint
        hit = pipe.cached("train_ckpt")
        if hit is not None:
            _log(context, hit)
            yield _result(hit, METADATA["train_ckpt"](hit))
            return
        if context.retry_number:
            from lm_pipeline.train.checkpoint import latest_checkpoint

            context.log.info(f"attempt {context.retry_number + 1}: resuming from {latest_checkpoint(pipe.run_dir())}")
        cfg = apply_runtime_overrides(exp.cfg, jax_runtime, tracking)
        try:
            run_pipe = pipe.with_config(cfg)  # same addresses: shared, not recomputed
        except ValueError:
            raise dg.Failure("runtime overrides changed the run's fingerprint") from None
        if training.validate_mode() == "pipes":
            res, extra = yield from _train_with_pipes(context, run_pipe, fp, cfg, store, training, jax_runtime)
        else:
            res, extra = yield from _train_in_process(context, run_pipe, fp, training.poll_seconds)
        _log(context, res)
        yield _result(res, METADATA["train_ckpt"](res, extra))

    return train_ckpt


def _checkpoint_eval_asset(exp: Experiment):
    """``checkpoint_eval``: the eval_report stage of one checkpoint partition (any run)."""
    base = exp.pipeline()

    @dg.asset(key="checkpoint_eval", deps=["train_ckpt"], partitions_def=CHECKPOINTS, group_name=EVAL_GROUP,
              code_version=base.own_version("eval_report"), kinds={base.stage("eval_report").kind},
              description="The evaluation report of one training checkpoint (partition <run>-step<N>), "
                          "requested by new_checkpoint_sensor as checkpoints land.")
    def checkpoint_eval(context: dg.AssetExecutionContext, store: ArtifactStoreResource) -> dg.MaterializeResult:
        key = context.partition_key
        path = find_checkpoint(context.instance, key, store, tags=context.run.tags)
        pipe = _checkpoint_pipeline(path, store, eval_config=base.eval_config)
        res = pipe.eval_report(checkpoint=path)
        _log(context, res)
        meta = METADATA["eval_report"](res)
        meta["run_fingerprint"] = dg.MetadataValue.text(parse_checkpoint_key(key)[0])
        return _result(res, meta)

    return checkpoint_eval


def _checkpoint_pipeline(checkpoint: str, store: ArtifactStoreResource, *, eval_config=None):
    """A pipeline for the run a checkpoint belongs to (its saved config, this store)."""
    import dataclasses

    from lm_pipeline.config import load_config
    from lm_pipeline.steps import Pipeline

    cfg = load_config(os.path.join(checkpoint, "config.yaml"))
    cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, root=store.root))  # not semantic
    return Pipeline(cfg, store.store(), progress=False, eval_config=eval_config)


def find_checkpoint(instance: dg.DagsterInstance, key: str, store: ArtifactStoreResource,
                    tags: Mapping[str, str] | None = None) -> str:
    """The checkpoint directory of a ``checkpoints`` partition key: the run's tag, else the
    ``train_ckpt`` observation that reported it, else the run's default place in the store."""
    from lm_pipeline.train.checkpoint import latest_checkpoint

    candidates = []
    if tags and tags.get(CHECKPOINT_TAG):
        candidates.append(tags[CHECKPOINT_TAG])
    records = instance.fetch_observations(dg.AssetKey("train_ckpt"), limit=1000).records
    for rec in records:
        obs = rec.asset_observation
        meta = obs.metadata if obs is not None else {}
        if meta.get("checkpoint_key") is not None and meta["checkpoint_key"].value == key:
            candidates.append(str(meta["checkpoint_path"].value))
            break
    fp, step = parse_checkpoint_key(key)
    candidates.append(f"{store.root}/train_ckpt/{fp}/step-{step}")
    for path in candidates:
        if latest_checkpoint(path) is not None:  # candidates are step dirs: complete or not
            return path
    raise dg.Failure(f"checkpoint {key}: no complete checkpoint found (looked at {candidates}); "
                     "a temporary checkpoint may have been pruned")


# --------------------------------------------------------------------------------------------
# sensor and schedule
# --------------------------------------------------------------------------------------------


def checkpoint_requests(instance: dg.DagsterInstance, cursor: str | None, *, limit: int = 500,
                        kinds: tuple[str, ...] = ("permanent",)) -> dg.SensorResult:
    """One run request per newly reported complete checkpoint (``train_ckpt`` observations after
    the cursor), each exactly once: its partition key is added to ``checkpoints`` and used as the
    run key, and keys that already exist are skipped."""
    after = int(cursor) if cursor else None
    result = instance.fetch_observations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("train_ckpt"), after_storage_id=after), limit=limit, ascending=True)
    requests: list[dg.RunRequest] = []
    new_keys: list[str] = []
    last = after
    for rec in result.records:
        last = rec.storage_id
        obs = rec.asset_observation
        meta = obs.metadata if obs is not None else {}
        if meta.get("checkpoint_key") is None or meta.get("checkpoint_path") is None:
            continue
        key = str(meta["checkpoint_key"].value)
        kind = str(meta["kind"].value) if meta.get("kind") is not None else "permanent"
        if kind not in kinds or key in new_keys or instance.has_dynamic_partition(CHECKPOINTS.name, key):
            continue
        new_keys.append(key)
        requests.append(dg.RunRequest(run_key=key, partition_key=key,
                                      tags={CHECKPOINT_TAG: str(meta["checkpoint_path"].value)}))
    return dg.SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=[CHECKPOINTS.build_add_request(new_keys)] if new_keys else [],
        cursor=str(last) if last is not None else cursor,
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


def build_automation(eval_job) -> tuple[list, list]:
    @dg.sensor(name="new_checkpoint_sensor", target=eval_job, minimum_interval_seconds=30,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Requests checkpoint_eval for each new complete (permanent) checkpoint reported by "
                           "train_ckpt, exactly once, also while the run is still training.")
    def new_checkpoint_sensor(context: dg.SensorEvaluationContext):
        return checkpoint_requests(context.instance, context.cursor)

    @dg.schedule(name="reevaluate_latest_checkpoints", cron_schedule="0 3 * * *", target=eval_job,
                 default_status=dg.DefaultScheduleStatus.STOPPED,
                 description="Re-evaluates the latest checkpoint of the most recent runs (a cache hit unless the "
                             "evaluation settings or code changed).")
    def reevaluate_latest_checkpoints(context: dg.ScheduleEvaluationContext):
        keys = latest_checkpoint_keys(list(context.instance.get_dynamic_partitions(CHECKPOINTS.name)))
        if not keys:
            return dg.SkipReason("no checkpoint has been reported yet")
        return [dg.RunRequest(partition_key=k, tags={"lm_pipeline/reason": "scheduled re-evaluation"}) for k in keys]

    return [new_checkpoint_sensor], [reevaluate_latest_checkpoints]


# --------------------------------------------------------------------------------------------
# definitions
# --------------------------------------------------------------------------------------------


def default_resources(exp: Experiment) -> dict[str, Any]:
    return {
        "store": ArtifactStoreResource(root=exp.store_root),
        "training": TrainingLauncherResource.from_env(),
        "jax_runtime": JaxRuntimeResource(),
        "tracking": TrackingResource(),
    }


def default_executor(preload: tuple[str, ...] = ("assets._preload", "assets.definitions")):
    """Multiprocess (shard groups tokenize in parallel) with a forkserver that has imported the
    definitions and Dagster's storage layer once, so each step process starts quickly."""
    return dg.multiprocess_executor.configured(
        {"start_method": {"forkserver": {"preload_modules": list(preload)}}}, name="lm_pipeline_multiprocess")


def build_definitions(experiment: Experiment | None = None, *, resources: Mapping[str, Any] | None = None,
                      executor: Any = "default") -> dg.Definitions:
    """The Definitions of one experiment (by default the one named by the environment)."""
    exp = experiment or load_experiment()
    assets = build_assets(exp)
    pipeline_job = dg.define_asset_job(PIPELINE_JOB, selection=dg.AssetSelection.groups(GROUP),
                                       description="Materialize the six lineage assets of the experiment.")
    eval_job = dg.define_asset_job(EVAL_JOB, selection=dg.AssetSelection.assets("checkpoint_eval"),
                                   partitions_def=CHECKPOINTS, description="Evaluate training checkpoints.")
    sensors, schedules = build_automation(eval_job)
    res = {**default_resources(exp), **(resources or {})}
    return dg.Definitions(
        assets=assets, jobs=[pipeline_job, eval_job], sensors=sensors, schedules=schedules, resources=res,
        executor=default_executor() if executor == "default" else executor,
    )
