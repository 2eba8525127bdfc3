"""Training checkpoints as partitions: ``<experiment>/checkpoint_eval`` evaluates one at a time (and
``<experiment>/checkpoint_<stage>`` each other per-checkpoint evaluation stage of the table).

Each experiment has a dynamic partitions definition ``checkpoints_<experiment>`` whose keys name a
checkpoint of a run: ``<train fingerprint>-step<N>`` (:func:`checkpoint_key`). The training asset
reports each complete checkpoint as an observation as it lands (:mod:`assets.launch`); the
``new_checkpoint_sensor`` (:mod:`assets.automation`) adds its key and requests its evaluation, which
finds the checkpoint's directory (:func:`find_checkpoint`) and evaluates it with the experiment's
evaluation settings; the experiment's evaluation job holds every such asset, so one request
evaluates a checkpoint with each.
"""

import dataclasses
import os
import re
from collections.abc import Mapping

import dagster as dg

from assets import metadata as md
from assets.dead_runs import tend
from assets.deployment import Deployment, checkpoints_group
from assets.names import CHECKPOINT_TAG, POOLS
from resources import ArtifactStoreResource

_KEY_RE = re.compile(r"^(?P<fp>[0-9A-Za-z_.\-]+)-step(?P<step>\d+)$")


def checkpoints_partitions(experiment: str) -> dg.DynamicPartitionsDefinition:
    """The checkpoints of ``experiment`` (keys ``<train fingerprint>-step<N>``)."""
    return dg.DynamicPartitionsDefinition(name=f"checkpoints_{experiment}")


def checkpoint_key(run_fingerprint: str, step: int) -> str:
    """The ``checkpoints`` partition key of a run's checkpoint: ``<train fingerprint>-step<N>``."""
    return f"{run_fingerprint}-step{int(step):07d}"


def parse_checkpoint_key(key: str) -> tuple[str, int]:
    """(train fingerprint, step) of a checkpoints partition key."""
    m = _KEY_RE.match(key)
    if not m:
        raise ValueError(f"not a checkpoint partition key: {key!r} (expected <fingerprint>-step<N>)")
    return m.group("fp"), int(m.group("step"))


def checkpoint_observation(asset: dg.AssetKey, c: Mapping, run_fingerprint: str) -> dg.AssetObservation:
    """The observation of the training ``asset`` for one complete checkpoint ``c`` (step, path, kind)."""
    key = checkpoint_key(run_fingerprint, int(c["step"]))
    return dg.AssetObservation(asset_key=asset, metadata=md.checkpoint_observation(
        c, run_fingerprint=run_fingerprint, partition_key=key))


def find_checkpoint(instance: dg.DagsterInstance, key: str, store: ArtifactStoreResource,
                    tags: Mapping[str, str] | None = None, asset: dg.AssetKey | str = "train_ckpt") -> str:
    """The checkpoint directory of a checkpoints partition key: the run's tag, else the
    observation of the training ``asset`` that reported it, else where the run saves it
    (:func:`lm_pipeline.steps.checkpoints.checkpoint_dir`)."""
    from lm_pipeline.steps.checkpoints import checkpoint_dir
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
    candidates.append(checkpoint_dir(store.store(), fp, step))
    for path in candidates:
        if latest_checkpoint(path) is not None:  # candidates are step dirs: complete or not
            return path
    raise dg.Failure(f"checkpoint {key}: no complete checkpoint found (looked at {candidates}); "
                     "a temporary checkpoint may have been pruned")


def _checkpoint_pipeline(checkpoint: str, store: ArtifactStoreResource, base):
    """A pipeline for the run a checkpoint belongs to (its saved config, this store) with the
    evaluation settings of the experiment ``base`` (its ``eval:`` and ``eval_harness:``)."""
    from lm_pipeline.config import load_config
    from lm_pipeline.steps import Pipeline

    cfg = load_config(os.path.join(checkpoint, "config.yaml"))
    cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, root=store.root),  # not semantic
                              eval_harness=base.cfg.eval_harness)
    return Pipeline(cfg, store.store(), progress=False, eval_config=base.eval_config)


def checkpoint_assets(dep: Deployment) -> list:
    """Every experiment's per-checkpoint evaluations: one partitioned asset per evaluation stage
    that reads one checkpoint (:meth:`Deployment.checkpoint_stages`)."""
    return [checkpoint_stage_asset(dep, name, stage) for name in dep.experiments
            for stage in dep.checkpoint_stages(name)]


def checkpoint_stage_asset(dep: Deployment, name: str, stage_name: str):
    """``<experiment>/checkpoint_eval`` (eval_report) or ``<experiment>/checkpoint_<stage>``: the
    experiment's ``stage_name`` of one checkpoint partition."""
    exp = dep.experiments[name]
    base = exp.pipeline()
    stage = base.stage(stage_name)
    train_key = dep.key(name, "train_ckpt")

    @dg.asset(key=dep.checkpoint_stages(name)[stage_name], deps=[train_key], partitions_def=checkpoints_partitions(name),
              group_name=checkpoints_group(name), code_version=base.own_version(stage_name), kinds={stage.kind}, pool=POOLS.get(stage.pool),
              description=f"{stage_name} ({name}'s settings) of one checkpoint of {train_key.to_user_string()} "
                          "(partition <run>-step<N>), requested by new_checkpoint_sensor as checkpoints land.")
    def checkpoint_eval(context: dg.AssetExecutionContext, store: ArtifactStoreResource) -> dg.MaterializeResult:
        tend(context)
        key = context.partition_key
        path = find_checkpoint(context.instance, key, store, tags=context.run.tags, asset=train_key)
        pipe = _checkpoint_pipeline(path, store, base)
        res = pipe.build(stage_name, checkpoint=path)
        context.log.info(md.summary_line(res))
        meta = md.stage_metadata(pipe.stage(stage_name), res)
        meta["run_fingerprint"] = dg.MetadataValue.text(parse_checkpoint_key(key)[0])
        meta["experiment"] = dg.MetadataValue.text(name)
        meta["eval_config"] = dg.MetadataValue.json(md.plain_json(pipe.stage_config(stage_name)))
        return md.result(res, meta)

    return checkpoint_eval
