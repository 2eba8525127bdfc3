"""LLM-Trainer's Python configuration classes, run by this pipeline.

LLM-Trainer (a PyTorch trainer) configures a run with three classes, ``ModelConfig``,
``TrainingConfig`` and ``DataConfig``. The classes here take the same keyword names, and
:func:`to_run_config` turns them into a :class:`~lm_pipeline.config.RunConfig`; :func:`train` runs
the pipeline on it (raw shards -> tokenizer -> token cache -> training), as ``lm-pipeline train``
does. The field-by-field mapping, and what is refused and why, is ``docs/llm-trainer.md``.

The one difference to keep in mind: ``TrainingConfig.batch_size`` is **per device** (LLM-Trainer's
meaning); the run's global batch is ``devices x batch_size x gradient_accumulation_steps`` and is
what ``trainer.train_batch_size`` (whose YAML alias ``batch_size`` is Levanter's *global* batch)
holds.

A setting with no equivalent here raises :class:`~lm_pipeline.schema.ConfigError` in one line
naming the field (``ModelConfig.pre_norm``, ``TrainingConfig.use_deepspeed``, ...) and what to
use instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lm_pipeline.schema import ConfigError

if TYPE_CHECKING:
    from lm_pipeline.config import RunConfig
    from lm_pipeline.steps import StageResult

log = logging.getLogger(__name__)

__all__ = ["OVERRIDES_ENV", "DataConfig", "ModelConfig", "TrainingConfig", "fit_warmup", "resume_overrides",
           "to_run_config", "train"]

#: Dotted ``RunConfig`` overrides that :func:`train` applies last (``key=value`` pairs, the same
#: variable and syntax as the Dagster layer's experiments).
OVERRIDES_ENV = "LM_PIPELINE_OVERRIDES"

_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_new", "relu": "relu", "silu": "silu", "swish": "silu"}
_SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant", "constant_with_warmup": "constant"}


@dataclass
class ModelConfig:
    """LLM-Trainer's model settings (a GPT-style decoder): here a ``type: gpt2`` model."""

    vocab_size: int = 50000
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12
    d_ff: int = 3072
    max_seq_len: int = 1024
    dropout: float = 0.1
    attention_dropout: float = 0.1
    activation: str = "gelu"
    pre_norm: bool = True
    gradient_checkpointing: bool = False


@dataclass
class TrainingConfig:
    """LLM-Trainer's training settings. ``batch_size`` is per device, per micro-batch."""

    batch_size: int = 8
    learning_rate: float = 1e-4
    weight_decay: float = 0.01
    num_epochs: float = 3
    lr_scheduler: str = "cosine"
    warmup_steps: int = 2000
    optimizer: str = "adamw"
    gradient_accumulation_steps: int = 1
    use_amp: bool = True
    amp_dtype: str | None = None
    max_grad_norm: float | None = 1.0
    save_steps: int = 2000
    save_total_limit: int | None = 3
    eval_steps: int = 1000
    logging_steps: int = 100
    checkpoint_dir: str | None = "./checkpoints"
    report_to: Sequence[str] | str | None = None
    resume_from_checkpoint: str | bool | None = None
    world_size: int | None = None
    distributed_backend: str | None = None
    use_deepspeed: bool = False
    deepspeed_config: Any = None


@dataclass
class DataConfig:
    """LLM-Trainer's data settings, plus this project's local sources (``builtin``, ``train_urls``,
    ``validation_urls``) so that a run needs no download. ``dataset_name`` is a Hugging Face
    dataset; set it to None to use a local source."""

    dataset_name: str | None = "wikitext"
    dataset_config: str | None = "wikitext-103-raw-v1"
    dataset_split: str = "train"
    validation_split: str | None = "validation"
    text_column: str = "text"
    max_length: int = 1024
    min_length: int = 10
    pack_sequences: bool = True
    packing_strategy: str = "greedy"
    preprocessing_num_workers: int = 8
    # this project's local sources (no download)
    builtin: str | None = None
    train_urls: Sequence[str] = ()
    validation_urls: Sequence[str] = ()


def _refuse(where: str, message: str) -> ConfigError:
    return ConfigError(where, message)


