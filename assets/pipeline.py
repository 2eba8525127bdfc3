"""The deployment as Dagster software-defined assets: every experiment, shared stages merged.

Each experiment (a file of ``configs/experiments/``) has the lineage::

    data_sources -> raw_shards -> tokenizer -> token_cache -> train_ckpt -> eval_report, hf_export

and stages that experiments share are one asset (``shared/<stage>``; keys and sharing:
:mod:`assets.deployment`). Besides: ``<experiment>/checkpoint_eval`` (one dynamic partition per
training checkpoint, requested by ``new_checkpoint_sensor`` and re-run by the
``reevaluate_<experiment>`` schedules) and ``experiments/comparison`` (every experiment's
evaluation side by side, refreshed by ``comparison_sensor`` when an evaluation lands).

Every asset is a thin shell around :class:`lm_pipeline.steps.Pipeline`: it computes its
fingerprint from the data as it is now, returns at once on a cache hit (a complete artifact at
``<store>/<stage>/<fingerprint>/``), else calls the core. Its ``data_version`` is the fingerprint;
its ``code_version`` is :meth:`Pipeline.config_version` (the semantic config of the stage and of
every stage before it), so a config edit marks exactly the assets whose artifacts it changes as
stale, and ``data_sources`` (observed: the shards' content) marks every stage stale when the data
changes. What Dagster records is what was used: before building, each asset checks that the
latest materialization of each upstream asset is the artifact it reads (else it fails, naming
what to materialize first) and records the current observation of its data; its metadata holds
the experiment, the semantic config and the input fingerprints of *that* artifact.

``token_cache`` is a graph: a plan op fans out one op per shard group (dynamic outputs; run in
parallel by the multiprocess executor), a commit op assembles and commits the cache; with the
``tokenizing`` resource in ``ray`` mode the commit op runs the groups as Ray tasks instead.
``train_ckpt`` runs through the ``training`` resource -- by default its own process through
Dagster Pipes; in ``ray`` mode one Ray job on a cluster, N processes of one ``jax.distributed``
run (docs/cluster.md) -- reports each checkpoint as an observation as it lands, is retried by a
``RetryPolicy`` (a retry resumes from the run's latest checkpoint) and runs in the
``lm_pipeline_training`` pool; evaluations run in the ``lm_pipeline_evaluation`` pool. Each step
first records its run's process and frees the pool slots of runs whose process is gone
(:mod:`assets.dead_runs`).
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
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import dagster as dg

from assets import comparison as cmp
from assets import metadata as md
from assets.dead_runs import tend
from assets.deployment import COMPARISON_GROUP, COMPARISON_KEY, Deployment, Node
from assets.experiment import Experiment, load_experiments
from lm_pipeline.steps import STAGE_NAMES
from resources import (
    ArtifactStoreResource,
    JaxRuntimeResource,
    TokenizingResource,
    TrackingResource,
    TrainingLauncherResource,
    apply_runtime_overrides,
)

PIPELINE_JOB = "pipeline"
COMPARE_JOB = "compare_experiments"
OBSERVE_JOB = "observe_data_sources"
LINEAGE = STAGE_NAMES
CHECKPOINT_TAG = "lm_pipeline/checkpoint"
EXPERIMENT_TAG = "lm_pipeline/experiment"
TRAIN_RETRIES = 2
TRAINING_POOL = "lm_pipeline_training"
EVALUATION_POOL = "lm_pipeline_evaluation"


def eval_job_name(experiment: str) -> str:
    """The job that evaluates checkpoints of ``experiment`` (one partition per checkpoint)."""
    return f"evaluate_{experiment}"


def experiment_job_name(experiment: str) -> str:
    """The job that materializes one experiment's lineage (its data source observed first)."""
    return f"pipeline_{experiment}"


def checkpoints_partitions(experiment: str) -> dg.DynamicPartitionsDefinition:
    """The checkpoints of ``experiment`` (keys ``<train fingerprint>-step<N>``)."""
    return dg.DynamicPartitionsDefinition(name=f"checkpoints_{experiment}")

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


def _require_trained(pipe, key: dg.AssetKey):
    """The checkpoint readers never train: training runs only through the training asset ``key``."""
    if pipe.cached("train_ckpt") is None:
        fp = pipe.address("train_ckpt").fingerprint
        raise dg.Failure(f"train_ckpt {fp} is not materialized yet; materialize {key.to_user_string()} first "
                         f"(e.g. --select '*{key.to_user_string()}' or the 'pipeline' job)", allow_retries=False)
    return pipe


