"""Levanter's config keys that have no field of the same name here: what each does in Levanter
and what this project does with it.

One table (:data:`LEVANTER_KEYS`) drives four things: the error for a key that is refused
("Levanter's `<key>` (what it does) is not supported here: <what to do>"), the one log line for
a key accepted without effect, the one log line saying what a *mapped* key became, and the
feature table of ``docs/training.md``. Keys that *are* fields here (``data.shuffle``,
``optimizer.type``, ...) carry their own translation in their section's ``normalize_raw``; they
say what they became through :func:`note`.

Mapped keys (status ``mapped``) tune *how* a step computes, never what: they are non-semantic
fields of the model config with Levanter's names (:data:`MODEL_COMPUTE_KEYS`; no fingerprint or
run id holds them) that drive this project's own mechanism, the compute plan
(``lm_pipeline.compute.hints_from``), wherever a plan is built: training, evaluation,
generation.

Light on purpose: the schema consults it while parsing, so it imports nothing heavy.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger("lm_pipeline.config")


@dataclass(frozen=True)
class LevanterKey:
    """A Levanter key without a same-named field here.

    ``path``: dotted, list indices dropped (``trainer.tracker.save_xla_dumps``); ``does``: what it
    does in Levanter; ``status``: ``mapped`` (a non-semantic field here that drives this project's
    own mechanism, one log line saying what it became), ``no_effect`` (accepted, one log line) or
    ``refused``; ``here``: for ``mapped``, what it becomes; for ``no_effect``, why it changes
    nothing here (or what does its job); for ``refused``, what to do instead.
    """

    path: str
    does: str
    status: Status
    here: str


Status = Literal["mapped", "no_effect", "refused"]


def _k(path: str, does: str, status: Status, here: str) -> LevanterKey:
    return LevanterKey(path, does, status, here)


LEVANTER_KEYS: tuple[LevanterKey, ...] = (
    # --- how, not what: accepted, no effect on results -------------------------------------
    _k("data.cache_options", "batch size, shard groups and flush size of its cache builder", "no_effect",
       "the token cache builder sizes its own batches and flushes; its unit of work is `data.shard_group_size` "
       "shards, and `data.num_workers` sets the tokenizing processes"),
    _k("model.attn_backend", "which attention implementation to use", "mapped",
       "the compute plan's attention (docs/architecture.md, one compute seam), per device: `vanilla` = `xla` "
       "(jax.nn.dot_product_attention); `jax_flash` = `blocked` on CPU (query blocks, flash-style backward), cuDNN's "
       "flash attention on GPU where it applies (else XLA's), XLA's on TPU; `nvte` = cuDNN's fused attention on GPU; "
       "`splash` = XLA's on TPU; `default`, or a backend without a kernel on the device (one log line), = the plan's "
       "own choice; never strict (a kernel that does not apply to a call falls back); `$LM_PIPELINE_ATTENTION`, when "
       "set, overrides it"),
    _k("model.flash_attention_block_size", "the block size of its flash attention", "mapped",
       "query rows per block of the blocked attention where the plan's attention is `blocked` (e.g. with "
       "`attn_backend: jax_flash` on CPU); other attention forms have no blocks (one log line)"),
    _k("model.cross_entropy_block_size", "the vocabulary block of its blockwise cross-entropy", "mapped",
       "token rows per chunk of the fused LM head + cross-entropy where the plan uses it (CPU): like Levanter's "
       "block, it bounds the logits held at once, but chunks split positions here, not the vocabulary; plans with "
       "full logits (GPU, TPU) do not use it (one log line)"),
    _k("model.scan_layers", "whether the layer stack is a scan", "mapped",
       "the compute plan's layer loop: true = always a scan, false = always unrolled (checkpointed stacks too); "
       "unset = the plan's own rule"),
    _k("model.reference_checkpoint", "the Hugging Face model whose config an export copies", "no_effect",
       "exports write their own config.json from the model section (with `initialize_from_hf: true` it is "
       "the model to start from)"),
    _k("trainer.ray", "starting Ray workers from the trainer", "no_effect",
       "Ray runs through lm-pipeline's Ray launcher (docs/cluster.md), not from the trainer section"),
    _k("trainer.require_accelerator", "failing when no accelerator is found", "no_effect",
       "the run uses the devices JAX finds; `trainer.mp: auto` picks the precision for them"),
    _k("trainer.jax_config", "jax.config options set at start-up", "no_effect",
       "JAX's own defaults are used (jax_threefry_partitionable is already on in this JAX)"),
    _k("trainer.profiler", "the JAX profiler around some steps", "mapped",
       "the same: `jax.profiler` traces steps `profiler_start_step` .. + `profiler_num_steps` (cut at the run's end) "
       "into `<trainer.log_dir>/<run id>/profiler/` (TensorBoard's profile plugin or Perfetto read it)"),
    _k("trainer.profiler_start_step", "the first profiled step", "mapped",
       "the first traced step (0-based, as Levanter; default 5); a run resumed inside the window traces its rest"),
    _k("trainer.profiler_num_steps", "how many steps are profiled", "mapped", "how many steps are traced (default 100)"),
    _k("trainer.profiler_perfetto_link", "a Perfetto link to the profile", "no_effect",
       "no link is made: open the trace under `<trainer.log_dir>/<run id>/profiler/` in Perfetto yourself"),
    _k("trainer.shutdown_at_exit", "shutting the TPU VM down when training ends", "no_effect",
       "the process exits and leaves the machine alone"),
    _k("trainer.allow_nondivisible_batch_size", "a batch that does not divide the devices", "no_effect",
       "the batch must divide the data-parallel devices (checked before any compute)"),
    _k("trainer.checkpointer.append_run_id_to_base_path", "whether checkpoints go under <base_path>/<run id>",
       "no_effect", "checkpoints always go under `<base_path>/<run id>`; `trainer.id` names that directory"),
    _k("trainer.tracker.save_xla_dumps", "uploading XLA dumps to wandb", "no_effect", "no XLA dumps are written"),
    _k("data.configs.<name>.tags", "labels of a mixture's component, its evaluation metrics also grouped by them",
       "no_effect", "each component's validation sets are evaluated and reported as `<component>/<set>`"),
    # --- what, not how: refused until implemented ------------------------------------------
    _k("model.rope", "the rotary embedding and its scaling", "refused",
       "GPT-2 has learned positions; rotary embeddings are the llama family's (type: llama)"),
    _k("model.use_layer_norm_weight", "norms without a learned scale", "refused",
       "GPT-2's LayerNorms always have a scale here; the llama family has `use_layer_norm_weight`"),
    _k("optimizer.cooldown", "a cooldown phase of the schedule", "refused", "use `optimizer.decay` (WSD)"),
    _k("optimizer.haps", "learning-rate cycle boundaries", "refused", "use `optimizer.cycles`"),
    _k("optimizer.weight_decay_modules", "which modules get weight decay", "refused",
       "weight decay applies to matrices here; remove it"),
    _k("optimizer.default_weight_decay_mask", "the default weight decay mask", "refused",
       "weight decay applies to matrices here; remove it"),
    _k("data.vocab_size", "the vocabulary size of its passthrough tokenizer, for data already tokenized", "refused",
       "text is tokenized here by `data.tokenizer`, which gives the vocabulary; remove it"),
)

_BY_PATH = {k.path: k for k in LEVANTER_KEYS}

#: The mapped model keys: each is a non-semantic field of every model family with Levanter's name
#: (``lm_pipeline.compute.hints_from`` reads them); the help text of that field.
MODEL_COMPUTE_KEYS = {
    "attn_backend": "Levanter's attention backend (default, nvte, splash, jax_flash, vanilla), mapped onto the compute "
                    "plan's attention for the device (docs/training.md, Levanter's keys); null = the plan's own choice.",
    "flash_attention_block_size": "Query rows per block of the blocked attention, where the compute plan uses it; "
                                  "null = its own rule.",
    "cross_entropy_block_size": "Token rows per chunk of the fused LM head + cross-entropy, where the compute plan uses "
                                "it; null = about 512.",
    "scan_layers": "The layer stack as a scan (true) or unrolled (false); null = the compute plan's own rule.",
}

#: The mapped trainer keys (non-semantic fields of the trainer section: the profiler around some
#: steps, lm_pipeline.train.profiling); the help text of that field.
TRAINER_PROFILER_KEYS = {
    "profiler": "Trace steps profiler_start_step .. + profiler_num_steps with jax.profiler into "
                "<log_dir>/<run id>/profiler/ (Levanter's trainer.profiler).",
    "profiler_start_step": "The first traced step (0-based).",
    "profiler_num_steps": "How many steps are traced.",
}

#: Levanter's model families (``model.type``) that have no implementation here.
LEVANTER_MODEL_TYPES = {
    "gpt2_hyena": "GPT-2 with Hyena operators instead of attention", "backpack": "Backpack language models",
    "mistral": "Mistral", "mixtral": "Mixtral, a mixture of experts", "gemma": "Gemma", "gemma2": "Gemma 2",
    "gemma3": "Gemma 3", "olmo": "OLMo", "olmo2": "OLMo 2", "olmo3": "OLMo 3", "qwen": "Qwen", "qwen3": "Qwen3",
    "whisper": "Whisper, speech to text",
}


def model_type_refusal(kind: str, valid: list[str]) -> str | None:
    """The one-line message for one of Levanter's model families, or None for any other name."""
    what = LEVANTER_MODEL_TYPES.get(kind)
    if what is None:
        return None
    return f"Levanter's `model.type: {kind}` ({what}) is not supported here: use one of {', '.join(valid)}"