def _model_section(m: ModelConfig) -> dict[str, Any]:
    if m.pre_norm is not True:
        raise _refuse("ModelConfig.pre_norm", f"{m.pre_norm!r}: only pre-norm blocks exist here (GPT-2 normalizes "
                      "before attention and MLP); drop pre_norm=False")
    if m.activation not in _ACTIVATIONS:
        raise _refuse("ModelConfig.activation", f"{m.activation!r} is not available; use one of "
                      f"{', '.join(sorted(_ACTIVATIONS))}")
    if not isinstance(m.d_model, int) or m.d_model < 1:
        raise _refuse("ModelConfig.d_model", f"must be a positive integer, got {m.d_model!r}")
    if not isinstance(m.d_ff, int) or m.d_ff < 1:
        raise _refuse("ModelConfig.d_ff", f"must be a positive integer, got {m.d_ff!r}")
    return {
        "type": "gpt2",
        "seq_len": m.max_seq_len,
        "hidden_dim": m.d_model,
        "num_heads": m.n_heads,
        "num_layers": m.n_layers,
        "mlp_scale": m.d_ff // m.d_model if m.d_ff % m.d_model == 0 else m.d_ff / m.d_model,
        "embed_pdrop": m.dropout,
        "resid_pdrop": m.dropout,
        "attn_pdrop": m.attention_dropout,
        "activation_function": _ACTIVATIONS[m.activation],
        "gradient_checkpointing": m.gradient_checkpointing,
    }