def _log(context, res) -> None:
    if res.hit:
        context.log.info(f"{res.stage} {res.fingerprint}: cache hit, no work ({res.path})")
    else:
        context.log.info(f"{res.stage} {res.fingerprint}: built in {res.seconds:.1f}s at {res.path}")


def _observation(asset: dg.AssetKey, c: Mapping[str, Any], run_fingerprint: str) -> dg.AssetObservation:
    key = checkpoint_key(run_fingerprint, int(c["step"]))
    return dg.AssetObservation(asset_key=asset, metadata=md.checkpoint_observation(
        c, run_fingerprint=run_fingerprint, partition_key=key))


# --------------------------------------------------------------------------------------------
# training: in this process, its own process through Pipes, or a Ray job through Pipes
# --------------------------------------------------------------------------------------------


def _train_in_process(context, asset: dg.AssetKey, pipe, fp: str, poll: float) -> Iterator[Any]:
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
                yield _observation(asset, c, fp)
            if done:
                break
        res = fut.result()
    for c in watcher.poll():
        yield _observation(asset, c, fp)
    return res, {}


def _train_with_pipes(context, asset: dg.AssetKey, pipe, fp: str, cfg, store: ArtifactStoreResource, training: TrainingLauncherResource,
                      jax_runtime: JaxRuntimeResource) -> Iterator[Any]:
    from lm_pipeline.config import dump_config

    extras = {"config": dump_config(cfg), "store_root": store.root, "expected_fingerprint": fp,
              "asset_key": asset.to_user_string(),
              "poll_seconds": training.poll_seconds, "attempt": context.retry_number}
    drain = _checkpoint_drain(asset, fp)
    t0 = time.perf_counter()

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
    return _reported_result(session, pipe, fp, t0)


def _checkpoint_drain(asset: dg.AssetKey, fp: str):
    """A function yielding, for a Pipes session, the checkpoint observations not yet yielded."""
    seen = 0

    def drain(session) -> Iterator[dg.AssetObservation]:
        nonlocal seen
        msgs = session.get_custom_messages()
        for m in msgs[seen:]:
            if isinstance(m, Mapping) and m.get("type") == "checkpoint":
                yield _observation(asset, m, str(m.get("run_fingerprint") or fp))
        seen = len(msgs)

    return drain


def _reported_result(session, pipe, fp: str, t0: float):
    """(the stage result, the training process's metadata) from a finished Pipes session."""
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


