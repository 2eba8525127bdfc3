"""What Dagster records about an asset's inputs is what the asset read.

Before a stage builds, :func:`verify_inputs` makes the record true: the data source's current
version is recorded as an observation when Dagster's latest one differs (the data changed since it
was last observed), and the latest materialization of each upstream asset must be the artifact the
stage reads, else the step fails in one line naming what to materialize first. After it builds,
:func:`provenance` and :func:`lineage_metadata` say what the artifact is: its experiments, semantic config,
input fingerprints and its chain back to the shards.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

import dagster as dg

from assets.deployment import Deployment, Node
from assets.metadata import plain_json
from assets.mixture import source_pipelines
from assets.names import ASSETS_COMMAND


def source_version(pipe) -> tuple[str, dict[str, Any]]:
    """The data version of an experiment's source data: a hash of every shard's fingerprint (file
    shards: their bytes; Hugging Face datasets: their own fingerprint or pinned revision), and the
    per-shard fingerprints it covers. Reads the data as it is now."""
    shards = dict(sorted(pipe.address("raw_shards").inputs.items()))
    return hashlib.sha256(json.dumps(shards, sort_keys=True).encode()).hexdigest()[:16], shards


def _latest_version(instance: dg.DagsterInstance, key: dg.AssetKey) -> str | None:
    """The data version Dagster holds for ``key`` now (its latest materialization or observation)."""
    rec = instance.get_latest_data_version_record(key)
    if rec is None:
        return None
    event = rec.asset_materialization or rec.asset_observation
    return (event.tags or {}).get("dagster/data_version") if event is not None else None


def what_to_run(missing: dg.AssetKey, me: dg.AssetKey) -> str:
    """What to run first when asset ``me`` finds its input ``missing`` not materialized (one line)."""
    what, mine = missing.to_user_string(), me.to_user_string()
    line = (f"materialize {what} first, e.g. `{ASSETS_COMMAND} materialize` (every experiment; what is built already "
            f"is a cache hit) or --select '*{mine}' ({mine} and everything upstream)")
    if not os.environ.get("DAGSTER_HOME"):
        line += ("; DAGSTER_HOME is not set, so this command keeps no record between runs: export "
                 f"DAGSTER_HOME=$PWD/.dagster_home (where `{ASSETS_COMMAND}` keeps it)")
    return line


def verify_inputs(context, dep: Deployment, node: Node, pipe, *, record: bool = True) -> dict[str, str]:
    """Make what Dagster records about this asset's inputs true before it builds (see the module
    docstring); an upstream artifact complete in the store but not recorded by Dagster (built
    from the command line, or before a reverted edit) fails too: materializing it is then a cache
    hit. ``record``: observe the data source. Returns the input fingerprints used, by upstream stage."""
    instance = context.instance
    for src, source_pipe in source_pipelines(dep, node, pipe):
        version, shards = source_version(source_pipe)
        if record and _latest_version(instance, src) != version:
            context.log_event(dg.AssetObservation(asset_key=src, tags={"dagster/data_version": version},
                                                  metadata={"shards": len(shards), "observed_by": "stage " + node.stage}))
    used: dict[str, str] = {}
    for up in pipe.stage(node.stage).upstream:
        key = dep.key(node.name, up)
        if key not in node.deps:  # a given tokenizer of a mixture reads no data (assets/mixture.py)
            continue
        used[up] = pipe.address(up).fingerprint
        require_recorded(instance, node.key, key, pipe, up, absent_ok=False)
    return used


def require_recorded(instance: dg.DagsterInstance, me: dg.AssetKey, key: dg.AssetKey, pipe, stage: str, *,
                     absent_ok: bool, named: str | None = None) -> None:
    """Dagster's latest version of ``key`` must be the artifact ``me`` reads, ``stage`` at its address
    in ``pipe``, else the step fails in one line naming what to materialize first. ``absent_ok``: an
    artifact neither built nor recorded is read as none (the comparison's unevaluated experiment).
    ``named``: what the message calls the input (default: the stage's name)."""
    want, recorded = pipe.address(stage).fingerprint, _latest_version(instance, key)
    if recorded == want:
        return
    built = pipe.cached(stage) is not None
    if absent_ok and not built and recorded is None:
        return
    state = "complete in the store (a cache hit) but not recorded by Dagster" if built else "not built"
    raise dg.Failure(f"{me.to_user_string()} reads {named or stage} {want}, which is {state}: {what_to_run(key, me)}",
                     allow_retries=False)


def provenance(dep: Deployment, node: Node, pipe, used: Mapping[str, str]) -> dict[str, Any]:
    """The metadata that says what this artifact is: its experiment (and those sharing it), config, inputs."""
    shared = [dep.key(n, node.stage).to_user_string() for n in node.shared_with]
    return {
        "experiment": dg.MetadataValue.text(node.name),
        "shared_with": dg.MetadataValue.text(", ".join(shared) or "none"),
        "experiment_file": dg.MetadataValue.text(node.experiment.describe()),
        "semantic_config": dg.MetadataValue.json(plain_json(pipe.stage_config(node.stage))),
        "input_fingerprints": dg.MetadataValue.json({**used, "data_sources": source_version(pipe)[0]}),
    }


def lineage_metadata(store, res) -> dict[str, Any]:
    """The artifact's chain back to its shards (``lm-pipeline lineage``), shown on the asset's page."""
    from lm_pipeline.steps.lineage import format_lineage, lineage

    try:
        steps = lineage(store, res.stage, res.fingerprint)
    except Exception as e:  # never fail a built artifact over its description
        return {"lineage": dg.MetadataValue.text(f"unavailable: {e}")}
    return {"lineage": dg.MetadataValue.md("```\n" + format_lineage(steps) + "\n```"),
            "lineage_command": dg.MetadataValue.text(f"lm-pipeline lineage {res.path}")}
