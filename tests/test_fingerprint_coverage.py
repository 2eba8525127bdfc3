"""Every config field's effect on the fingerprints, against a table kept here; and golden
fingerprints of the default experiment.

A field that can change an artifact's bytes must change the fingerprint of the first stage that
uses it and of every stage downstream, and of no stage upstream; any other field must change no
fingerprint. Otherwise a stale artifact is served as a cache hit (or a valid one is orphaned).

The expected behaviour comes from :data:`STAGE_OF` and :data:`CONSUMERS` below, written out
independently of the schema's ``semantic`` flags and of the stage table (``lm_pipeline.steps.stages``): the fields
themselves are enumerated from the schema (nested sections and every ``Choice`` member), so a new
field fails until it is classified here. Both hashes are checked: ``Pipeline.config_version``
(config and code versions only) and ``Pipeline.address`` (down to the shards' bytes, on a tiny
corpus written by the tests).

Regenerate the golden file after a deliberate change (and bump the stage's code version in
``lm_pipeline.steps.stages.STAGES`` when what the stage produces changed)::

    .venv/bin/python tests/test_fingerprint_coverage.py --regenerate
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import sys
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import pytest

from lm_pipeline.config import RunConfig, apply_overrides, load_config
from lm_pipeline.fingerprint import canonical_json
from lm_pipeline.schema import Choice, ConfigError, from_dict, to_dict
from lm_pipeline.steps import STAGE_NAMES, STAGES, Pipeline
from lm_pipeline.store import ArtifactStore

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).with_name("golden_fingerprints.json")
DEFAULT_EXPERIMENT = REPO / "configs" / "experiments" / "default.yaml"
REGENERATE = "python tests/test_fingerprint_coverage.py --regenerate"

# --------------------------------------------------------------------------------------------
# The expected behaviour, independent of the code under test
# --------------------------------------------------------------------------------------------

#: Stage -> the stages that read its artifact (with a BPE tokenizer, trained on raw_shards).
CONSUMERS = {
    "raw_shards": ("tokenizer", "token_cache"),
    "tokenizer": ("token_cache",),
    "token_cache": ("train_ckpt", "eval_report"),
    "train_ckpt": ("eval_report", "hf_export", "task_eval"),
    "eval_report": (),
    "hf_export": (),
    "task_eval": (),
}


def downstream(stage: str | tuple[str, ...] | None) -> set[str]:
    """``stage`` (or each of several) and every stage that reads it, directly or not (nothing for None)."""
    out: set[str] = set()
    todo = [stage] if isinstance(stage, str) else list(stage or ())
    while todo:
        s = todo.pop()
        if s not in out:
            out.add(s)
            todo.extend(CONSUMERS[s])
    return out


def _each(stage: str | None, prefix: str, names: str) -> dict[str, str | None]:
    return {f"{prefix}{n}": stage for n in names.split()}


#: Field -> the first stage whose artifact bytes it can change; None: it changes no artifact.
STAGE_OF: dict[str, str | None] = {
    # which records the shards hold and how they are read and validated
    **_each("raw_shards", "data.", "train_urls validation_urls validation format text_key json_records_key "
            "text_unit hf_id hf_name hf_split hf_validation_split hf_revision hf_data_files hf_streaming "
            "hf_shard_rows builtin builtin_max_bytes builtin_validation_fraction min_length on_invalid"),
    # a chat source (format: {type: chat}): how records are read (messages_field), then how they are
    # rendered into tokens and the loss mask (the token cache's), then how conversations become
    # rows (pack: read from the cache by the run, like data.packing)
    "data.chat.messages_field": "raw_shards",
    **_each("token_cache", "data.chat.", "chat_template single_turn mask_user_turns"),
    "data.chat.pack": "train_ckpt",
    **_each("tokenizer", "data.tokenizer.", "kind vocab_size min_frequency special_tokens max_train_chars "
            "name_or_path revision eos_token"),
    # what determines the weights
    "data.packing": "train_ckpt",
    "data.shuffle": "train_ckpt",  # the row order
    "data.era_length": "train_ckpt",  # with data.shuffle: era (SPECIAL)
    **_each("train_ckpt", "model[gpt2].", "type seq_len hidden_dim num_layers num_heads mlp_scale "
            "initializer_range embed_pdrop resid_pdrop attn_pdrop layer_norm_epsilon activation_function "
            "scale_attn_by_inverse_layer_idx upcast_attn use_bias"),
    **_each("train_ckpt", "model[llama].", "type seq_len hidden_dim intermediate_dim num_layers num_heads "
            "num_kv_heads head_dim activation_function initializer_range layer_norm_epsilon rope_theta "
            "tie_word_embeddings use_bias upcast_attn use_layer_norm_weight"),
    **_each("train_ckpt", "model[llama].rope_scaling.", "type factor original_max_position_embeddings "
            "low_freq_factor high_freq_factor beta_fast beta_slow mscale mscale_all_dim attention_factor"),
    **_each("train_ckpt", "trainer.", "seed num_train_steps num_epochs train_tokens train_batch_size mp "
            "initialize_from max_epochs z_loss_weight"),
    **_each("train_ckpt", "trainer.quantization.", "fp8 int8 targets"),  # fp8 changes results (fp8 GPUs only)
    **_each("train_ckpt", "optimizer.", "learning_rate weight_decay beta1 beta2 epsilon max_grad_norm "
            "lr_schedule min_lr_ratio warmup decay rewarmup cycles cycle_length skip_bad_steps "
            "skip_grad_norm_factor skip_warmup_steps skip_ema_decay type momentum adam_lr gamma update_interval "
            "ema_beta"),
    **_each("eval_report", "eval.", "batch_size max_eval_batches unigram_baseline"),
    "eval.compute_dtype": ("eval_report", "task_eval"),  # both evaluations run in it
    **_each("hf_export", "export.", "max_shard_size dtype"),
    # no artifact: worker counts, recomputation, cadence, layout, paths, resumption, trackers
    **_each(None, "data.", "cache_dir num_workers shard_group_size"),
    # a mixture: its components' sources are read into raw_shards; how rows are drawn from them
    # (the weights, the stop strategy, the block) changes the run only
    "data.configs": "raw_shards",
    **_each("train_ckpt", "data.", "train_weights stop_strategy mixture_block_size"),
    "model[gpt2].gradient_checkpointing": None,
    "model[llama].gradient_checkpointing": None,
    # how the step computes (Levanter's keys mapped onto the compute plan): same results up to rounding
    **_each(None, "model[gpt2].", "attn_backend flash_attention_block_size cross_entropy_block_size scan_layers"),
    **_each(None, "model[llama].", "attn_backend flash_attention_block_size cross_entropy_block_size scan_layers"),
    **_each(None, "trainer.", "per_device_parallelism gradient_accumulation_steps device_memory_gib per_device_eval_parallelism "
            "steps_per_eval max_eval_batches log_every progress id log_dir profiler profiler_start_step "
            "profiler_num_steps load_checkpoint "
            "load_checkpoint_path batch_axis fsdp_axis tensor_parallel_axes model_axis_size axis_resources "
            "parameter_axis_resources compute_axis_resources"),
    **_each(None, "trainer.checkpointer.", "base_path save_interval keep.every keep.until keep_last keep_best"),
    **_each(None, "trainer.distributed.", "coordinator_address num_processes process_id local_device_ids "
            "initialize"),
    "trainer.tracker[jsonl].type": None, "trainer.tracker[jsonl].path": None,
    "trainer.tracker[tensorboard].type": None, "trainer.tracker[tensorboard].logdir": None,
    **_each(None, "trainer.tracker[wandb].", "type project entity tags id name group resume mode save_code"),
    "trainer.tracker[noop].type": None,
    "eval.report_dir": None,
    **_each(None, "export.", "hf_save_steps hf_save_path hf_upload hf_upload_private"),
    "store.root": None,
    # downstream tasks (lm-evaluation-harness): the task_eval stage (batching and samples change no score)
    **_each("task_eval", "eval_harness.", "max_examples max_eval_length bootstrap_iters apply_chat_template "
            "include_path add_bos_token"),
    **_each(None, "eval_harness.", "log_samples batch_size"),
    **_each("task_eval", "eval_harness.task_spec.", "task task_alias num_fewshot use_prompt description "
            "target_delimiter fewshot_delimiter doc_to_text doc_to_target doc_to_choice"),
    "eval_harness_steps": None,
    # continued pretraining: the starting weights enter train_ckpt by content (an input, not the
    # path); use_hf_model_config acts through the model and tokenizer fields it fills in
    "initialize_from_hf": "train_ckpt",
    "use_hf_model_config": None,
}

#: Fields kept in the schema only to refuse any value but the default with a message saying why.
REFUSED: set[str] = set()

# --------------------------------------------------------------------------------------------
# A tiny experiment over a fixed corpus (relative paths: the tests run inside its directory)
# --------------------------------------------------------------------------------------------

CORPUS = {
    "train-0.jsonl": ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n    y: int = 0\n"],
    "train-1.jsonl": ["for i in range(10):\n    print(i * i)\n", "import os\nprint(os.getcwd())\n"],
    "validation.jsonl": ["while True:\n    break\n"],
    "extra.jsonl": ["x = [n for n in range(3)]\n"],
}

BASE: dict[str, Any] = {
    "data": {"train_urls": ["train-0.jsonl", "train-1.jsonl"], "validation_urls": ["validation.jsonl"],
             "tokenizer": {"kind": "bpe", "vocab_size": 300}},
    "model": {"type": "gpt2", "seq_len": 32, "hidden_dim": 32, "num_heads": 2, "num_layers": 1},
    "trainer": {"num_train_steps": 6, "train_batch_size": 4, "checkpointer": {"keep": [{"every": 3}]}},
    "optimizer": {"learning_rate": 1.0e-3, "warmup": 0.0},
    "store": {"root": "store"},
    "eval_harness": {"task_spec": ["hellaswag"]},  # task_eval applies (a hub task: nothing read to address it)
}

_NO_FILES = {"data.train_urls": [], "data.validation_urls": []}
_MIXTURE = {"data.train_urls": [], "data.validation_urls": [],
            "data.configs": {"web": {"train_urls": ["train-0.jsonl", "train-1.jsonl"],
                                     "validation_urls": ["validation.jsonl"]}},
            "data.train_weights": {"web": 1.0}}
_HF = {**_NO_FILES, "data.hf_id": "some-org/some-dataset"}

_CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
                  "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}")

#: Changes the generic rule (bool flip, int + 1, float * 2, another choice, ...) cannot make:
#: field -> (edits of the base config, the new value). Base edits may only make the change valid
#: (one training source, one run length); the two configs still differ in the field alone.
SPECIAL: dict[str, tuple[dict[str, Any], Any]] = {
    "data.train_urls": ({}, ["train-0.jsonl", "train-1.jsonl", "extra.jsonl"]),
    "data.validation_urls": ({}, ["validation.jsonl", "extra.jsonl"]),
    "data.validation": ({}, {"extra": ["extra.jsonl"]}),
    "data.hf_id": (_NO_FILES, "some-org/some-dataset"),
    "data.hf_validation_split": (_HF, "test"),
    "data.hf_data_files": (_HF, ["part-0.jsonl"]),
    "data.builtin": (_NO_FILES, "python_stdlib"),
    "data.tokenizer.kind": ({"data.tokenizer.name_or_path": "some-org/some-tokenizer"}, "hf"),
    "trainer.num_epochs": ({"trainer.num_train_steps": None}, 2.0),
    "data.era_length": ({"data.shuffle": "era"}, 1024),
    "data.configs": (_MIXTURE, {**_MIXTURE["data.configs"], "extra": {"train_urls": ["extra.jsonl"]}}),
    "data.train_weights": ({**_MIXTURE, "data.configs": {**_MIXTURE["data.configs"], "code": {"train_urls": ["extra.jsonl"]}}},
                           {"web": 0.5, "code": 0.5}),
    "data.stop_strategy": (_MIXTURE, "first_exhausted"),
    "data.mixture_block_size": (_MIXTURE, 1024),
    "trainer.train_tokens": ({"trainer.num_train_steps": None}, 4096),
    "trainer.mp": ({}, "p=f32,c=bfloat16"),
    "initialize_from_hf": ({}, "hf-start"),
    "use_hf_model_config": ({"initialize_from_hf": "hf-start"}, True),
    "trainer.axis_resources": ({}, {"batch": "data"}),
    "trainer.parameter_axis_resources": ({}, {"embed": "data"}),
    "trainer.compute_axis_resources": ({}, {"batch": "data"}),
    "trainer.checkpointer.save_interval": ({}, "11m"),
    "eval.compute_dtype": ({}, "bfloat16"),
    "export.max_shard_size": ({}, "2GB"),
    # a chat source needs a template with the BPE tokenizer trained here: the base gives one
    **{f"data.chat.{k}": ({"data.chat": {"chat_template": _CHAT_TEMPLATE}}, v) for k, v in {
        "messages_field": "conversation", "chat_template": _CHAT_TEMPLATE + "\n", "pack": False,
        "mask_user_turns": False}.items()},
    "data.chat.single_turn": ({"data.chat": {}, "data.tokenizer.name_or_path": "some-org/some-tokenizer",
                               "data.tokenizer.kind": "hf"}, True),
    **{f"trainer.quantization.{k}": ({"trainer.quantization": {}}, v) for k, v in
       {"fp8": True, "int8": True, "targets": ["attn"]}.items()},
    # rope_scaling is absent by default: the base has one of the type the field belongs to
    **{f"model[llama].rope_scaling.{k}": ({"model.rope_scaling": {"type": t}}, v) for k, (t, v) in {
        "type": ("yarn", "llama3"), "factor": ("yarn", 3.0), "original_max_position_embeddings": ("yarn", 4096),
        "low_freq_factor": ("llama3", 2.0), "high_freq_factor": ("llama3", 8.0), "beta_fast": ("yarn", 16.0),
        "beta_slow": ("yarn", 2.0), "mscale": ("yarn", 1.0), "mscale_all_dim": ("yarn", 1.0),
        "attention_factor": ("yarn", 1.5)}.items()},
    # the eval_harness section is absent by default: the base has one with a task
    **{f"eval_harness.{k}": ({"eval_harness.task_spec": [{"task": "hellaswag"}]}, v) for k, v in {
        "max_examples": 10, "max_eval_length": 32, "log_samples": True, "bootstrap_iters": 10,
        "apply_chat_template": True, "include_path": ["validation.jsonl"], "batch_size": 4, "add_bos_token": True,
        "task_spec.task": "arc_easy", "task_spec.task_alias": "hs", "task_spec.num_fewshot": 5,
        **{f"task_spec.{t}": "{{x}}" for t in ("use_prompt description target_delimiter fewshot_delimiter "
                                                "doc_to_text doc_to_target doc_to_choice").split()}}.items()},
}


def write_corpus(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, texts in CORPUS.items():
        (root / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    # a Hugging Face directory of BASE's model shape (initialize_from_hf): the fingerprint reads
    # config.json and hashes the safetensors files' bytes, which need not be real weights here
    from lm_pipeline.models import Gpt2Config
    from lm_pipeline.models.hf_mapping import hf_config

    hf = root / "hf-start"
    hf.mkdir(exist_ok=True)
    shape = {k: v for k, v in BASE["model"].items() if k != "type"}
    (hf / "config.json").write_text(json.dumps(hf_config(Gpt2Config(**shape), 300)), encoding="utf-8")
    (hf / "model.safetensors").write_bytes(b"weights")
    return root


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The fixed corpus's directory, as the working directory of this module's tests."""
    root = write_corpus(tmp_path_factory.mktemp("fingerprints"))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        yield root