def _train_on_ray(context, asset: dg.AssetKey, pipe, fp: str, cfg, store: ArtifactStoreResource,
                  training: TrainingLauncherResource, jax_runtime: JaxRuntimeResource) -> Iterator[Any]:
    """One Ray job (``python -m lm_pipeline.cluster.ray_train`` on the cluster) running the run as
    ``ray_num_processes`` processes of one ``jax.distributed`` job. Pipes context goes in the job's
    environment; messages come back in the job's log, tailed by dagster-ray's
    ``PipesRayJobMessageReader`` (as its ``PipesRayJobClient`` does; here the step also polls, to
    report each checkpoint as it lands). A failed job fails the step, and the retry resumes."""
    from dagster_ray.core.pipes import (
        PIPES_LAUNCHED_EXTRAS_RAY_ADDRESS_KEY,
        PIPES_LAUNCHED_EXTRAS_RAY_JOB_ID_KEY,
        PipesRayJobMessageReader,
    )
    from ray.job_submission import JobStatus

    from lm_pipeline.config import dump_config

    spec = training.ray_spec()
    client = training.ray_job_client()  # unreachable: one line, before anything runs
    _stop_earlier_jobs(context, client, fp)
    extras = {"config": dump_config(cfg), "store_root": store.root, "expected_fingerprint": fp,
              "asset_key": asset.to_user_string(), "poll_seconds": training.poll_seconds,
              "attempt": context.retry_number, "ray": spec.to_dict()}
    drain = _checkpoint_drain(asset, fp)
    t0 = time.perf_counter()
    job_id = f"lm-pipeline-train-{fp}-{context.run_id[:8]}-{context.retry_number}-{os.urandom(3).hex()}"
    stack = contextlib.ExitStack()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*expected_writer_count")
        session = stack.enter_context(dg.open_pipes_session(
            context=context, context_injector=dg.PipesEnvContextInjector(),
            message_reader=PipesRayJobMessageReader(), extras=extras))
    with stack:
        env = {**jax_runtime.env(), "PYTHONUNBUFFERED": "1", **session.get_bootstrap_env_vars()}
        client.submit_job(entrypoint=training.ray_entrypoint(), submission_id=job_id, entrypoint_num_cpus=0,
                          runtime_env=training.ray_job_runtime_env(env),
                          metadata={"dagster_run_id": context.run_id, "dagster_asset": asset.to_user_string(),
                                    "train_ckpt": fp, "attempt": str(context.retry_number)})
        session.report_launched({"extras": {PIPES_LAUNCHED_EXTRAS_RAY_JOB_ID_KEY: job_id,
                                            PIPES_LAUNCHED_EXTRAS_RAY_ADDRESS_KEY: client.get_address()}})
        context.log.info(f"train_ckpt {fp}: Ray job {job_id} submitted to {client.get_address()} "
                         f"({spec.num_processes} processes x {spec.bundle()}, {spec.placement_strategy})")
        try:
            while True:
                status = client.get_job_status(job_id)
                yield from drain(session)
                if status.is_terminal():
                    break
                time.sleep(training.poll_seconds)
        except BaseException:  # interrupted or terminated: stop the job too
            with contextlib.suppress(Exception):
                client.stop_job(job_id)
            raise
    yield from drain(session)
    if status != JobStatus.SUCCEEDED:
        raise dg.Failure(f"Ray job {job_id} {status.value}: {_ray_job_reason(client, job_id)}; a retry resumes from "
                         "the latest checkpoint", allow_retries=True)
    res, child = _reported_result(session, pipe, fp, t0)
    child["ray_job_id"] = dg.MetadataValue.text(job_id)
    return res, child


def _stop_earlier_jobs(context, client, fp: str, timeout: float = 120.0) -> None:
    """Stop any job of this run still on the cluster (an attempt whose Dagster process died
    without stopping it): two jobs must never write one run's checkpoints."""
    try:
        stale = [j for j in client.list_jobs()
                 if (j.metadata or {}).get("train_ckpt") == fp and not j.status.is_terminal()]
    except Exception as e:  # listing is a precaution; the submission below reports real trouble
        context.log.warning(f"could not list the cluster's jobs: {e}")
        return
    for job in stale:
        context.log.warning(f"stopping Ray job {job.submission_id}: an earlier attempt at train_ckpt {fp}, still running")
        client.stop_job(job.submission_id)
    deadline = time.monotonic() + timeout
    for job in stale:
        while not client.get_job_status(job.submission_id).is_terminal():
            if time.monotonic() > deadline:
                raise dg.Failure(f"Ray job {job.submission_id} (an earlier attempt at train_ckpt {fp}) did not stop "
                                 f"within {timeout:.0f} s", allow_retries=True)
            time.sleep(1.0)


def _ray_job_reason(client, job_id: str) -> str:
    """Why a Ray job failed, in one line: the driver's own last word, else Ray's message."""
    try:
        lines = client.get_job_logs(job_id).splitlines()
        said = [ln.split(": ", 1)[1] for ln in lines if ln.startswith("lm_pipeline.cluster.ray_train: ")]
        if said:
            return said[-1]
        message = (client.get_job_info(job_id).message or "").strip().splitlines()
        return message[-1] if message else "no message"
    except Exception as e:  # the reason is a courtesy; the failure stands
        return f"(reason unavailable: {e})"


# --------------------------------------------------------------------------------------------
# the assets
# --------------------------------------------------------------------------------------------


#: What each stage's materialization shows in the UI (assets/metadata.py), by stage.
METADATA = {"raw_shards": md.raw_shards, "tokenizer": md.tokenizer, "token_cache": md.token_cache,
            "train_ckpt": md.train_ckpt, "eval_report": md.eval_report, "hf_export": md.hf_export}


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def source_version(pipe) -> tuple[str, dict[str, Any]]:
    """The data version of an experiment's source data: a hash of every shard's fingerprint (file
    shards: their bytes; Hugging Face datasets: their own fingerprint or pinned revision), and the
    per-shard fingerprints it covers. Reads the data as it is now."""
    import hashlib

    shards = dict(sorted(pipe.address("raw_shards").inputs.items()))
    return hashlib.sha256(json.dumps(shards, sort_keys=True).encode()).hexdigest()[:16], shards