#: Levanter keys whose value null means "Levanter's default": accepted silently when null.
NULL_IS_DEFAULT = ("optimizer.cooldown", "optimizer.haps", "optimizer.weight_decay_modules",
                   "optimizer.default_weight_decay_mask", "data.vocab_size")

_INDEX = re.compile(r"\[\d+\]")
_COMPONENT_KEY = re.compile(r"^data\.configs\..+\.([^.]+)$")  # a mixture component's key (names may hold '.')


def _table_path(path: str) -> str:
    """``path`` as the table writes it: list indices dropped, a component's name as ``<name>``."""
    return _COMPONENT_KEY.sub(r"data.configs.<name>.\1", _INDEX.sub("", path))


def levanter_key(path: str) -> LevanterKey | None:
    """The table's entry for a dotted config path (list indices ignored), if any."""
    return _BY_PATH.get(_table_path(path))


def refusal(key: LevanterKey, path: str) -> str:
    """The one-line message for a refused Levanter key at ``path``."""
    return f"Levanter's `{_INDEX.sub('', path)}` ({key.does}) is not supported here: {key.here}"


_NOTED: set[str] = set()


def note(path: str, text: str, logger: logging.Logger = log) -> None:
    """Log ``text`` about the Levanter key at ``path`` once per process (a config may be loaded
    several times: command line, Pipes child, plan; a plan is built by the trainer, each
    evaluation and generation), on ``logger``."""
    if path not in _NOTED:
        _NOTED.add(path)
        logger.info("%s", text)


