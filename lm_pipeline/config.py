"""The root run configuration, YAML loading with ``!include``, and dotted command-line overrides.

One YAML file describes a run, with Levanter's sections (``data``, ``model``, ``trainer``,
``optimizer``) plus ``eval``, ``export`` and ``store``. Sub-files are pulled in with
``key: !include other.yaml`` (relative to the including file). Overrides such as
``--model.num_heads 20 --trainer.checkpointer.save_interval 20m`` are parsed as YAML values
and applied before validation, so a bad value fails before any compute starts.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from lm_pipeline.data.config import DataConfig
from lm_pipeline.eval.config import EvalConfig
from lm_pipeline.eval.harness_config import EvalHarnessConfig
from lm_pipeline.hf.config import ExportConfig
from lm_pipeline.models import Gpt2Config, LmConfig
from lm_pipeline.schema import ConfigError, field, from_dict, raise_problems, to_dict
from lm_pipeline.train.config import TrainerConfig
from lm_pipeline.train.optim_config import OptimizerConfig


@dataclass(frozen=True)
class StoreConfig:
    """Where content-addressed artifacts live."""

    root: str = field("artifacts", help="Root of the artifact store: a local folder or any fsspec URL (s3://, gs://, ...; credentials from the standard AWS/Google environment and chains, an S3-compatible endpoint from AWS_ENDPOINT_URL_S3). See own-data.md#object-stores.", semantic=False)


@dataclass(frozen=True)
class RunConfig:
    """Everything one training run (and the pipeline around it) needs."""

    data: DataConfig = field(default_factory=DataConfig, help="Sources, validation, tokenizer, cache, packing.")
    model: LmConfig = field(default_factory=Gpt2Config, help="The model family (`type: gpt2 | llama`) and its shape.")
    trainer: TrainerConfig = field(default_factory=TrainerConfig, help="The training loop.")
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig, help="AdamW and the learning-rate schedule.")
    eval: EvalConfig = field(default_factory=EvalConfig, help="Offline evaluation of checkpoints (eval_report).")
    export: ExportConfig = field(default_factory=ExportConfig, help="Hugging Face exports (hf_export, hf_save_steps).")
    eval_harness: EvalHarnessConfig | None = field(None, help="Downstream tasks through lm-evaluation-harness, run by `lm-pipeline eval` and the task_eval stage (Levanter's section). See downstream_eval.md.")
    eval_harness_steps: int = field(10000, help="Levanter's cadence of eval_harness during training: accepted as written; the tasks run on checkpoints with `lm-pipeline eval`.", semantic=False)
    store: StoreConfig = field(default_factory=StoreConfig, help="The artifact store.", semantic=False)
    initialize_from_hf: str | None = field(None, help="Continued pretraining: start from the weights of this Hugging Face GPT-2 or Llama model (a local directory, or a hub repo 'org/name[@revision]', which needs the network or the local HF cache). Its identity in the run's fingerprint is the sha256 of its safetensors files (a hub repo: its resolved commit), never its path. See continued-pretraining.md.", semantic=False)
    use_hf_model_config: bool = field(False, help="With initialize_from_hf: the model's shape comes from the directory's config.json (keys written under model: override it), and the tokenizer from the directory unless data.tokenizer is given.", semantic=False)

    def validate(self) -> None:
        if self.use_hf_model_config and not self.initialize_from_hf:
            raise ConfigError("use_hf_model_config", "needs initialize_from_hf (the Hugging Face model to read)")
        if self.initialize_from_hf is not None and not self.initialize_from_hf.strip():
            raise ConfigError("initialize_from_hf", "must not be empty (or null)")
        if self.initialize_from_hf and self.trainer.initialize_from:
            raise ConfigError("initialize_from_hf", "give initialize_from_hf or trainer.initialize_from, not both")
        if self.data.configs:  # a mixture's run length is never in epochs
            from lm_pipeline.data.mixture import length_problems

            raise_problems([ConfigError(where, problem) for where, problem in length_problems(self.trainer)])

    @classmethod
    def normalize_raw(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Levanter's top-level ``hf_save_steps``, ``hf_save_path``, ``hf_upload`` go to ``export:``
        and a top-level ``checkpointer:`` (as its configuration guide writes the block) to
        ``trainer.checkpointer``; ``use_hf_model_config`` takes the model (and, unless given, the
        tokenizer) from ``initialize_from_hf``."""
        model = data.get("model")
        kind = model.get("type") if isinstance(model, dict) else None
        if data.get("initialize_from_hf") and isinstance(kind, str) and kind not in LmConfig.registry:
            # refused before anything reads the hub (otherwise the schema says the same below)
            raise ConfigError("model.type", f"{kind!r} is not supported; supported model families: "
                              f"{', '.join(sorted(LmConfig.registry))} (initialize_from_hf takes a Hugging Face "
                              "GPT-2 or Llama)")
        if "checkpointer" in data:
            trainer = data.get("trainer")
            trainer = {} if trainer is None else trainer
            if not isinstance(trainer, dict):
                raise ConfigError("trainer", "expected a mapping")
            if "checkpointer" in trainer:
                raise ConfigError("checkpointer", "given twice (top-level and as trainer.checkpointer)")
            data["trainer"] = {**trainer, "checkpointer": data.pop("checkpointer")}
        data = _hf_model_config_raw(_levanter_top_level_raw(data))
        moved = {k: data.pop(k) for k in TOP_LEVEL_EXPORT_KEYS if k in data}
        if moved:
            export = data.get("export")
            if export is None:
                export = {}
            if not isinstance(export, dict):
                raise ConfigError("export", "expected a mapping")
            export = dict(export)
            for k, v in moved.items():
                if k in export:
                    raise ConfigError(k, f"given twice (top-level and as export.{k})")
                export[k] = v
            data["export"] = export
        return data


