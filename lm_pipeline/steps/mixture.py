"""A data mixture in the pipeline: one token cache per component, an index over them.

Each component of ``data.configs`` is its own experiment's data: a :class:`Pipeline` over the
config with the data section's shared fields (tokenizer, packing, ...) and that component's source
fields (:func:`component_config`). Its ``raw_shards`` and ``token_cache`` are addressed like any
experiment's (its source config, its shards' content hashes, the tokenizer's fingerprint, the code
versions), so two experiments that mix the same source build its cache once, a single-source
experiment over that source shares it too, and editing one source rebuilds that source's cache
only. The component's ``tokenizer`` is the mixture's own (:func:`_borrowed_tokenizer`): a given
tokenizer (a local ``tokenizer.json`` or a hub name) does not depend on the data; a BPE trained here
is trained on the union of the components' training text, so editing any source retrains it.

The mixture's own stages are indexes: ``raw_shards`` lists the components' shards (splits named
``<component>/<split>``), ``token_cache`` the components' caches (its fingerprint covers theirs,
:func:`cache_sources`); training reads each component's rows through
:func:`lm_pipeline.data.mixture.mixture_source`, evaluation each component's validation sets as
``<component>/<set>``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from lm_pipeline.data.component_names import config_path, parse_split_key, split_key
from lm_pipeline.schema import ConfigError, ConfigProblems
from lm_pipeline.train.run_identity import MIXTURE_DRAW_FIELDS

if TYPE_CHECKING:
    from lm_pipeline.config import RunConfig
    from lm_pipeline.steps.pipeline import Pipeline
    from lm_pipeline.steps.result import StageResult
    from lm_pipeline.steps.stage import BuildContext, Inputs, Stage

#: The stages each component has of its own (the rest are the mixture's).
COMPONENT_STAGES = ("raw_shards", "tokenizer", "token_cache")

#: How the mixture's ``token_cache`` names a component's cache among its inputs.
COMPONENT_INPUT = "components/"


def is_mixture(cfg: RunConfig) -> bool:
    return bool(getattr(cfg.data, "configs", None))


def component_config(cfg: RunConfig, name: str) -> RunConfig:
    """``cfg`` with the data section of component ``name``: its source fields, the section's
    shared ones, no mixture; its caches in its own ``cache_dir``, else the section's."""
    from lm_pipeline.data.config import DataConfig, SourceConfig

    comp = cfg.data.configs[name]
    source = {f.name: getattr(comp, f.name) for f in dataclasses.fields(SourceConfig)}
    source["cache_dir"] = comp.cache_dir or cfg.data.cache_dir
    no_mixture = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                  for f in dataclasses.fields(DataConfig) if f.name in ("configs", *MIXTURE_DRAW_FIELDS)}
    data = dataclasses.replace(cfg.data, **source, **no_mixture)
    return dataclasses.replace(cfg, data=data)


def _borrowed_tokenizer(parent: Pipeline) -> Stage:
    """The mixture's ``tokenizer`` as a component pipeline's: the same address (config, code
    version, inputs), built by the mixture."""
    own = parent.stage("tokenizer")

    def sources(pipe: Pipeline, content: bool) -> dict[str, Any]:
        if content:
            return dict(parent.address("tokenizer").inputs)
        ups = {up: parent.config_version(up) for up in parent.input_stages("tokenizer")}
        return {**ups, **(own.sources(parent, False) if own.sources is not None else {})}

    return dataclasses.replace(own, config=lambda pipe: parent.stage_config("tokenizer"), input_stages=lambda pipe: (),
                               sources=sources, build=lambda ctx, inputs, **options: parent.build("tokenizer"))


def component_pipelines(parent: Pipeline) -> dict[str, Pipeline]:
    """A pipeline per component of ``parent``'s mixture, in ``configs`` order (none without one)."""
    from lm_pipeline.steps.pipeline import Pipeline

    if not is_mixture(parent.cfg):
        return {}
    stages = tuple(_borrowed_tokenizer(parent) if name == "tokenizer" else parent.stage(name)
                   for name in COMPONENT_STAGES)
    return {name: Pipeline(component_config(parent.cfg, name), parent.store, progress=parent.progress, stages=stages)
            for name in parent.cfg.data.configs}


def shards(parent: Pipeline) -> dict[str, list]:
    """The mixture's shards: each component's splits as ``<component>/<split>``."""
    out: dict[str, list] = {}
    for name, sub in parent.components().items():
        with naming(name):
            out.update({split_key(name, split): found for split, found in sub.shards().items()})
    return out