def _latest_version(instance: dg.DagsterInstance, key: dg.AssetKey) -> str | None:
    """The data version Dagster holds for ``key`` now (its latest materialization or observation)."""
    rec = instance.get_latest_data_version_record(key)
    if rec is None:
        return None
    event = rec.asset_materialization or rec.asset_observation
    return (event.tags or {}).get("dagster/data_version") if event is not None else None


def _verify_inputs(context, dep: Deployment, node: Node, pipe, *, record: bool = True) -> dict[str, str]:
    """Make what Dagster records about this asset's inputs true before it builds.

    The data source: its current version is recorded as an observation when Dagster's latest one
    differs (the data changed since it was last observed), so the materialization's provenance
    names the data actually read. Upstream stages: the latest materialization of each upstream
    asset must be the artifact this stage reads (Dagster records that one as the input), else the
    step fails in one line naming what to materialize first -- also when the artifact is complete
    in the store (built from the command line, or before a reverted edit): materializing it is
    then a cache hit. Returns the input fingerprints used, by upstream stage."""
    instance = context.instance
    src = dep.source_key(node.owner.name)
    version, shards = source_version(pipe)
    if record and _latest_version(instance, src) != version:
        context.log_event(dg.AssetObservation(asset_key=src, tags={"dagster/data_version": version},
                                              metadata={"shards": len(shards), "observed_by": "stage " + node.stage}))
    used: dict[str, str] = {}
    for up in pipe.stage(node.stage).upstream:
        key = dep.key(node.owner.name, up)
        want = pipe.address(up).fingerprint
        used[up] = want
        if _latest_version(instance, key) == want:
            continue
        what, me = key.to_user_string(), node.key.to_user_string()
        state = ("complete in the store (a cache hit) but not recorded by Dagster" if pipe.cached(up) is not None
                 else "not built")
        raise dg.Failure(f"{me} reads {up} {want}, which is {state}: materialize {what} first (e.g. --select "
                         f"'*{me}' for it and everything upstream, or the '{experiment_job_name(node.owner.name)}' "
                         "job)", allow_retries=False)
    return used


def _provenance(dep: Deployment, node: Node, pipe, used: Mapping[str, str]) -> dict[str, Any]:
    """The metadata that says what this artifact is: experiments, config, inputs."""
    return {
        "experiments": dg.MetadataValue.text(", ".join(node.names)),
        "experiment_files": dg.MetadataValue.json({e.name: e.describe() for e in node.experiments}),
        "semantic_config": dg.MetadataValue.json(_json(pipe.stage_config(node.stage))),
        "input_fingerprints": dg.MetadataValue.json({**used, "data_sources": source_version(pipe)[0]}),
    }


def _lineage(store, res) -> dict[str, Any]:
    """The artifact's chain back to its shards (``lm-pipeline lineage``), shown on the asset's page."""
    from lm_pipeline.steps.lineage import format_lineage, lineage

    try:
        steps = lineage(store, res.stage, res.fingerprint)
    except Exception as e:  # never fail a built artifact over its description
        return {"lineage": dg.MetadataValue.text(f"unavailable: {e}")}
    return {"lineage": dg.MetadataValue.md("```\n" + format_lineage(steps) + "\n```"),
            "lineage_command": dg.MetadataValue.text(f"lm-pipeline lineage {res.path}")}


def _run_pipe(exp: Experiment, store: ArtifactStoreResource):
    return exp.fresh_pipeline(store.store())


def build_assets(dep: Deployment) -> list:
    """The assets of the deployment: the data sources, one asset per stage node (shared ones
    once), each experiment's ``checkpoint_eval`` and the comparison."""
    special = {"token_cache": _token_cache_asset, "train_ckpt": _train_ckpt_asset}
    assets: list = [_source_asset(dep, key, node) for key, node in dep.sources.items()]
    for node in dep.nodes():
        base = node.owner.pipeline()
        stage = base.stage(node.stage)
        spec = {"group_name": node.group, "code_version": node.version, "kinds": {stage.kind},
                "description": stage.description + (f" Shared by {', '.join(node.names)}." if node.shared else ""),
                "tags": {f"experiment/{n}": "" for n in node.names},
                "metadata": {"experiments": dg.MetadataValue.text(", ".join(node.names)),
                             "semantic_config": dg.MetadataValue.json(_json(base.stage_config(stage.name))),
                             "fingerprint_inputs": dg.MetadataValue.text(
                                 ", ".join(base.input_stages(stage.name)) or "the data's content")}}
        assets.append(special.get(stage.name, _stage_asset)(dep, node, spec))
    assets += [_checkpoint_eval_asset(dep, name) for name in dep.experiments]
    assets.append(_comparison_asset(dep))
    return assets


