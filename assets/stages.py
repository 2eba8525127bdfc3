"""The asset factory: one asset per stage of each experiment, and its data sources.

Every stage asset is a thin shell around :class:`lm_pipeline.steps.Pipeline`, made fresh in the
step (addresses from the data as it is now): it checks its inputs (:mod:`assets.provenance`),
returns at once on a cache hit (a complete artifact at ``<store>/<stage>/<fingerprint>/``), else
calls the core, and returns the artifact's metadata (:mod:`assets.metadata`) with the fingerprint
as data version. Its ``code_version`` is the stage's config version (the semantic config of the
stage and of every stage before it), so a config edit marks exactly the assets whose artifacts it
changes as stale; each observable ``data_sources`` (a hash of the shards' content) marks every
stage built from it stale when the data changes.

Two stages are more than one op: ``token_cache`` is a graph (a plan op fans out one op per shard
group, run in parallel by the multiprocess executor, and a commit op assembles the cache; with the
``tokenizing`` resource in ``ray`` mode the commit op runs the groups as Ray tasks instead), and
``train_ckpt`` launches the training (:mod:`assets.launch`), is retried by a ``RetryPolicy`` (a
retry resumes from the run's latest checkpoint) and runs in the training pool. Evaluations run in
the evaluation pool. An artifact that several experiments share (same address) is built by
whichever asset runs first; the others' materializations are cache hits with the same data
version (for the fan-out, a group whose cache another run committed meanwhile is skipped).
Each step first records its run's process and frees the pool slots of runs whose process is
gone (:mod:`assets.dead_runs`).
"""

import warnings
from collections.abc import Mapping
from typing import Any

import dagster as dg

from assets import launch
from assets import metadata as md
from assets.dead_runs import tend
from assets.deployment import Deployment, Node
from assets.experiment import Experiment
from assets.mixture import component_cache_asset, mixture_metadata, node_pipeline
from assets.names import POOLS
from assets.provenance import lineage_metadata, provenance, source_version, verify_inputs, what_to_run
from resources import (
    ArtifactStoreResource,
    JaxRuntimeResource,
    TokenizingResource,
    TrackingResource,
    TrainingLauncherResource,
    apply_runtime_overrides,
)

#: How many times a failed training is retried (each retry resumes from the latest checkpoint).
TRAIN_RETRIES = 2


def stage_assets(dep: Deployment) -> list:
    """The data sources and one asset per stage of each experiment of ``dep``."""
    special = {"token_cache": _token_cache_asset, "train_ckpt": _train_ckpt_asset}
    assets: list = [_source_asset(key, node) for key, node in dep.sources.items()]
    for node in dep.nodes():
        base = node.owner.pipeline()
        stage = base.stage(node.stage)
        shared = [dep.key(n, node.stage).to_user_string() for n in node.shared_with]
        spec = {"group_name": node.group, "code_version": node.version, "kinds": {stage.kind},
                "description": stage.description + (
                    f" The same artifact as {', '.join(shared)} (same address: built once, a cache hit for the "
                    "other)." if shared else ""),
                # what varies with the other experiments is shown, never part of the key or the deps
                "tags": {f"experiment/{node.name}": "", **{f"shared_with/{n}": "" for n in node.shared_with}},
                "metadata": {"experiment": dg.MetadataValue.text(node.name),
                             "shared_with": dg.MetadataValue.text(", ".join(shared) or "none"),
                             "semantic_config": dg.MetadataValue.json(md.plain_json(base.stage_config(stage.name))),
                             "fingerprint_inputs": dg.MetadataValue.text(
                                 ", ".join(base.input_stages(stage.name)) or "the data's content")}}
        if stage.pool is not None:
            spec["pool"] = POOLS[stage.pool]
        if node.component is not None:  # a data mixture's component cache (assets/mixture.py)
            assets.append(component_cache_asset(dep, node, spec))
            continue
        if stage.name in ("token_cache", "train_ckpt"):  # the mixture's weights, where they are used
            spec["metadata"].update(mixture_metadata(base))
        assets.append(special.get(stage.name, _stage_asset)(dep, node, spec))
    return assets


def _run_pipe(exp: Experiment, store: ArtifactStoreResource):
    return exp.fresh_pipeline(store.store())


def _artifact_metadata(dep: Deployment, node: Node, pipe, used: Mapping[str, str], res, *extra) -> dict[str, Any]:
    """All a stage's materialization shows: the stage's own metadata, its provenance, its lineage."""
    shown = md.stage_metadata(pipe.stage(node.stage), res)
    for more in extra:  # what a launch adds (its process, its trackers): after the stage's own
        shown.update({k: v for k, v in more.items() if k not in shown})
    return {**shown, **provenance(dep, node, pipe, used), **lineage_metadata(pipe.store, res)}


def _require_trained(pipe, key: dg.AssetKey, me: dg.AssetKey):
    """The checkpoint readers never train: training runs only through the training asset ``key``."""
    if pipe.cached("train_ckpt") is None:
        fp = pipe.address("train_ckpt").fingerprint
        raise dg.Failure(f"{me.to_user_string()} reads train_ckpt {fp}, which is not built: {what_to_run(key, me)}",
                         allow_retries=False)
    return pipe


def _source_asset(key: dg.AssetKey, raw: Node):
    """The source data under ``raw``: observed (data version = a hash of the shards' content)."""
    with warnings.catch_warnings():  # observable_source_asset is marked beta: said once per load, on every command
        warnings.simplefilter("ignore", dg.BetaWarning)
        return _observable(key, raw)