# --------------------------------------------------------------------------------------------
# The schema's leaf fields
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Leaf:
    name: str  # e.g. "trainer.tracker[wandb].project"
    keys: tuple  # its place in the raw config: ("trainer", "tracker", 0, "project")
    tp: Any
    members: tuple = ()  # ((keys of a Choice section, its family, member name), ...) the base must select
    selects_member: bool = False  # the `type` field of a Choice member


def _sections(tp: Any, in_sequence: bool = False) -> list[tuple[str | None, type, bool]]:
    """Config classes inside a type: (Choice member name or None, class, inside a sequence)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return [s for arg in typing.get_args(tp) for s in _sections(arg, in_sequence)]
    if origin in (tuple, list):
        return _sections(typing.get_args(tp)[0], True) if typing.get_args(tp) else []
    if isinstance(tp, type) and issubclass(tp, Choice):
        return [(name, cls, in_sequence) for name, cls in sorted(tp.family().registry.items())]
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return [(None, tp, in_sequence)]
    return []


def leaves(cls: type = RunConfig, name: str = "", keys: tuple = (), members: tuple = ()) -> list[Leaf]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path, where = f"{name}.{f.name}" if name else f.name, (*keys, f.name)
        subs = _sections(hints[f.name])
        for member, sub, in_sequence in subs:
            at = (*where, 0) if in_sequence else where
            chosen = (*members, (at, sub.family(), member)) if member else members
            out += leaves(sub, f"{path}[{member}]" if member else path, at, chosen)
        if not subs:
            selects = f.name == "type" and issubclass(cls, Choice)
            out.append(Leaf(path, where, hints[f.name], members, selects))
    return out


LEAVES = leaves()

# --------------------------------------------------------------------------------------------
# Making a config that differs in one field
# --------------------------------------------------------------------------------------------


def _get(raw: Any, keys: tuple) -> Any:
    for k in keys:
        raw = raw[k]
    return raw


def _set(raw: Any, keys: tuple, value: Any) -> None:
    """Set ``raw[k0][k1]... = value``, creating missing mappings and list items."""
    for k, nxt in zip(keys, keys[1:], strict=False):
        if isinstance(raw, list) and k == len(raw):
            raw.append({})
        elif isinstance(raw, dict) and raw.get(k) is None:
            raw[k] = [] if isinstance(nxt, int) else {}
        raw = raw[k]
    if isinstance(raw, list) and keys[-1] == len(raw):
        raw.append(value)
    else:
        raw[keys[-1]] = value


def _fits(tp: Any, value: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (tuple, list):
        return isinstance(value, (tuple, list))
    if origin is dict:
        return isinstance(value, dict)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(tp, type) and isinstance(value, tp)


def candidates(tp: Any, value: Any) -> list[Any]:
    """Other values of type ``tp`` than ``value``, the most natural first (some may be invalid)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        out = [c for a in args for c in candidates(a, value if _fits(a, value) else None)]
        return out + ([None] if value is not None and type(None) in typing.get_args(tp) else [])
    if origin is Literal:
        return [a for a in typing.get_args(tp) if a != value]
    if tp is bool:
        return [True, False] if value is None else [not value]
    if tp is int:
        return [1, 2, 8] if value is None else [value + 1, value * 2, value - 1, 1, 2]
    if tp is float:
        return [0.5, 2.0] if value is None else [value * 2, value / 2, value + 0.5, 0.5]
    if tp is str:
        return ["changed"] if value is None else [f"{value}_changed", "changed"]
    if origin in (tuple, list):
        return [[*(value or ()), c] for c in candidates(typing.get_args(tp)[0], None)[:1]]
    if origin is dict:
        return [{**(value or {}), "changed": c} for c in candidates(typing.get_args(tp)[1], None)]
    return []