def _source_asset(dep: Deployment, key: dg.AssetKey, raw: Node):
    """The source data under ``raw``: observed (data version = a hash of the shards' content)."""

    @dg.observable_source_asset(key=key, group_name=raw.group,
                                description="The source data (shards) of " + ", ".join(raw.names) + ": its data "
                                            "version hashes every shard's content, so an edit marks every stage "
                                            "built from it stale. Observed by data_sources_sensor and each run.")
    def _observe(context, store: ArtifactStoreResource) -> dg.ObserveResult:
        tend(context)
        version, shards = source_version(_run_pipe(raw.owner, store))
        return dg.ObserveResult(data_version=dg.DataVersion(version), metadata={
            "shards": dg.MetadataValue.int(len(shards)),
            "shard_fingerprints": dg.MetadataValue.json(shards)})

    return _observe


def _stage_asset(dep: Deployment, node: Node, spec: dict[str, Any]):
    """A stage as one asset: build it (a hit does no work); checkpoint readers never train."""
    pool = EVALUATION_POOL if node.stage == "eval_report" else None

    @dg.asset(key=node.key, deps=node.deps, pool=pool, **spec)
    def _asset(context: dg.AssetExecutionContext, store: ArtifactStoreResource) -> dg.MaterializeResult:
        tend(context)
        pipe = _run_pipe(node.owner, store)
        if pipe.stage(node.stage).per_checkpoint:
            _require_trained(pipe, dep.key(node.owner.name, "train_ckpt"))
        used = _verify_inputs(context, dep, node, pipe)
        res = pipe.build(node.stage)
        _log(context, res)
        return _result(res, {**METADATA[node.stage](res), **_provenance(dep, node, pipe, used), **_lineage(pipe.store, res)})

    return _asset


def _token_cache_asset(dep: Deployment, node: Node, spec: dict[str, Any]):
    """``token_cache`` as a graph: a plan op fans out one op per shard group, a commit op joins them."""
    from lm_pipeline.steps import CacheGroup

    exp = node.owner
    prefix = node.key.to_python_identifier()
    ins = {f"in_{i}": dk for i, dk in enumerate(node.deps)}

    @dg.op(name=f"{prefix}_plan", ins={n: dg.In(dg.Nothing) for n in ins},
           out=dg.DynamicOut(dict), description="Hit: nothing to do. Miss: one output per shard group.")
    def token_cache_plan(context: dg.OpExecutionContext, store: ArtifactStoreResource, tokenizing: TokenizingResource):
        tend(context)
        mode = tokenizing.validate()  # a bad setting fails here, in one line, before any work
        pipe = _run_pipe(exp, store)
        _verify_inputs(context, dep, node, pipe, record=False)  # before any shard is tokenized
        hit = pipe.cached("token_cache")
        if hit is not None:
            context.log.info(f"token_cache {hit.fingerprint}: cache hit, no shard group to tokenize")
            return
        if mode == "ray":
            context.log.info(f"token_cache {pipe.address('token_cache').fingerprint}: the shard groups are tokenized "
                             "as Ray tasks by the commit op")
            return
        groups = pipe.token_cache_groups()
        context.log.info(f"token_cache {pipe.address('token_cache').fingerprint}: {len(groups)} shard groups to tokenize")
        for g in groups:
            yield dg.DynamicOutput(g.to_dict(), mapping_key=g.key)

    @dg.op(name=f"{prefix}_group", description="Tokenize one shard group into its part of the cache.")
    def token_cache_group(context: dg.OpExecutionContext, group: dict, store: ArtifactStoreResource) -> dict:
        info = _run_pipe(exp, store).token_cache_part(CacheGroup.from_dict(group))
        context.log.info(f"group {info['group']}: {info.get('num_docs')} docs, {info.get('num_tokens')} tokens "
                         f"in {info['seconds']:.1f}s")
        return info

    @dg.op(name=f"{prefix}_commit", out=dg.Out(dg.Nothing),
           description="Assemble the groups' parts into the token cache and commit it (a hit if complete).")
    def token_cache_commit(context: dg.OpExecutionContext, parts: list, store: ArtifactStoreResource,
                           tokenizing: TokenizingResource):
        pipe = _run_pipe(exp, store)
        used = _verify_inputs(context, dep, node, pipe)
        if tokenizing.validate() == "ray":  # one Ray task per shard group, then the same commit
            res = tokenizing.build_on_ray(pipe, log=context.log.info)
            tokenized = 0 if res.hit else int(res.manifest.get("parts_built", 0))
        else:
            res = pipe.token_cache_commit(parts)
            tokenized = len(parts)
        _log(context, res)
        meta = {**METADATA["token_cache"](res), **_provenance(dep, node, pipe, used), **_lineage(pipe.store, res)}
        meta["groups_tokenized_in_this_run"] = dg.MetadataValue.int(tokenized)
        with warnings.catch_warnings():  # Output(data_version=...) is marked beta
            warnings.simplefilter("ignore")
            return dg.Output(None, data_version=dg.DataVersion(res.fingerprint), metadata=meta)

    spec = {**spec, "description": spec["description"].replace("cache.", "cache, fanned out over shard groups.", 1)}

    @dg.graph_asset(key=node.key, ins={n: dg.AssetIn(dk, dagster_type=dg.Nothing) for n, dk in ins.items()}, **spec)
    def token_cache(**inputs):
        groups = token_cache_plan(**inputs)
        return token_cache_commit(groups.map(token_cache_group).collect())

    return token_cache