@contextlib.contextmanager
def naming(name: str) -> Iterator[None]:
    """A component's data problems named by its own fields: ``data.configs.<name>.train_urls``,
    not the ``data.train_urls`` of the component's pipeline."""
    from lm_pipeline.data.config import SourceConfig
    from lm_pipeline.data.validation import DataValidationError

    fields = "|".join(f.name for f in dataclasses.fields(SourceConfig))
    pattern = re.compile(rf"(?<![\w.-])data\.(?=(?:{fields})\b)")

    def own(text: str) -> str:
        return pattern.sub(config_path(name) + ".", text)

    try:
        yield
    except DataValidationError as e:
        raise DataValidationError(own(e.source), e.location, e.reason, own(e.detail), own(e.hint)) from None
    except ConfigError as e:
        if isinstance(e, ConfigProblems) or not e.path.startswith("data."):
            raise
        raise ConfigError(own(e.path), own(e.message)) from None


def training_splits(all_shards: dict[str, list]) -> list[str]:
    """The training splits among a data section's splits: ``train``, or a mixture's
    ``<component>/train`` in ``configs`` order."""
    return ["train"] if "train" in all_shards else [split for split in all_shards if split.endswith("/train")]


def training_shards(all_shards: dict[str, list]) -> list:
    """The training shards of a data section's splits (of :func:`training_splits`)."""
    return [s for split in training_splits(all_shards) for s in all_shards[split]]


def input_stage(key: str, stages: Sequence[str]) -> str | None:
    """The stage of the artifact an input key of a manifest names: the key itself when it is a
    stage, ``token_cache`` for a mixture's ``components/<name>`` (:func:`cache_sources`), else
    None (a source: a content hash, a checkpoint step)."""
    if key in stages:
        return key
    return "token_cache" if key.startswith(COMPONENT_INPUT) and "token_cache" in stages else None


def cache_sources(pipe: Pipeline, content: bool) -> dict[str, Any]:
    """The mixture's ``token_cache`` inputs besides its upstream stages: each component cache's
    fingerprint (with ``content=False``, its config version); none without a mixture. A chat source
    rendered with its tokenizer's own template: that template's sha256 (``chat_template``; a text
    source has no such input, so its address is unchanged)."""
    out = {f"{COMPONENT_INPUT}{name}": sub.address("token_cache").fingerprint if content
           else sub.config_version("token_cache") for name, sub in pipe.components().items()}
    out.update(_chat_template_source(pipe))
    return out


def _chat_template_source(pipe: Pipeline) -> dict[str, Any]:
    """``{"chat_template": sha256}`` of the template a chat source takes from a local tokenizer
    directory (``tokenizer_config.json`` or ``chat_template.jinja``: not in tokenizer.json's hash);
    a template in the config is hashed with the config, a hub tokenizer's by its name and revision."""
    chat = getattr(pipe.cfg.data, "chat", None)
    tok = pipe.cfg.data.tokenizer
    if chat is None or chat.single_turn or chat.chat_template is not None or tok.kind == "bpe" or not tok.name_or_path:
        return {}
    from lm_pipeline import fs
    from lm_pipeline.data.chat import chat_template_of

    if not fs.exists(fs.join(tok.name_or_path, "tokenizer.json")):  # a hub id
        return {}
    import hashlib

    return {"chat_template": hashlib.sha256((chat_template_of(tok.name_or_path) or "").encode()).hexdigest()}


def url_locations(data: Any) -> list[tuple[str, str]]:
    """(config field, URL or path) of every location a mixture's components read or write."""
    out = []
    for name, comp in getattr(data, "configs", {}).items():
        where = config_path(name)
        out += [(f"{where}.cache_dir", comp.cache_dir)] if comp.cache_dir else []
        out += [(f"{where}.{field}", u) for field, u in comp.urls()]
    return out


# -- builders ---------------------------------------------------------------------------------------


def raw_shards(ctx: BuildContext, inputs: Inputs) -> StageResult:
    """Each component's ``raw_shards`` (built or a hit), indexed: splits ``<component>/<split>``."""

    def write(path: str):
        built = _each_component(ctx, "raw_shards")
        splits = {split_key(name, split): rows for name, res in built.items()
                  for split, rows in (res.manifest.get("shards") or {}).items()}
        summary: dict[str, Any] = {k: sum(int(r.manifest["summary"].get(k) or 0) for r in built.values())
                                   for k in ("num_shards", "records", "valid", "skipped")}
        summary["splits"] = sorted(splits)
        return summary, {"shards": splits, "components": _index(built)}

    return ctx.run(write)


