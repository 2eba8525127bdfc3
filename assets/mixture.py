"""A data mixture in the asset graph: each component's source and token cache are assets.

An experiment whose data is a mixture (``data.configs``) has, besides its stages, per component
``<experiment>/components/<name>/data_sources`` (observable: a hash of that component's shards) and
``<experiment>/components/<name>/token_cache`` (that component's cache, built by
:meth:`lm_pipeline.steps.Pipeline.components`' pipeline: shared with every experiment that has the
same source and tokenizer). Staleness is per source: a component's cache depends on its own source
and the tokenizer only; the mixture's ``raw_shards``, ``token_cache`` and the run depend on every
component's source; a given tokenizer (not trained here) on none, a BPE trained here on all (it is
trained on their union). So editing one source marks its cache and what reads the mixture stale,
and nothing else, as ``lm-pipeline plan`` says. The mixture's weights are shown on the stages that
use them: a table and a plot of the schedule (:func:`lm_pipeline.steps.mixture.schedule_png`).
"""

from typing import TYPE_CHECKING, Any

import dagster as dg

from lm_pipeline.data.component_names import asset_segment
from resources import ArtifactStoreResource  # a resource annotation Dagster resolves at definition

if TYPE_CHECKING:
    from assets.deployment import Deployment, Node
    from assets.experiment import Experiment

#: The key segment under which an experiment's components are.
COMPONENTS = "components"


def component_key(dep: "Deployment", experiment: str, component: str, what: str) -> dg.AssetKey:
    """``<experiment>/components/<component>/<what>`` (bare for the default experiment)."""
    return dg.AssetKey([*dep.prefix(experiment), COMPONENTS, asset_segment(component), what])


def add_components(dep: "Deployment", exp: "Experiment", pipe) -> None:
    """Give ``exp``'s mixture its component assets and per-source dependencies (see the module
    docstring); nothing for an experiment of one source."""
    from assets.deployment import SOURCE, Node

    comps = pipe.components()
    if not comps:
        return
    raw = dep.node(exp.name, "raw_shards")
    del dep.sources[dep.source_key(exp.name)]
    sources = []
    for name, sub in comps.items():
        src = component_key(dep, exp.name, name, SOURCE)
        dep.sources[src] = Node("raw_shards", src, sub.config_version("raw_shards"), exp, component=name)
        sources.append(src)
        cache = Node("token_cache", component_key(dep, exp.name, name, "token_cache"), sub.config_version("token_cache"),
                     exp, component=name)
        cache.deps = [dep.key(exp.name, "tokenizer"), src]
        dep.add_node(cache)
    for stage in dep.stages_of(exp.name):
        node = dep.node(exp.name, stage)
        ups = [dep.key(exp.name, up) for up in pipe.stage(stage).upstream]
        if stage == "tokenizer":  # trained here: on every component; given: on none
            node.deps = [*ups, *sources] if pipe.input_stages("tokenizer") else []
        elif stage == "token_cache":
            node.deps = [*ups, *(n.key for n in dep.components(exp.name)), *sources]
        else:
            node.deps = [*ups, *sources]
    raw.deps = list(sources)


def source_pipelines(dep: "Deployment", node: "Node", pipe) -> list[tuple[dg.AssetKey, Any]]:
    """(data source key, the pipeline whose shards it hashes) of each source ``node`` depends on."""
    if not pipe.components():
        return [(dep.source_key(node.name), pipe)]
    return [(key, pipe.components()[src.component]) for key, src in dep.sources.items()
            if src.name == node.name and key in node.deps]


def node_pipeline(node: "Node", pipe):
    """The pipeline a node's artifact belongs to: its component's, else the experiment's."""
    return pipe.components()[node.component] if node.component else pipe


def mixture_metadata(pipe) -> dict[str, dg.MetadataValue]:
    """The mixture as the assets that use it show it: its components and their weights per phase
    (a table), and a plot of each component's share over the steps; none without a mixture."""
    from assets.metadata import png_markdown
    from lm_pipeline.steps.mixture import schedule_png, schedule_rows

    if not pipe.components():
        return {}
    rows = schedule_rows(pipe.cfg)
    columns = [dg.TableColumn(c, "string" if c == "component" else "float") for c in rows[0]]
    return {"mixture": dg.MetadataValue.table([dg.TableRecord(r) for r in rows], schema=dg.TableSchema(columns=columns)),
            "mixture_schedule": png_markdown("mixture weights by step", schedule_png(pipe.cfg))}


def component_cache_asset(dep: "Deployment", node: "Node", spec: dict[str, Any]):
    """One component's token cache: built (or a hit) by the component's pipeline."""
    from assets import metadata as md
    from assets.dead_runs import tend
    from assets.provenance import lineage_metadata, provenance, verify_inputs

    spec = {**spec, "description": f"Component {node.component!r} of {node.name}'s data mixture: its shards "
                                   "tokenized into their own token cache (shared by every experiment with this "
                                   "source and tokenizer; rebuilt when this source changes)."}

    @dg.asset(key=node.key, deps=node.deps, **spec)
    def _asset(context: dg.AssetExecutionContext, store: ArtifactStoreResource) -> dg.MaterializeResult:
        tend(context)
        pipe = node.owner.fresh_pipeline(store.store())
        used = verify_inputs(context, dep, node, pipe)
        sub = node_pipeline(node, pipe)
        res = sub.token_cache()
        context.log.info(md.summary_line(res))
        meta = {**md.stage_metadata(sub.stage("token_cache"), res), **provenance(dep, node, sub, used),
                **lineage_metadata(sub.store, res)}
        return md.result(res, meta)

    return _asset