def _trainer_and_optimizer(t: TrainingConfig, devices: int) -> tuple[dict[str, Any], dict[str, Any]]:
    from lm_pipeline.train.config import amp_to_mp, report_to_trackers

    if t.use_deepspeed or t.deepspeed_config is not None:
        field = "use_deepspeed" if t.use_deepspeed else "deepspeed_config"
        raise _refuse(f"TrainingConfig.{field}", "DeepSpeed does not exist here; parameters and optimizer state are "
                      "already sharded over the devices (trainer.fsdp_axis, ZeRO-3-like); drop the DeepSpeed fields")
    if t.distributed_backend is not None:
        raise _refuse("TrainingConfig.distributed_backend", f"{t.distributed_backend!r}: JAX picks its collectives "
                      "itself (NCCL on NVIDIA GPUs); drop the field (several hosts: trainer.distributed)")
    if t.world_size is not None and t.world_size != devices:
        raise _refuse("TrainingConfig.world_size", f"is {t.world_size} but this run trains on {devices} device(s) "
                      "(one process drives all local devices); drop world_size, or pass devices= to to_run_config")
    if str(t.optimizer).lower() != "adamw":
        raise _refuse("TrainingConfig.optimizer", f"{t.optimizer!r} is not available: the optimizer is AdamW; "
                      "use optimizer='adamw'")
    if t.lr_scheduler not in _SCHEDULES:
        raise _refuse("TrainingConfig.lr_scheduler", f"{t.lr_scheduler!r} is not available; use one of "
                      f"{', '.join(_SCHEDULES)} (or optimizer.lr_schedule through overrides: inv_sqrt, inv)")
    for name in ("batch_size", "gradient_accumulation_steps"):
        value = getattr(t, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _refuse(f"TrainingConfig.{name}", f"must be a positive integer, got {value!r}")
    if not isinstance(t.warmup_steps, int) or t.warmup_steps < 0:
        raise _refuse("TrainingConfig.warmup_steps", f"must be an integer >= 0 (steps), got {t.warmup_steps!r}")
    try:
        mp = amp_to_mp(t.use_amp, t.amp_dtype)
        tracker = report_to_trackers(t.report_to)
    except ConfigError as e:
        raise ConfigError(f"TrainingConfig.{e.path}", e.message) from None
    resume = {k.removeprefix("trainer."): v for k, v in resume_overrides(t.resume_from_checkpoint, t.checkpoint_dir)}
    trainer = {
        # LLM-Trainer's batch_size is per device and per micro-batch: the global batch is their product
        "train_batch_size": devices * t.batch_size * t.gradient_accumulation_steps,
        "per_device_parallelism": t.batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "num_epochs": t.num_epochs,
        "mp": mp,
        "steps_per_eval": t.eval_steps,
        "log_every": t.logging_steps,
        "checkpointer": {"base_path": t.checkpoint_dir, "keep": [{"every": t.save_steps}],
                         "keep_last": t.save_total_limit,
                         "keep_best": True},  # LLM-Trainer keeps the best model (lowest validation loss)
        "tracker": tracker,
        **resume,
    }
    optimizer = {
        "learning_rate": t.learning_rate,
        "weight_decay": t.weight_decay,
        "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8,  # torch.optim.AdamW's defaults
        "max_grad_norm": t.max_grad_norm if t.max_grad_norm else None,  # 0 / None: no clipping
        "lr_schedule": _SCHEDULES[t.lr_scheduler],
        "min_lr_ratio": 0.0,  # PyTorch's warmup + cosine / linear schedules decay to 0
        "warmup": int(t.warmup_steps),
    }
    return trainer, optimizer


def resume_overrides(value: str | bool | None, checkpoint_dir: str | None) -> list[tuple[str, Any]]:
    """LLM-Trainer's ``resume_from_checkpoint`` as dotted overrides: a path resumes from the latest
    complete checkpoint under it; ``True`` (the command line's flag without a value) from the latest
    one in the checkpoint dir (``checkpoint_dir``, i.e. ``trainer.checkpointer.base_path``; without
    one, the run's own directory); either must exist. ``False``: never resume; None: nothing."""
    if value is None:
        return []
    if isinstance(value, bool):
        if value and checkpoint_dir:
            return [("trainer.load_checkpoint", True), ("trainer.load_checkpoint_path", str(checkpoint_dir))]
        return [("trainer.load_checkpoint", value)]
    return [("trainer.load_checkpoint_path", str(value))]


def _data_section(d: DataConfig, m: ModelConfig, tokenizer: str | Mapping[str, Any] | None) -> dict[str, Any]:
    if d.max_length != m.max_seq_len:
        raise _refuse("DataConfig.max_length", f"is {d.max_length} but ModelConfig.max_seq_len is {m.max_seq_len}: "
                      "here one seq_len is both the packed row length and the model's positions; make them equal")
    local = [n for n, on in (("builtin", d.builtin is not None), ("train_urls", bool(d.train_urls))) if on]
    if local and d.dataset_name is not None:
        raise _refuse("DataConfig.dataset_name", f"{d.dataset_name!r} (a Hugging Face dataset) and {local[0]} (local "
                      f"data) are both given; set dataset_name=None to train on {local[0]}")
    data: dict[str, Any] = {
        "text_column": d.text_column,
        "min_length": d.min_length,
        "on_invalid": "skip",  # LLM-Trainer filters short texts out; they are counted per reason here
        "pack_sequences": d.pack_sequences,
        "packing_strategy": d.packing_strategy,
        "preprocessing_num_workers": d.preprocessing_num_workers,
    }
    if d.dataset_name is not None:
        data.update({"dataset_name": d.dataset_name, "dataset_config": d.dataset_config,
                     "dataset_split": d.dataset_split, "validation_split": d.validation_split})
    elif d.builtin is not None:
        data["builtin"] = d.builtin
    elif d.train_urls:
        data["train_urls"] = list(d.train_urls)
        data["validation_urls"] = list(d.validation_urls)
    else:
        raise _refuse("DataConfig.dataset_name", "no training data: give dataset_name (Hugging Face), builtin "
                      "('python_stdlib', no download) or train_urls")
    if tokenizer is None:
        data["tokenizer"] = {"kind": "bpe", "vocab_size": m.vocab_size}
    elif isinstance(tokenizer, str):
        data["tokenizer"] = {"kind": "hf", "name_or_path": tokenizer}
    else:
        data["tokenizer"] = dict(tokenizer)
    return data


def _apply(raw: dict[str, Any], overrides: Mapping[str, Any] | Sequence[tuple[str, Any]] | None) -> dict[str, Any]:
    from lm_pipeline.config import apply_overrides

    if not overrides:
        return raw
    pairs = list(overrides.items()) if isinstance(overrides, Mapping) else list(overrides)
    return apply_overrides(raw, pairs)


def num_devices() -> int:
    """The devices a run in this process trains on (all of JAX's devices)."""
    import jax

    return jax.device_count()


def to_run_config(
    model: ModelConfig | None = None,
    training: TrainingConfig | None = None,
    data: DataConfig | None = None,
    *,
    devices: int | None = None,
    tokenizer: str | Mapping[str, Any] | None = None,
    store_root: str | None = None,
    overrides: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
) -> RunConfig:
    """The :class:`~lm_pipeline.config.RunConfig` of an LLM-Trainer configuration.

    Args:
        devices: the devices the run trains on (default: JAX's device count); the global batch is
            ``devices x batch_size x gradient_accumulation_steps``.
        tokenizer: None trains a byte-level BPE of ``ModelConfig.vocab_size`` tokens on the
            training data; a name or path loads that Hugging Face tokenizer (its vocabulary is
            the model's); a mapping is a ``data.tokenizer`` section.
        store_root: the artifact store (default ``artifacts``).
        overrides: dotted fields of the result set last, e.g. ``{"trainer.seed": 1}``.

    Raises:
        ConfigError: one line naming the field, for settings with no equivalent here.
    """
    from lm_pipeline.config import RunConfig
    from lm_pipeline.schema import from_dict

    model, training, data = model or ModelConfig(), training or TrainingConfig(), data or DataConfig()
    devices = num_devices() if devices is None else devices
    if not isinstance(devices, int) or devices < 1:
        raise _refuse("devices", f"must be a positive integer, got {devices!r}")
    trainer, optimizer = _trainer_and_optimizer(training, devices)
    raw: dict[str, Any] = {
        "data": _data_section(data, model, tokenizer),
        "model": _model_section(model),
        "trainer": trainer,
        "optimizer": optimizer,
    }
    if store_root is not None:
        raw["store"] = {"root": store_root}
    return from_dict(RunConfig, _apply(raw, overrides))


def env_overrides() -> list[tuple[str, Any]]:
    """The overrides in ``$LM_PIPELINE_OVERRIDES`` (``key=value`` pairs; none when unset)."""
    from lm_pipeline.config import parse_override_text

    return parse_override_text(os.environ.get(OVERRIDES_ENV), source=f"${OVERRIDES_ENV}")


def train(
    model: ModelConfig | None = None,
    training: TrainingConfig | None = None,
    data: DataConfig | None = None,
    *,
    devices: int | None = None,
    tokenizer: str | Mapping[str, Any] | None = None,
    store_root: str | None = None,
    overrides: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
    hooks: Sequence[Any] = (),
) -> StageResult:
    """Train an LLM-Trainer configuration with this pipeline, as ``lm-pipeline train`` does:
    raw shards -> tokenizer -> token cache -> training, each a content-addressed artifact (a run
    of the same configuration again is a cache hit; an interrupted one resumes).

    ``$LM_PIPELINE_OVERRIDES`` (dotted fields, ``"trainer.num_train_steps=3 model.num_layers=1"``)
    is applied after ``overrides``, as for the Dagster experiments. Returns the ``train_ckpt``
    stage's result: ``.manifest["run_dir"]``, ``.summary["final_step"]``, ``["final_checkpoint"]``.
    """
    from lm_pipeline.steps import Pipeline

    pairs = list(overrides.items()) if isinstance(overrides, Mapping) else list(overrides or ())
    from_env = env_overrides()
    if from_env:
        log.info("applying $%s: %s", OVERRIDES_ENV, ", ".join(f"{k}={v!r}" for k, v in from_env))
    cfg = to_run_config(model, training, data, devices=devices, tokenizer=tokenizer, store_root=store_root,
                        overrides=[*pairs, *from_env])
    pipe = Pipeline(cfg)
    pipe.preflight()
    if isinstance(cfg.optimizer.warmup, int) and cfg.optimizer.warmup > 0 and pipe.cached("train_ckpt") is None:
        train_data = pipe.datasets(pipe.token_cache())[0]
        steps = cfg.trainer.resolve_num_steps(len(train_data), cfg.model.seq_len)
        fitted = fit_warmup(cfg, steps)
        if fitted is not cfg:
            pipe = Pipeline(fitted)  # upstream stages: the same addresses (cache hits)
    return pipe.build("train_ckpt", hooks=hooks)


def fit_warmup(cfg: RunConfig, num_steps: int) -> RunConfig:
    """``cfg``, or when its warmup (steps) is longer than the run: the schedule PyTorch's warmup
    schedules give such a run, which never leaves warmup (the learning rate ramps linearly from 0
    towards ``learning_rate`` and stops at ``num_steps / warmup`` of it). Here: warmup over the whole
    run to ``learning_rate x num_steps / warmup``, then constant; the same learning rate at every
    step. (This project's schedules refuse a warmup longer than the run.)"""
    import dataclasses

    opt = cfg.optimizer
    if not isinstance(opt.warmup, int) or opt.warmup <= num_steps:
        return cfg
    peak = opt.learning_rate * num_steps / opt.warmup
    log.warning("TrainingConfig.warmup_steps (%d) is longer than the run (%d steps): as in PyTorch the learning rate "
                "only ramps up, to %d/%d of learning_rate (optimizer: learning_rate %.3g, warmup %d, constant)",
                opt.warmup, num_steps, num_steps, opt.warmup, peak, num_steps)
    fitted = dataclasses.replace(opt, learning_rate=peak, warmup=num_steps, lr_schedule="constant", decay=None)
    return dataclasses.replace(cfg, optimizer=fitted)