def _train_ckpt_asset(dep: Deployment, node: Node, spec: dict[str, Any]):
    """``train_ckpt``: through the ``training`` resource (Pipes or in-process), retried, in the
    training pool; each checkpoint is reported as an observation as it lands."""
    exp = node.owner
    spec = {**spec, "description": spec["description"] + " Each checkpoint is reported as an observation "
                                                          "as it lands."}

    @dg.asset(key=node.key, deps=node.deps, retry_policy=dg.RetryPolicy(max_retries=TRAIN_RETRIES, delay=2),
              pool=TRAINING_POOL, **spec)
    def train_ckpt(context: dg.AssetExecutionContext, store: ArtifactStoreResource, training: TrainingLauncherResource,
                   jax_runtime: JaxRuntimeResource, tracking: TrackingResource):
        tend(context)
        mode = training.validate_mode()  # a bad launcher setting fails here, in one line, before any work
        pipe = _run_pipe(exp, store)
        fp = pipe.address("train_ckpt").fingerprint
        used = _verify_inputs(context, dep, node, pipe)
        hit = pipe.cached("train_ckpt")
        if hit is not None:
            _log(context, hit)
            yield _result(hit, {**METADATA["train_ckpt"](hit), **_provenance(dep, node, pipe, used), **_lineage(pipe.store, hit)})
            return
        if context.retry_number:
            from lm_pipeline.train.checkpoint import latest_checkpoint

            context.log.info(f"attempt {context.retry_number + 1}: resuming from {latest_checkpoint(pipe.run_dir())}")
        cfg = apply_runtime_overrides(exp.cfg, jax_runtime, tracking)
        try:
            run_pipe = pipe.with_config(cfg)  # same addresses: shared, not recomputed
        except ValueError:
            raise dg.Failure("runtime overrides changed the run's fingerprint") from None
        if mode == "pipes":
            res, extra = yield from _train_with_pipes(context, node.key, run_pipe, fp, cfg, store, training, jax_runtime)
        elif mode == "ray":
            res, extra = yield from _train_on_ray(context, node.key, run_pipe, fp, cfg, store, training, jax_runtime)
        else:
            res, extra = yield from _train_in_process(context, node.key, run_pipe, fp, training.poll_seconds)
        _log(context, res)
        yield _result(res, {**METADATA["train_ckpt"](res, extra), **_provenance(dep, node, pipe, used), **_lineage(pipe.store, res)})

    return train_ckpt