def token_cache(ctx: BuildContext, inputs: Inputs) -> StageResult:
    """Each component's ``token_cache`` (built or a hit), indexed."""
    tok = inputs["tokenizer"]

    def write(path: str):
        built = _each_component(ctx, "token_cache")
        splits = {split_key(name, split): counts for name, res in built.items()
                  for split, counts in (res.manifest["summary"].get("splits") or {}).items()}
        train = sum(int(res.manifest["summary"].get("train_tokens") or 0) for res in built.values())
        return {"splits": splits, "train_tokens": train}, {"tokenizer_path": tok.path, "built_by": "components",
                                                            "components": _index(built)}

    return ctx.run(write)


def _each_component(ctx: BuildContext, stage: str) -> dict[str, StageResult]:
    """Each component's ``stage``, built or a hit (when the mixture's own index is not complete)."""
    built = {}
    for name, sub in ctx.components().items():
        with naming(name):
            built[name] = sub.build(stage)
    return built


def _index(built: dict[str, StageResult]) -> dict[str, dict[str, Any]]:
    return {name: {"fingerprint": res.fingerprint, "path": res.path, "hit": res.hit} for name, res in built.items()}


# -- reading ----------------------------------------------------------------------------------------


def component_caches(cache: StageResult) -> dict[str, str] | None:
    """{component: its token cache's path} of a mixture's ``token_cache`` index; None for a cache
    of one source."""
    comps = cache.manifest.get("components")
    return None if comps is None else {name: c["path"] for name, c in comps.items()}


def train_caches(cache: StageResult) -> list[str]:
    """The training caches of a ``token_cache`` artifact: its own, or each component's."""
    comps = component_caches(cache)
    if comps is None:
        return [f"{cache.path}/train"]
    splits = cache.manifest["summary"].get("splits") or {}  # a component with validation sets only has none
    return [f"{path}/train" for name, path in comps.items() if split_key(name, "train") in splits]


def open_component_datasets(cfg: RunConfig, cache: StageResult):
    """({component: train dataset}, {'<component>/<set>': dataset}) of a mixture's ``token_cache``."""
    from lm_pipeline.data.chat import chat_pack
    from lm_pipeline.data.loader import open_dataset

    seq_len, packing = cfg.model.seq_len, cfg.data.packing
    train, evals = {}, {}
    for split in cache.manifest["summary"].get("splits") or {}:
        name, own = parse_split_key(split)
        ds = open_dataset(f"{cache.manifest['components'][name]['path']}/{own}", seq_len, packing,
                          chat_pack=chat_pack(cfg.data.configs[name]))  # a chat component's pack
        if own == "train":
            train[name] = ds
        else:
            evals[split] = ds
    return train, evals


# -- the schedule, as shown ----------------------------------------------------------------------------


def schedule_rows(cfg: RunConfig) -> list[dict[str, Any]]:
    """Per component: its share of rows in each phase (``step <s>`` columns, normalized weights)."""
    from lm_pipeline.data.mixture import weight_phases

    phases, _ = weight_phases(cfg.data.train_weights)
    return [{"component": name, **{f"step {step}": round(w.get(name, 0.0) / sum(w.values()), 6) for step, w in phases}}
            for name in cfg.data.configs]


def schedule_png(cfg: RunConfig) -> bytes:
    """A plot of each component's share of the rows over the run's steps (stacked, one band each)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lm_pipeline.data.mixture import weight_phases

    phases, _ = weight_phases(cfg.data.train_weights)
    tc = cfg.trainer
    end = max(tc.num_train_steps or 0, int(phases[-1][0] * 1.25) + 1, 1)
    steps = [s for s, _ in phases] + [end]
    fig, ax = plt.subplots(figsize=(6, 3), dpi=100)
    bottom = [0.0] * len(phases)
    for name in cfg.data.configs:
        share = [w.get(name, 0.0) / sum(w.values()) for _, w in phases]
        ax.stairs([b + s for b, s in zip(bottom, share, strict=True)], steps, baseline=bottom, fill=True, label=name)
        bottom = [b + s for b, s in zip(bottom, share, strict=True)]
    ax.set(xlabel="step", ylabel="share of rows", ylim=(0, 1), xlim=(0, end), title="data mixture")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()
