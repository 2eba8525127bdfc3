"""The stage table: one declaration per stage of the pipeline.

raw_shards -> tokenizer -> token_cache -> train_ckpt -> eval_report, hf_export

Each :class:`Stage` says what the stage reads (its semantic config, its upstream stages, any
input that is not a stage), its code version and what builds it. Everything else is derived from
this table: the fingerprints and addresses (:class:`lm_pipeline.steps.Pipeline`), the plan,
lineage, the command line's building subcommands and the Dagster assets (``assets/stages.py``).
The declaration (:class:`lm_pipeline.steps.stage.Stage`) carries the build function and what the
result shows, so adding a stage is its own module (declaration, config, builder, metadata) and
one entry here (see "How to add a stage" in docs/architecture.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lm_pipeline import fs
from lm_pipeline.fingerprint import semantic_view
from lm_pipeline.steps import builders, mixture, shown
from lm_pipeline.steps.stage import Stage
from lm_pipeline.steps.task_eval import TASK_EVAL
from lm_pipeline.train.run_identity import MIXTURE_DRAW_FIELDS, run_semantics, start_weights

if TYPE_CHECKING:
    from lm_pipeline.steps.pipeline import Pipeline


# -- semantic configs and non-stage inputs --------------------------------------------------------


def _raw_shards_config(pipe: Pipeline) -> Any:
    view = semantic_view(pipe.cfg.data)
    view.pop("tokenizer", None)  # the tokenizer's own stage
    for name in ("packing", "shuffle", "era_length", *MIXTURE_DRAW_FIELDS):  # train_ckpt's: the row order never re-reads the shards
        view.pop(name, None)
    if isinstance(view.get("chat"), dict):  # a chat source: how its records are read; the rendering is token_cache's
        view["chat"] = {"messages_field": view["chat"].get("messages_field")}
    return view


def _token_cache_config(pipe: Pipeline) -> Any:
    """A chat source's rendering (template, single turn, loss mask); nothing for text. Not its
    ``pack``: the rows are packed when the cache is read (train_ckpt's config has it)."""
    chat = semantic_view(pipe.cfg.data).get("chat")
    if not isinstance(chat, dict):
        return {}
    return {"chat": {k: v for k, v in chat.items() if k not in ("messages_field", "pack")}}


def _raw_shards_sources(pipe: Pipeline, content: bool) -> dict[str, Any]:
    if not content:
        return {}
    return {f"{split}/{s.name}": s.fingerprint for split, shards in pipe.shards().items() for s in shards}


def _local_tokenizer(pipe: Pipeline) -> str | None:
    """The ``tokenizer.json`` of a tokenizer directory (local or a URL), if the config names one."""
    tok = pipe.cfg.data.tokenizer
    if tok.kind == "bpe" or not tok.name_or_path:
        return None
    path = fs.join(tok.name_or_path, "tokenizer.json")  # a hub id names no such file here
    return path if fs.exists(path) else None


def _tokenizer_config(pipe: Pipeline) -> Any:
    conf = semantic_view(pipe.cfg.data.tokenizer)
    if _local_tokenizer(pipe) is not None:  # a local tokenizer is named by its content, never its path
        conf = {k: v for k, v in conf.items() if k != "name_or_path"}
    return conf


def _tokenizer_input_stages(pipe: Pipeline) -> tuple[str, ...]:
    return ("raw_shards",) if pipe.cfg.data.tokenizer.kind == "bpe" else ()


def _tokenizer_sources(pipe: Pipeline, content: bool) -> dict[str, Any]:
    """A given tokenizer (not trained here): its file's sha256, or its hub name and revision."""
    tok = pipe.cfg.data.tokenizer
    if tok.kind == "bpe":
        return {}
    local = _local_tokenizer(pipe)
    return {"tokenizer.json": fs.sha256_of(local)} if local else {"hub": f"{tok.name_or_path}@{tok.revision}"}


def _train_config(pipe: Pipeline) -> Any:
    conf = {**run_semantics(pipe.cfg), "packing": pipe.cfg.data.packing}
    # a chat source's pack: how its conversations become rows (read from a cache that has none);
    # absent without a chat source, so that text runs keep their addresses
    packs = {where: src.chat.pack for where, src in pipe.cfg.data.chat_sources().items()}
    if packs:
        conf["chat_pack"] = packs
    return conf


def _train_sources(pipe: Pipeline, content: bool) -> dict[str, Any]:
    """Continued pretraining: the starting Hugging Face weights by content (or hub commit)."""
    return start_weights(pipe.cfg)


def _needs_training_text(pipe: Pipeline) -> None:
    """Some training text (raw_shards built first to know), else one line naming the shards."""
    if "raw_shards" not in pipe.stages:
        return
    problem = pipe.training_text_problem()
    if problem:
        from lm_pipeline.data.validation import DataValidationError

        source = (pipe.cfg.data.train_sources() or ["train_urls"])[0]
        raise DataValidationError(f"data.{source}", "", "no_training_text", problem)


def _tokenizer_check(pipe: Pipeline) -> None:
    if pipe.cfg.data.tokenizer.kind == "bpe":  # trained on the training text
        _needs_training_text(pipe)


def _train_check(pipe: Pipeline) -> None:
    """The checkpoints a run would load and the trackers it would start (a wandb tracker without an
    API key), all in one error, before any other stage is built; then some training text."""
    from lm_pipeline.data.chat import chat_template_problems
    from lm_pipeline.schema import ConfigError, raise_problems
    from lm_pipeline.train.trackers import tracker_problems

    raise_problems([ConfigError(where, problem) for where, problem in
                    [*pipe.checkpoint_problems(), *tracker_problems(pipe.cfg.trainer.tracker)]]
                   + chat_template_problems(pipe.cfg.data))
    _needs_training_text(pipe)


def _token_cache_check(pipe: Pipeline) -> None:
    """A chat source's template (one line naming what to set), then some training text."""
    from lm_pipeline.data.chat import chat_template_problems
    from lm_pipeline.schema import raise_problems

    raise_problems(chat_template_problems(pipe.cfg.data))
    _needs_training_text(pipe)


# -- the table ----------------------------------------------------------------------------------------

# Code versions: tokenizer 2: BPE training cuts words longer than
# lm_pipeline.data.tokenizer.MAX_TRAIN_WORD characters.
STAGES: tuple[Stage, ...] = (
    Stage("raw_shards", 1, (), _raw_shards_config, builders.raw_shards, sources=_raw_shards_sources,
          kind="python", metadata=shown.raw_shards,
          description="Every raw text shard, validated under the experiment's policy, with per-shard counts."),
    Stage("tokenizer", 2, ("raw_shards",), _tokenizer_config, builders.tokenizer,
          input_stages=_tokenizer_input_stages, sources=_tokenizer_sources, kind="python", metadata=shown.tokenizer,
          check=_tokenizer_check,
          description="The byte-level BPE trained on the training shards (or the configured HF tokenizer)."),
    Stage("token_cache", 1, ("raw_shards", "tokenizer"), _token_cache_config, builders.token_cache,
          sources=mixture.cache_sources, kind="tensorstore", command=("cache", "build the raw shards, tokenizer and token cache only"),
          metadata=shown.token_cache, check=_token_cache_check,
          description="Every split tokenized into a TensorStore token cache."),
    Stage("train_ckpt", 1, ("token_cache",), _train_config, builders.train_ckpt, kind="jax", sources=_train_sources,
          command=("train", "train a model (builds the tokenizer and token cache first if needed)"),
          pool="training", metadata=shown.train_ckpt, check=_train_check, distributed=True,
          description="The training run (resumable): its checkpoints, metrics and loss curve."),
    Stage("eval_report", 1, ("train_ckpt", "token_cache"), lambda pipe: semantic_view(pipe.eval_config),
          builders.eval_report, per_checkpoint=True, kind="pandas", pool="evaluation", metadata=shown.eval_report,
          description="Loss, perplexity and bits per byte of the final checkpoint on every validation set, "
                      "with a unigram baseline (Parquet + JSON)."),
    Stage("hf_export", 1, ("train_ckpt",), lambda pipe: semantic_view(pipe.export_config), builders.hf_export,
          per_checkpoint=True, kind="huggingface", metadata=shown.hf_export,
          description="The final checkpoint as a Hugging Face transformers model directory."),
    TASK_EVAL,
)

#: The names of the stages of :data:`STAGES` as declared (read :func:`stage_table` for the table now).
STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)


def stage_table(stages: tuple[Stage, ...] | None = None) -> dict[str, Stage]:
    """The table by name (default: :data:`STAGES`, read when called), checked: names unique, every
    upstream stage declared before its reader."""
    out: dict[str, Stage] = {}
    for s in STAGES if stages is None else stages:
        missing = [u for u in s.upstream if u not in out]
        if s.name in out or missing:
            raise ValueError(f"stage table: {s.name!r} is declared twice or reads undeclared stages {missing}")
        out[s.name] = s
    return out


def build_commands() -> dict[str, Stage]:
    """The ``lm-pipeline`` subcommands that build a stage (and the stages before it), by name."""
    return {s.command[0]: s for s in stage_table().values() if s.command}