def _levanter_top_level_raw(data: dict[str, Any]) -> dict[str, Any]:
    """Levanter's top-level keys of its training script: ``initialize_from_hf: true`` starts from
    ``model.reference_checkpoint``; ``z_loss_weight`` and ``epoch`` (a cap on passes over the data,
    0 = none) are ``trainer.z_loss_weight`` and ``trainer.max_epochs``."""
    from lm_pipeline.levanter import note

    if data.get("initialize_from_hf") is True:
        model = data.get("model")
        source = model.pop("reference_checkpoint", None) if isinstance(model, dict) else None
        if not isinstance(source, str):
            raise ConfigError("initialize_from_hf", "Levanter's `initialize_from_hf: true` starts from "
                              "model.reference_checkpoint, which is not given: set model.reference_checkpoint or "
                              "initialize_from_hf to a Hugging Face model (a local directory or org/name)")
        data["initialize_from_hf"] = source
        note("initialize_from_hf", f"Levanter's initialize_from_hf: true starts from model.reference_checkpoint "
             f"({source}) here")
    elif data.get("initialize_from_hf") is False:
        data.pop("initialize_from_hf")
    _model_averaging_raw(data)
    for key, target in (("z_loss_weight", "z_loss_weight"), ("epoch", "max_epochs")):
        if key in data:
            trainer = data.get("trainer")
            trainer = {} if trainer is None else trainer
            if not isinstance(trainer, dict):
                raise ConfigError("trainer", "expected a mapping")
            if target in trainer:
                raise ConfigError(key, f"given twice (top-level {key} and trainer.{target}); keep one")
            value = data.pop(key)
            data["trainer"] = {**trainer, target: None if key == "epoch" and value == 0 else value}
    return data


def _model_averaging_raw(data: dict[str, Any]) -> None:
    """Levanter's ``trainer.model_averaging: {type: ema, beta: B}`` is ``optimizer.ema_beta: B`` (the
    average is kept with the optimizer's state)."""
    from lm_pipeline.levanter import note

    trainer = data.get("trainer")
    if not isinstance(trainer, dict) or "model_averaging" not in trainer:
        return
    avg = trainer.pop("model_averaging")
    if avg is None:
        return
    if not isinstance(avg, dict) or avg.get("type", "ema") != "ema" or set(avg) - {"type", "beta"}:
        raise ConfigError("trainer.model_averaging", f"Levanter's `trainer.model_averaging` {avg!r} is not supported "
                          "here: use {type: ema, beta: 0.999} (an exponential moving average)")
    optimizer = data.get("optimizer")
    optimizer = {} if optimizer is None else optimizer
    if not isinstance(optimizer, dict) or "ema_beta" in optimizer:
        raise ConfigError("trainer.model_averaging", "given together with optimizer.ema_beta; keep one")
    data["optimizer"] = {**optimizer, "ema_beta": avg.get("beta", 0.999)}
    note("trainer.model_averaging", "Levanter's trainer.model_averaging: {type: ema} is optimizer.ema_beta here "
         "(evaluation and exports use the average)")