def mapped(data: dict, section: str) -> dict:
    """Log once what each mapped key of ``section`` (``model``: :data:`MODEL_COMPUTE_KEYS`,
    ``trainer``: :data:`TRAINER_PROFILER_KEYS`) given in the raw mapping ``data`` becomes;
    ``attn_backend`` spelled as Levanter's enum (``JAX_FLASH``) is read in lower case."""
    from lm_pipeline.schema import ConfigError

    for name, least in (("profiler_start_step", 0), ("profiler_num_steps", 1)) if section == "trainer" else ():
        value = data.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value < least:
            raise ConfigError(name, f"must be at least {least}, got {value}")
    backend = data.get("attn_backend") if section == "model" else None
    if isinstance(backend, str):
        data["attn_backend"] = backend.strip().lower()
    for name in MODEL_COMPUTE_KEYS if section == "model" else TRAINER_PROFILER_KEYS:
        value = data.get(name)
        key = _BY_PATH.get(f"{section}.{name}")
        if value is not None and key is not None and not (name == "profiler" and value is False):
            shown = str(value).lower() if isinstance(value, bool) else value
            note(key.path, f"Levanter's `{key.path}: {shown}` ({key.does}) is mapped here: {key.here}")
    return data


def accept(key: LevanterKey, path: str) -> None:
    """Log once that the Levanter key at ``path`` is accepted and has no effect here (once for all
    of a mixture's components)."""
    where = _table_path(path)
    note(where, f"Levanter's `{where}` ({key.does}) has no effect here: {key.here}")