def _observable(key: dg.AssetKey, raw: Node):
    @dg.observable_source_asset(key=key, group_name=raw.group,
                                description="The source data (shards) of " + raw.name + ": its data "
                                            "version hashes every shard's content, so an edit marks every stage "
                                            "built from it stale. Observed by data_sources_sensor and each run.")
    def _observe(context, store: ArtifactStoreResource) -> dg.ObserveResult:
        tend(context)
        version, shards = source_version(node_pipeline(raw, _run_pipe(raw.owner, store)))
        return dg.ObserveResult(data_version=dg.DataVersion(version), metadata={
            "shards": dg.MetadataValue.int(len(shards)),
            "shard_fingerprints": dg.MetadataValue.json(shards)})

    return _observe


def _stage_asset(dep: Deployment, node: Node, spec: dict[str, Any]):
    """A stage as one asset: build it (a hit does no work); checkpoint readers never train."""
    @dg.asset(key=node.key, deps=node.deps, **spec)
    def _asset(context: dg.AssetExecutionContext, store: ArtifactStoreResource) -> dg.MaterializeResult:
        tend(context)
        pipe = _run_pipe(node.owner, store)
        if pipe.stage(node.stage).per_checkpoint:
            _require_trained(pipe, dep.key(node.name, "train_ckpt"), node.key)
        used = verify_inputs(context, dep, node, pipe)
        res = pipe.build(node.stage)
        context.log.info(md.summary_line(res))
        return md.result(res, _artifact_metadata(dep, node, pipe, used, res))

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
        verify_inputs(context, dep, node, pipe, record=False)  # before any shard is tokenized
        hit = pipe.cached("token_cache")
        if hit is not None:
            context.log.info(f"token_cache {hit.fingerprint}: cache hit, no shard group to tokenize")
            return
        if pipe.components():
            context.log.info(f"token_cache {pipe.address('token_cache').fingerprint}: a mixture's index over its "
                             "components' caches (each its own asset), written by the commit op")
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
        pipe, g = _run_pipe(exp, store), CacheGroup.from_dict(group)
        if pipe.cached("token_cache") is not None:  # committed meanwhile (another experiment sharing it)
            context.log.info(f"group {g.key}: skipped, token_cache {pipe.address('token_cache').fingerprint} "
                             "is complete")
            return {"group": g.key, "skipped": True}
        info = pipe.token_cache_part(g)
        context.log.info(f"group {info['group']}: {info.get('num_docs')} docs, {info.get('num_tokens')} tokens "
                         f"in {info['seconds']:.1f}s")
        return info

    @dg.op(name=f"{prefix}_commit", out=dg.Out(dg.Nothing),
           description="Assemble the groups' parts into the token cache and commit it (a hit if complete).")
    def token_cache_commit(context: dg.OpExecutionContext, parts: list, store: ArtifactStoreResource,
                           tokenizing: TokenizingResource):
        pipe = _run_pipe(exp, store)
        used = verify_inputs(context, dep, node, pipe)
        if pipe.components():  # a mixture: the index over the component caches (their own assets)
            res = pipe.token_cache()
            tokenized = 0
        elif tokenizing.validate() == "ray":  # one Ray task per shard group, then the same commit
            res = tokenizing.build_on_ray(pipe, log=context.log.info)
            tokenized = 0 if res.hit else int(res.manifest.get("parts_built", 0))
        else:
            built = [p for p in parts if not p.get("skipped")]
            res = pipe.token_cache_commit(built)
            tokenized = 0 if res.hit else len(built)
        context.log.info(md.summary_line(res))
        meta = _artifact_metadata(dep, node, pipe, used, res)
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
    """``train_ckpt``: launched through the ``training`` resource (:func:`assets.launch.train`),
    retried, in the training pool; each checkpoint is reported as an observation as it lands."""
    exp = node.owner
    spec = {**spec, "description": spec["description"] + " Each checkpoint is reported as an observation "
                                                          "as it lands."}

    @dg.asset(key=node.key, deps=node.deps, retry_policy=dg.RetryPolicy(max_retries=TRAIN_RETRIES, delay=2),
              **spec)
    def train_ckpt(context: dg.AssetExecutionContext, store: ArtifactStoreResource, training: TrainingLauncherResource,
                   jax_runtime: JaxRuntimeResource, tracking: TrackingResource):
        tend(context)
        training.validate_mode()  # a bad launcher setting fails here, in one line, before any work
        pipe = _run_pipe(exp, store)
        used = verify_inputs(context, dep, node, pipe)
        hit = pipe.cached("train_ckpt")
        if hit is not None:
            context.log.info(md.summary_line(hit))
            yield md.result(hit, _artifact_metadata(dep, node, pipe, used, hit))
            return
        if context.retry_number:
            from lm_pipeline.train.checkpoint import latest_checkpoint

            context.log.info(f"attempt {context.retry_number + 1}: resuming from {latest_checkpoint(pipe.run_dir())}")
        try:  # same addresses: shared, not recomputed
            run_pipe = pipe.with_config(apply_runtime_overrides(exp.cfg, jax_runtime, tracking))
        except ValueError:
            raise dg.Failure("runtime overrides changed the run's fingerprint") from None
        res, extra = yield from launch.train(context, node.key, run_pipe, store=store, training=training,
                                             jax_runtime=jax_runtime)
        context.log.info(md.summary_line(res))
        yield md.result(res, _artifact_metadata(dep, node, pipe, used, res, extra))

    return train_ckpt