def _hf_model_config_raw(data: dict[str, Any]) -> dict[str, Any]:
    source = data.get("initialize_from_hf")
    if not (isinstance(source, str) and source.strip() and data.get("use_hf_model_config") is True):
        return data
    from lm_pipeline.hf.start import hf_model_config
    from lm_pipeline.inputs import hf_model_dir_problem, hub_model_problem

    problem = hf_model_dir_problem(source, "initialize_from_hf") or hub_model_problem(source, "initialize_from_hf")
    if problem:
        raise ConfigError("initialize_from_hf", problem)
    hf_cfg = hf_model_config(source)
    model = data.get("model") or {}
    if not isinstance(model, dict):
        raise ConfigError("model", "expected a mapping")
    if model.get("type", hf_cfg.type) != hf_cfg.type:
        raise ConfigError("model.type", f"is {model['type']!r} but {source} holds a {hf_cfg.type!r} model")
    base = to_dict(hf_cfg)
    for key, value in model.items():  # the shape is the directory's: a key that changes it is refused
        if key in base and key not in HF_MODEL_CONFIG_OVERRIDABLE and value != base[key]:
            raise ConfigError(f"model.{key}", f"is {value!r} but {source} has {base[key]!r}; with use_hf_model_config "
                              f"the shape comes from the directory (drop the key, or set use_hf_model_config: "
                              f"false); keys that may differ: {', '.join(HF_MODEL_CONFIG_OVERRIDABLE)}")
    if hf_cfg.type == "gpt2" and "seq_len" in model and model["seq_len"] != base["seq_len"]:
        raise ConfigError("model.seq_len", f"is {model['seq_len']!r} but the GPT-2 at {source} has "
                          f"{base['seq_len']} learned positions (n_positions); drop the key")
    data["model"] = {**base, **model}
    section = data.get("data")
    section = {} if section is None else section
    if isinstance(section, dict) and section.get("tokenizer") is None:
        repo, _, rev = source.rpartition("@") if "@" in source and not os.path.isdir(source) else (source, "", "")
        data["data"] = {**section, "tokenizer": {"kind": "hf", "name_or_path": repo, "revision": rev or None}}
    return data


#: Model keys that may differ from the Hugging Face directory's under ``use_hf_model_config``
#: (they change no weight's shape; a GPT-2's seq_len is its position table and must agree).
HF_MODEL_CONFIG_OVERRIDABLE = ("seq_len", "gradient_checkpointing", "embed_pdrop", "resid_pdrop", "attn_pdrop",
                               "upcast_attn", "initializer_range")


#: Levanter's top-level keys that are fields of ``export:`` here.
TOP_LEVEL_EXPORT_KEYS = ("hf_save_steps", "hf_save_path", "hf_upload")


# --- YAML with !include ---------------------------------------------------------------------


class _IncludeLoader(yaml.SafeLoader):
    """A safe loader that knows the chain of files including the one it reads (cycle check)."""

    include_stack: tuple[str, ...] = ()


def _include(loader: _IncludeLoader, node: yaml.Node) -> Any:
    from lm_pipeline import fs

    if not isinstance(node, yaml.ScalarNode):
        raise ConfigError("", f"{loader.name}: !include takes a file path, e.g. `data: !include data.yaml`")
    rel = loader.construct_scalar(node)
    return _load_yaml(fs.resolve(fs.parent(loader.name), rel), loader.include_stack)  # the including file's dir