def _checkpoint_eval_asset(dep: Deployment, name: str):
    """``<experiment>/checkpoint_eval``: the experiment's evaluation of one checkpoint partition."""
    exp = dep.experiments[name]
    base = exp.pipeline()
    train_key = dep.key(name, "train_ckpt")

    @dg.asset(key=dep.checkpoint_eval_key(name), deps=[train_key], partitions_def=checkpoints_partitions(name),
              group_name=name, code_version=base.own_version("eval_report"), kinds={base.stage("eval_report").kind},
              pool=EVALUATION_POOL,
              description=f"The evaluation report ({name}'s eval settings) of one checkpoint of {train_key.to_user_string()} "
                          "(partition <run>-step<N>), requested by new_checkpoint_sensor as checkpoints land.")
    def checkpoint_eval(context: dg.AssetExecutionContext, store: ArtifactStoreResource) -> dg.MaterializeResult:
        tend(context)
        key = context.partition_key
        path = find_checkpoint(context.instance, key, store, tags=context.run.tags, asset=train_key)
        pipe = _checkpoint_pipeline(path, store, eval_config=base.eval_config)
        res = pipe.eval_report(checkpoint=path)
        _log(context, res)
        meta = METADATA["eval_report"](res)
        meta["run_fingerprint"] = dg.MetadataValue.text(parse_checkpoint_key(key)[0])
        meta["experiment"] = dg.MetadataValue.text(name)
        meta["eval_config"] = dg.MetadataValue.json(_json(pipe.stage_config("eval_report")))
        return _result(res, meta)

    return checkpoint_eval


def _comparison_asset(dep: Deployment):
    evals = sorted({dep.key(n, "eval_report") for n in dep.experiments}, key=lambda k: k.to_user_string())

    @dg.asset(key=COMPARISON_KEY, deps=evals, group_name=COMPARISON_GROUP, kinds={"pandas"},
              description="Every experiment's final evaluation side by side (loss, bits per byte vs the unigram "
                          "baseline, parameters, training tokens and wall time): a table and a plot. Refreshed by "
                          "comparison_sensor when an evaluation lands.")
    def comparison(context: dg.AssetExecutionContext, store: ArtifactStoreResource) -> dg.MaterializeResult:
        tend(context)
        artifacts = store.store()  # the deployment's one store (build_definitions checks it)
        rows = [cmp.experiment_row(name, exp.fresh_pipeline(artifacts)) for name, exp in dep.experiments.items()]
        fp, path, hit = cmp.write_comparison(artifacts, rows)
        context.log.info(f"comparison {fp}: {'cache hit' if hit else 'written'} at {path}")
        table = dg.MetadataValue.table(
            [dg.TableRecord({c: r[c] for c in cmp.COLUMNS}) for r in rows],
            schema=dg.TableSchema(columns=[dg.TableColumn(c, "string" if c in ("experiment", "model", "eval_report",
                                                                              "train_ckpt") else "float")
                                           for c in cmp.COLUMNS]))
        meta = {"path": dg.MetadataValue.path(path), "fingerprint": dg.MetadataValue.text(fp),
                "cache_hit": dg.MetadataValue.bool(hit), "experiments": dg.MetadataValue.int(len(rows)),
                "evaluated": dg.MetadataValue.int(sum(r["bpb"] is not None for r in rows)),
                "comparison": table, "comparison_md": dg.MetadataValue.md(cmp.markdown_table(rows))}
        if any(r["bpb"] is not None for r in rows):
            meta["plot"] = md._png_md("bits per byte by experiment", f"{path}/comparison.png")
        return dg.MaterializeResult(metadata=meta, data_version=dg.DataVersion(fp))

    return comparison


def _checkpoint_pipeline(checkpoint: str, store: ArtifactStoreResource, *, eval_config=None):
    """A pipeline for the run a checkpoint belongs to (its saved config, this store)."""
    import dataclasses

    from lm_pipeline.config import load_config
    from lm_pipeline.steps import Pipeline

    cfg = load_config(os.path.join(checkpoint, "config.yaml"))
    cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, root=store.root))  # not semantic
    return Pipeline(cfg, store.store(), progress=False, eval_config=eval_config)


def find_checkpoint(instance: dg.DagsterInstance, key: str, store: ArtifactStoreResource,
                    tags: Mapping[str, str] | None = None, asset: dg.AssetKey | str = "train_ckpt") -> str:
    """The checkpoint directory of a checkpoints partition key: the run's tag, else the
    observation of the training ``asset`` that reported it, else the run's default place in the store."""
    from lm_pipeline.train.checkpoint import latest_checkpoint

    candidates = []
    if tags and tags.get(CHECKPOINT_TAG):
        candidates.append(tags[CHECKPOINT_TAG])
    records = instance.fetch_observations(dg.AssetKey.from_coercible(asset), limit=1000).records
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
# sensors and schedule
# --------------------------------------------------------------------------------------------


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


