"""Materialize assets of the experiment named by $LM_PIPELINE_EXPERIMENT in this process, into a
fresh ephemeral Dagster instance; print {asset: {cache_hit, data_version}} as JSON on the last line.

    python tests/scripts/materialize.py raw_shards,tokenizer,token_cache
"""

import json
import sys


def main() -> int:
    import dagster as dg

    from assets.experiment import load_experiment
    from assets.pipeline import build_assets, default_resources

    keys = sys.argv[1].split(",")
    exp = load_experiment()
    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize(build_assets(exp), selection=keys, resources=default_resources(exp), instance=instance)
    out = {}
    for key in keys:
        m = instance.get_latest_materialization_event(dg.AssetKey(key)).asset_materialization
        out[key] = {"cache_hit": m.metadata["cache_hit"].value, "data_version": m.tags["dagster/data_version"]}
    print(json.dumps(out))
    return 0 if result.success else 1


if __name__ == "__main__":
    raise SystemExit(main())