def _read_config_text(path: str | os.PathLike, stack: tuple[str, ...]) -> str:
    """The text of a config file: a local path or a URL (read through fsspec with the store's
    standard credentials)."""
    from lm_pipeline import fs

    where = f" (included from {stack[-1]})" if stack else ""
    text_path = os.fspath(path)
    problem = fs.url_problem(text_path)
    if problem:
        raise ConfigError("", f"config file {problem}")
    try:
        data = fs.read_bytes(text_path)
    except Exception as e:  # noqa: BLE001 - permissions, credentials, bucket, network: one line
        raise ConfigError("", f"cannot read {text_path}{where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if data is None:
        raise ConfigError("", f"config file not found: {text_path}{where}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError("", f"cannot read {text_path}: {e}") from None


_IncludeLoader.add_constructor("!include", _include)


def _load_yaml(path: str | os.PathLike, stack: tuple[str, ...] = ()) -> Any:
    from lm_pipeline import fs

    path = os.fspath(path)
    resolved = fs.norm(path)  # the identity of the file, for the cycle check
    if resolved in stack:
        chain = " -> ".join((*stack, resolved))
        raise ConfigError("", f"include cycle: {chain}")
    text = _read_config_text(path, stack)
    try:
        loader = _IncludeLoader(text)  # the reader rejects control characters right here
    except yaml.YAMLError as e:
        raise ConfigError("", f"{path}: invalid YAML: {e}") from None
    loader.name = path
    loader.include_stack = (*stack, resolved)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise ConfigError("", f"{path}: invalid YAML: {e}") from None
    finally:
        loader.dispose()


# --- overrides ------------------------------------------------------------------------------


def parse_overrides(args: Sequence[str]) -> list[tuple[str, Any]]:
    """``['--a.b', '3', '--c=x']`` -> ``[('a.b', 3), ('c', 'x')]``; values are parsed as YAML."""
    out: list[tuple[str, Any]] = []
    i = 0
    args = list(args)
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError("", f"unexpected argument {arg!r}; overrides look like --section.field VALUE")
        key = arg[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ConfigError(key, "override has no value; write --" + key + " VALUE")
            raw = args[i + 1]
            i += 1
        i += 1
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        out.append((key.replace(",", "."), value))  # tolerate the guide's `--trainer.wandb,group` typo
    return out


def parse_override_text(text: str | None, *, source: str = "overrides") -> list[tuple[str, Any]]:
    """Overrides written as one string, ``"a.b=1 c.d='x y'"`` (split as a shell would; each item
    ``section.field=value``, a leading ``--`` allowed) -> ``[('a.b', 1), ('c.d', 'x y')]``.

    The same parser as the command line's (:func:`parse_overrides`); ``source`` names where the
    text came from in errors (e.g. an environment variable).
    """
    args = []
    for item in shlex.split(text or ""):
        item = item[2:] if item.startswith("--") else item
        if "=" not in item or item.startswith("="):
            raise ConfigError("", f"{source}: expected section.field=value, got {item!r}")
        args.append(f"--{item}")
    return parse_overrides(args)


def _spellings_to_drop(raw: dict[str, Any], parts: list[str]) -> list[tuple[dict[str, Any], str]]:
    """(mapping, key) pairs in ``raw`` that spell the same field as the dotted key ``parts``
    differently (an alias, or Levanter's top-level ``hf_*`` keys), so that an override replaces
    the file's value whichever spelling either uses (draccus' behaviour)."""
    import dataclasses
    import types
    import typing

    from lm_pipeline.schema import Choice

    out: list[tuple[dict[str, Any], str]] = []
    if len(parts) == 1 and parts[0] in TOP_LEVEL_EXPORT_KEYS and isinstance(raw.get("export"), dict):
        if parts[0] in raw["export"]:
            out.append((raw["export"], parts[0]))
    if len(parts) == 2 and parts[0] == "export" and parts[1] in TOP_LEVEL_EXPORT_KEYS and parts[1] in raw:
        out.append((raw, parts[1]))
    cls: Any = RunConfig
    node: Any = raw
    entry_of: Any = None  # a mapping of sections (data.configs): the next part names an entry
    for i, part in enumerate(parts):
        if entry_of is not None:
            cls, node, entry_of = entry_of, node.get(part) if isinstance(node, dict) else None, None
            continue
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)) or not isinstance(node, dict):
            break
        flds = {f.name: f for f in dataclasses.fields(cls) if f.init}
        alias_of = {a: f.name for f in flds.values() for a in f.metadata.get("aliases", ())}
        name = alias_of.get(part, part)
        if name not in flds:
            break
        spellings = [name, *flds[name].metadata.get("aliases", ())]
        if i == len(parts) - 1:
            out.extend((node, s) for s in spellings if s != part and s in node)
            break
        nxt = next((node[s] for s in spellings if s in node), None)
        tp = typing.get_type_hints(cls)[name]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            tp = args[0] if len(args) == 1 else None
        if isinstance(tp, type) and issubclass(tp, Choice):
            family = tp.family()
            kind = nxt.get("type", family.default_type) if isinstance(nxt, dict) else family.default_type
            tp = family.registry.get(kind) if isinstance(kind, str) else None
        if typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
            entry_of = typing.get_args(tp)[1]
        cls, node = tp, nxt
    return out


#: Fields that another framework's keys set through a translation rather than an alias
#: (targets, sources): LLM Trainer's ``use_amp``/``amp_dtype`` become ``mp``; its ``dropout`` sets
#: two fields. An override of a target replaces what the file's sources said of it (and only of
#: it); an override of a source replaces the file's targets.
TRANSLATED_KEYS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("trainer.mp",), ("trainer.use_amp", "trainer.amp_dtype")),
    (("trainer.tracker",), ("trainer.report_to",)),
    (("trainer.checkpointer.keep",), ("trainer.save_steps",)),
    (("trainer.checkpointer.keep_last",), ("trainer.save_total_limit",)),
    (("trainer.checkpointer.base_path",), ("trainer.checkpoint_dir",)),
    (("model.mlp_scale",), ("model.d_ff",)),
    (("model.resid_pdrop", "model.embed_pdrop"), ("model.dropout",)),
    (("model.attn_pdrop",), ("model.attention_dropout",)),
)