def reevaluation_schedule_name(experiment: str) -> str:
    return f"reevaluate_{experiment}"


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


def comparison_request(instance: dg.DagsterInstance, dep: Deployment, cursor: str | None) -> dg.SensorResult:
    """A run of the comparison when any experiment's evaluation (final or per checkpoint) has a new
    materialization since the cursor (the newest storage id seen)."""
    keys = sorted({dep.key(n, "eval_report") for n in dep.experiments} | {dep.checkpoint_eval_key(n) for n in dep.experiments},
                  key=lambda k: k.to_user_string())
    after = int(cursor) if cursor else 0
    newest = after
    for key in keys:
        recs = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key, after_storage_id=after or None),
                                               limit=1, ascending=False).records
        if recs:
            newest = max(newest, recs[0].storage_id)
    if newest == after:
        return dg.SensorResult(skip_reason="no new evaluation since the last comparison", cursor=cursor)
    return dg.SensorResult(run_requests=[dg.RunRequest(run_key=f"comparison@{newest}")], cursor=str(newest))


def build_automation(dep: Deployment, eval_jobs: Mapping[str, Any], compare_job, observe_job) -> tuple[list, list]:
    train_keys = dep.train_keys()

    @dg.sensor(name="new_checkpoint_sensor", jobs=list(eval_jobs.values()), minimum_interval_seconds=30,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Requests <experiment>/checkpoint_eval for each new complete (permanent) checkpoint "
                           "reported by a training asset, exactly once per experiment, also while it trains.")
    def new_checkpoint_sensor(context: dg.SensorEvaluationContext):
        return checkpoint_requests(context.instance, context.cursor, train_keys=train_keys)

    @dg.sensor(name="comparison_sensor", target=compare_job, minimum_interval_seconds=30,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Refreshes experiments/comparison when an evaluation lands.")
    def comparison_sensor(context: dg.SensorEvaluationContext):
        return comparison_request(context.instance, dep, context.cursor)

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

    return ([new_checkpoint_sensor, comparison_sensor],
            [observe_data_sources, *(reevaluate(name, job) for name, job in eval_jobs.items())])


# --------------------------------------------------------------------------------------------
# definitions
# --------------------------------------------------------------------------------------------


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
    """The data sources and lineage assets of ``experiments`` (default: all), shared ones once."""
    names = list(experiments) if experiments is not None else list(dep.experiments)
    keys: list[dg.AssetKey] = []
    for name in names:
        for k in (dep.source_key(name), *(dep.key(name, s) for s in dep.stages)):
            if k not in keys:
                keys.append(k)
    return keys


def build_definitions(experiments: Sequence[Experiment] | Experiment | None = None, *,
                      resources: Mapping[str, Any] | None = None, executor: Any = "default") -> dg.Definitions:
    """The Definitions of the deployment: every experiment (default: those of
    :func:`assets.experiment.load_experiments`), one store shared by them."""
    if isinstance(experiments, Experiment):
        experiments = [experiments]
    exps = list(experiments) if experiments is not None else load_experiments()
    roots = {e.store_root for e in exps}
    if len(roots) > 1:
        raise ValueError(f"the experiments of one deployment share one store; got roots {sorted(roots)} "
                         f"(set store.root alike in {', '.join(e.path for e in exps)})")
    dep = Deployment(exps)
    assets = build_assets(dep)
    pipeline_job = dg.define_asset_job(
        PIPELINE_JOB, selection=dg.AssetSelection.assets(*lineage_selection(dep), COMPARISON_KEY),
        description="Observe the data, materialize every experiment's six lineage assets (shared ones once) "
                    "and compare the experiments.")
    per_experiment = [dg.define_asset_job(experiment_job_name(n), selection=dg.AssetSelection.assets(*lineage_selection(dep, [n])),
                                          description=f"Observe the data and materialize the lineage of {n}.")
                      for n in dep.experiments]
    eval_jobs = {n: dg.define_asset_job(eval_job_name(n), selection=dg.AssetSelection.assets(dep.checkpoint_eval_key(n)),
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