def _resolved(raw: dict[str, Any]) -> dict[str, Any]:
    return to_dict(from_dict(RunConfig, raw))


def _flat(obj: Any, prefix: tuple = ()) -> dict[tuple, Any]:
    if isinstance(obj, dict) and obj:
        return {k: v for key, sub in obj.items() for k, v in _flat(sub, (*prefix, key)).items()}
    if isinstance(obj, list) and obj:
        return {k: v for i, sub in enumerate(obj) for k, v in _flat(sub, (*prefix, i)).items()}
    return {prefix: obj}


def base_config(leaf: Leaf) -> dict[str, Any]:
    """The resolved base config for ``leaf``: its Choice members selected, its base edits made."""
    raw = copy.deepcopy(BASE)
    for keys, _, member in leaf.members:
        try:
            present = _get(raw, keys).get("type")
        except (KeyError, IndexError, TypeError):
            present = None
        if present != member:
            _set(raw, keys, {"type": member})
    edits = SPECIAL.get(leaf.name, ({}, None))[0]
    return _resolved(apply_overrides(raw, list(edits.items())))


def changed_config(leaf: Leaf, base: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``leaf`` set to a different valid value (checked: no other field differs)."""
    if leaf.selects_member:  # the only other value of `type` is another member of the family
        keys, family, member = leaf.members[-1]
        others = [m for m in family.registry if m != member]
        if not others:
            pytest.skip(f"{leaf.name}: {family.__name__} has one member; its type cannot change")
        raw = copy.deepcopy(base)
        _set(raw, keys, {"type": sorted(others)[0]})
        return _resolved(raw)
    tried = []
    given = leaf.name in SPECIAL
    for value in [SPECIAL[leaf.name][1]] if given else candidates(leaf.tp, _get(base, leaf.keys)):
        raw = copy.deepcopy(base)
        _set(raw, leaf.keys, value)
        try:
            new = _resolved(raw)
        except (ConfigError, ValueError, TypeError) as e:
            tried.append(f"{value!r} ({e})")
            continue
        if canonical_json(new) == canonical_json(base):
            tried.append(f"{value!r} (no change)")
            continue
        a, b = _flat(base), _flat(new)
        others = [".".join(map(str, k)) for k in set(a) | set(b)
                  if a.get(k, "<absent>") != b.get(k, "<absent>") and k[: len(leaf.keys)] != leaf.keys]
        assert not others, f"{leaf.name}: the change to {value!r} also changed {sorted(others)}; fix SPECIAL"
        return new
    pytest.fail(f"{leaf.name}: no valid changed value (tried {'; '.join(tried) or 'nothing'}); "
                f"add one to SPECIAL in {Path(__file__).name}")


# --------------------------------------------------------------------------------------------
# Fingerprints (cached by config: many fields share a base)
# --------------------------------------------------------------------------------------------

_FINGERPRINTS: dict[str, dict[str, dict[str, str] | None]] = {}


def reads_only_local_files(raw: dict[str, Any]) -> bool:
    """Whether addressing it is cheap: training data from the corpus's files (no hub, no builtin)."""
    data = raw["data"]
    return bool(data["train_urls"]) and data["hf_id"] is None and data["builtin"] is None


def fingerprints(raw: dict[str, Any]) -> dict[str, dict[str, str] | None]:
    """Config version and (where affordable) address of every stage of config ``raw``."""
    key = canonical_json(raw)
    if key not in _FINGERPRINTS:
        pipe = Pipeline(from_dict(RunConfig, raw), progress=False)
        _FINGERPRINTS[key] = {
            "config_version": pipe.config_versions(),
            "address": {s: pipe.address(s).fingerprint for s in pipe.stages} if reads_only_local_files(raw) else None,
        }
    return _FINGERPRINTS[key]


def _differ(a: dict[str, str], b: dict[str, str]) -> set[str]:
    return {s for s in STAGE_NAMES if a.get(s) != b.get(s)}  # a stage may not apply (task_eval without tasks)


def _order(stages: set[str]) -> list[str]:
    return [s for s in STAGE_NAMES if s in stages]


# --------------------------------------------------------------------------------------------
# Tests: every field
# --------------------------------------------------------------------------------------------


def test_every_config_field_is_classified():
    names = {leaf.name for leaf in LEAVES}
    unclassified = sorted(names - set(STAGE_OF))
    assert not unclassified, (
        f"new config fields {unclassified}: classify each in STAGE_OF in {Path(__file__).name}: the first "
        "stage whose artifact's bytes it can change (raw_shards, tokenizer, token_cache, train_ckpt, "
        "eval_report, hf_export), or None if it changes no artifact; then give it the matching "
        "`semantic=` flag and put it in that stage's config in lm_pipeline.steps.stages")
    assert not set(STAGE_OF) - names, f"STAGE_OF names fields the schema no longer has: {sorted(set(STAGE_OF) - names)}"
    assert set(CONSUMERS) == set(STAGE_NAMES), f"the stages changed ({STAGE_NAMES}): update CONSUMERS"
    assert {s for v in STAGE_OF.values() for s in ((v,) if isinstance(v, str) else v or ())} <= set(STAGE_NAMES)


@pytest.mark.allow_skip_in_ci(reason="a config Choice family with one member has no other type to change to")
@pytest.mark.parametrize("leaf", LEAVES, ids=lambda leaf: leaf.name)
def test_field_changes_its_stage_and_everything_downstream_only(leaf, workdir):
    if leaf.name not in STAGE_OF:
        pytest.fail(f"{leaf.name} is not classified: see test_every_config_field_is_classified")
    if leaf.name in REFUSED:  # any value but the default fails validation: nothing to fingerprint
        raw = copy.deepcopy(base_config(leaf))
        _set(raw, leaf.keys, "somewhere")
        with pytest.raises(ConfigError, match=leaf.name.rsplit(".", 1)[-1]):
            _resolved(raw)
        return
    first = STAGE_OF[leaf.name]
    expected = downstream(first)
    base = base_config(leaf)
    before, after = fingerprints(base), fingerprints(changed_config(leaf, base))
    what = f"stages {_order(expected)} (from {first})" if first else "no stage (not semantic)"
    problems = []
    for kind in ("config_version", "address"):
        if before[kind] is not None and after[kind] is not None:
            got = _differ(before[kind], after[kind])
            if got != expected:
                problems.append(f"{kind} changed for {_order(got)}: missing {_order(expected - got)}, "
                                f"unexpected {_order(got - expected)}")
    assert not problems, (
        f"changing {leaf.name} must change the fingerprints of {what}, but " + "; ".join(problems) + ". "
        "A missing stage serves a stale artifact as a cache hit: check the field's `semantic=` flag, the "
        "stage's config and inputs in lm_pipeline.steps.stages, and STAGE_OF here.")


# --------------------------------------------------------------------------------------------
# Tests: what enters the hash besides the config
# --------------------------------------------------------------------------------------------


def _all(raw: dict[str, Any], stages=STAGES) -> dict[str, dict[str, str]]:
    pipe = Pipeline(from_dict(RunConfig, raw), progress=False, stages=stages)  # fresh: no memo, no shared cache
    return {"config_version": pipe.config_versions(), "address": {s: pipe.address(s).fingerprint for s in pipe.stages}}


@pytest.mark.parametrize("stage", STAGE_NAMES)
def test_code_version_changes_its_stage_and_everything_downstream(stage, workdir):
    raw = _resolved(BASE)
    before = _all(raw)
    bumped = tuple(dataclasses.replace(s, code_version=s.code_version + 1) if s.name == stage else s for s in STAGES)
    after = _all(raw, bumped)
    for kind in ("config_version", "address"):
        assert _differ(before[kind], after[kind]) == downstream(stage), (
            f"bumping the code version of {stage!r} must change the {kind} of {_order(downstream(stage))}")


@pytest.mark.parametrize("shard", ["train-1.jsonl", "validation.jsonl"])
def test_shard_bytes_change_every_address_but_no_config_version(shard, tmp_path, monkeypatch):
    monkeypatch.chdir(write_corpus(tmp_path))
    raw = _resolved(BASE)
    before = _all(raw)
    with open(shard, "a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "print('one more record')\n"}) + "\n")
    after = _all(raw)
    assert _differ(before["address"], after["address"]) == set(STAGE_NAMES), "every stage reads the shards' bytes"
    assert _differ(before["config_version"], after["config_version"]) == set()


def test_local_tokenizer_is_named_by_its_content_not_its_path(tmp_path, monkeypatch):
    monkeypatch.chdir(write_corpus(tmp_path))
    for name, content in (("tok-a", "{}"), ("tok-b", "{}"), ("tok-c", '{"changed": 1}')):
        Path(name).mkdir()
        Path(name, "tokenizer.json").write_text(content)
    a, b, c = (_all(_resolved(apply_overrides(copy.deepcopy(BASE), [("data.tokenizer", {"kind": "hf", "name_or_path": n})])))
               for n in ("tok-a", "tok-b", "tok-c"))
    for kind in ("config_version", "address"):
        assert _differ(a[kind], b[kind]) == set(), f"{kind}: moving a local tokenizer must change nothing"
        assert _differ(a[kind], c[kind]) == downstream("tokenizer"), f"{kind}: the tokenizer's content must count"


# --------------------------------------------------------------------------------------------
# Golden fingerprints of the default experiment
# --------------------------------------------------------------------------------------------

#: The default experiment's data replaced by the fixed corpus (the built-in corpus is the running
#: Python's standard library: its bytes differ between machines).
GOLDEN_DATA = {"data.builtin": None, "data.train_urls": ["train-0.jsonl", "train-1.jsonl"],
               "data.validation_urls": ["validation.jsonl"]}


def golden_fingerprints() -> dict[str, dict[str, str]]:
    """Config versions of configs/default.yaml, and addresses of it over the fixed corpus in the
    working directory, its ``trainer.mp: auto`` resolved as on a CPU without bf16 dot instructions
    (``f32``; the policy ``auto`` picks depends on the machine: ``lm_pipeline.train.precision``)."""
    from unittest import mock

    from lm_pipeline import hostinfo

    store = ArtifactStore("store")  # relative: never the experiment's own store
    with mock.patch.dict(os.environ, {"JAX_PLATFORMS": "cpu"}), \
            mock.patch.object(hostinfo, "cpu_flags", lambda: "avx avx2 fma sse4_2"):
        versions = Pipeline(load_config(DEFAULT_EXPERIMENT), store, progress=False).config_versions()
        pipe = Pipeline(load_config(DEFAULT_EXPERIMENT, GOLDEN_DATA), store, progress=False)
        return {"config_version": versions, "address": {s: pipe.address(s).fingerprint for s in pipe.stages}}


def test_default_experiment_fingerprints_are_golden(workdir):
    assert GOLDEN.is_file(), f"{GOLDEN.name} is missing: create it with `{REGENERATE}`"
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    now = golden_fingerprints()
    diffs = [f"{kind} of {stage}: {golden.get(kind, {}).get(stage)} -> {fp}"
             for kind, fps in now.items() for stage, fp in fps.items() if golden.get(kind, {}).get(stage) != fp]
    assert not diffs, (
        "the default experiment's fingerprints changed:\n  " + "\n  ".join(diffs) + "\n"
        "Every artifact already built for these stages stops being found, and if the change dropped "
        "something from the hash, stale artifacts would be served. If this change is deliberate, bump "
        "the stage's code version in lm_pipeline.steps.stages.STAGES (when what the stage produces "
        f"changed) and regenerate with `{REGENERATE}`.")


def regenerate() -> None:
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(write_corpus(Path(tmp))):
        fps = golden_fingerprints()
    GOLDEN.write_text(json.dumps({"regenerate": REGENERATE, **fps}, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit(f"usage: {REGENERATE}")
    regenerate()


def test_the_configuration_references_fingerprint_column_is_what_the_fingerprints_do():
    """docs/configuration.md says per field whether it is part of a fingerprint; that column must
    agree with :data:`STAGE_OF` (checked against the real hashes above) for every field."""
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text(encoding="utf-8")
    section = None
    said: dict[str, bool] = {}
    for line in text.splitlines():
        m = re.match(r"^## `([^`]*)`", line)
        if m:
            raw = m.group(1)
            kind = re.match(r"^(.*) \(type: (\w+)\)$", raw)
            section = f"{kind.group(1)}[{kind.group(2)}]" if kind else ("" if raw == "(top level)" else raw)
            continue
        row = re.match(r"^\| `(\w+)`[^|]*\|.*\| (yes|no) \|$", line)
        if row and section is not None:
            name = f"{section}.{row.group(1)}" if section else row.group(1)
            said[name] = row.group(2) == "yes"
    classified = {name: stage is not None for name, stage in STAGE_OF.items()}
    common = set(said) & set(classified)
    assert len(common) >= 0.9 * len(classified), sorted(set(classified) - set(said))[:20]
    wrong = sorted(n for n in common if said[n] != classified[n])
    assert not wrong, f"docs/configuration.md's fingerprint column is wrong for {wrong}"