def _parent(raw: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
    *parents, leaf = dotted.split(".")
    node: Any = raw
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), leaf


def _replace_translated(raw: dict[str, Any], key: str) -> None:
    """Before the override ``key`` is set: take out what the file says of the same field through
    a translated key (see :data:`TRANSLATED_KEYS`), keeping what it says of other fields."""
    for targets, sources in TRANSLATED_KEYS:
        if key in targets:
            for source in sources:
                node, leaf = _parent(raw, source)
                if node is None or leaf not in node:
                    continue
                value = node.pop(leaf)
                for other in targets:  # e.g. dropout: the field not overridden keeps the file's value
                    if other != key:
                        tnode, tleaf = _parent(raw, other)
                        if tnode is not None and tleaf not in tnode:
                            tnode[tleaf] = value
        elif key in sources:
            for target in targets:
                node, leaf = _parent(raw, target)
                if node is not None and leaf in node:
                    del node[leaf]


def _top_level_checkpointer(raw: dict[str, Any], key: str) -> str:
    """Levanter's guide writes ``checkpointer:`` at the top level: with an override of
    ``trainer.checkpointer.*`` (or ``checkpointer.*``) the file's block moves under ``trainer``
    first, so the override edits it; the override's key in its ``trainer.`` spelling."""
    if key == "checkpointer" or key.startswith("checkpointer."):
        key = f"trainer.{key}"
    if key.startswith("trainer.checkpointer") and isinstance(raw.get("checkpointer"), dict):
        trainer = raw.get("trainer")
        if trainer is None:
            trainer = raw["trainer"] = {}
        if isinstance(trainer, dict) and "checkpointer" not in trainer:
            trainer["checkpointer"] = raw.pop("checkpointer")
    return key


def _override_parts(raw: dict[str, Any], key: str) -> list[str]:
    """The dotted ``key`` split into its parts; a mixture component's name holding '.' stays one
    part when the file names that component (``data.configs.c4.en.train_urls``)."""
    parts = key.split(".")
    configs = raw.get("data", {}).get("configs") if isinstance(raw.get("data"), dict) else None
    if parts[:2] == ["data", "configs"] and isinstance(configs, dict) and len(parts) > 4:
        for end in range(len(parts) - 1, 3, -1):
            if ".".join(parts[2:end]) in configs:
                return [*parts[:2], ".".join(parts[2:end]), *parts[end:]]
    return parts


def apply_overrides(raw: dict[str, Any], overrides: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """Set each dotted key; an override replaces the file's value of that field whichever
    spelling (name, alias, or a translated key such as LLM Trainer's ``use_amp`` for ``mp``)
    either uses. Two spellings within one file stay an error."""
    for key, value in overrides:
        key = _top_level_checkpointer(raw, key)
        parts = _override_parts(raw, key)
        for mapping, spelling in _spellings_to_drop(raw, parts):
            del mapping[spelling]
        _replace_translated(raw, key)
        node = raw
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(".".join(parts[: i + 1]), f"is not a section; cannot set {key}")
            node = nxt
        node[parts[-1]] = value
    return raw


def load_config(path: str | os.PathLike | None = None,
                overrides: Sequence[str] | Sequence[tuple[str, Any]] | dict[str, Any] = ()) -> RunConfig:
    """Load a run config from YAML (or the defaults when ``path`` is None) plus overrides.

    ``overrides`` is command-line style (``["--model.num_heads", "20"]``), a mapping of dotted
    keys to values (``{"model.num_heads": 20}``), or parsed pairs (:func:`parse_overrides`,
    :func:`parse_override_text`).
    """
    raw = _load_yaml(path) if path is not None else {}
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("", f"{path}: the top level must be a mapping of sections (data, model, trainer, ...)")
    if isinstance(overrides, dict):
        pairs = list(overrides.items())
    elif all(isinstance(o, tuple) for o in overrides):
        pairs = list(overrides)
    else:
        pairs = parse_overrides(overrides)
    raw = apply_overrides(raw, pairs)
    return from_dict(RunConfig, raw)


def dump_config(cfg: RunConfig) -> str:
    """The full resolved config as YAML (loadable with :func:`load_config`)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
