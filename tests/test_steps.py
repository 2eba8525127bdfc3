"""The pipeline stages as content-addressed steps: which fields are semantic, what each edit
re-runs, run ids, the plan, and the fan-out token cache (equal to the single-process one)."""

from __future__ import annotations

import dataclasses
import io
import json
import types
import typing
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest
from helpers import pipeline as pt

from lm_pipeline.config import RunConfig, load_config
from lm_pipeline.schema import Choice
from lm_pipeline.steps import STAGES, Pipeline, complete_checkpoints
from lm_pipeline.store import ArtifactStore

# --------------------------------------------------------------------------------------------
# Which fields enter fingerprints: pinned field by field. A new config field fails this test
# until it is classified here (True = semantic: it can change an artifact's bytes).
# --------------------------------------------------------------------------------------------

EXPECTED_SEMANTIC = {
    # data: sources and validation policy (raw_shards), tokenizer, packing (train_ckpt)
    "data.train_urls": True, "data.validation_urls": True, "data.validation": True, "data.format": True,
    "data.text_key": True, "data.json_records_key": True, "data.text_unit": True, "data.hf_id": True,
    "data.hf_name": True, "data.hf_split": True, "data.hf_validation_split": True, "data.hf_revision": True,
    "data.hf_data_files": True, "data.hf_streaming": True, "data.hf_shard_rows": True, "data.builtin": True,
    "data.builtin_max_bytes": True, "data.builtin_validation_fraction": True, "data.min_length": True,
    "data.on_invalid": True,
    "data.tokenizer.kind": True, "data.tokenizer.vocab_size": True, "data.tokenizer.min_frequency": True,
    "data.tokenizer.special_tokens": True, "data.tokenizer.max_train_chars": True,
    "data.tokenizer.name_or_path": True, "data.tokenizer.revision": True, "data.tokenizer.eos_token": True,
    "data.packing": True, "data.shuffle": True, "data.era_length": True,
    "data.cache_dir": False, "data.num_workers": False, "data.shard_group_size": False,
    # a mixture: its components' sources (as the section's own, cache_dir aside) and how rows are drawn
    "data.train_weights": True, "data.stop_strategy": True, "data.mixture_block_size": True,
    **{f"data.configs.{f}": True for f in (
        "train_urls", "validation_urls", "validation", "format", "text_key", "json_records_key", "text_unit", "hf_id",
        "hf_name", "hf_split", "hf_validation_split", "hf_revision", "hf_data_files", "hf_streaming", "hf_shard_rows",
        "builtin", "builtin_max_bytes", "builtin_validation_fraction", "min_length", "on_invalid")},
    "data.configs.cache_dir": False,
    # a chat source (format: {type: chat}), the section's own or a component's: reading and rendering
    **{f"{where}.chat.{f}": True for where in ("data", "data.configs") for f in (
        "messages_field", "chat_template", "single_turn", "pack", "mask_user_turns")},
    # model families
    **{f"model[gpt2].{f}": True for f in (
        "type", "seq_len", "hidden_dim", "num_layers", "num_heads", "mlp_scale", "initializer_range", "embed_pdrop",
        "resid_pdrop", "attn_pdrop", "layer_norm_epsilon", "activation_function", "scale_attn_by_inverse_layer_idx",
        "upcast_attn", "use_bias")},
    "model[gpt2].gradient_checkpointing": False,
    **{f"model[llama].{f}": True for f in (
        "type", "seq_len", "hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
        "activation_function", "initializer_range", "layer_norm_epsilon", "rope_theta", "tie_word_embeddings",
        "use_bias", "upcast_attn")},
    "model[llama].gradient_checkpointing": False,
    # trainer: what determines the weights is semantic; cadence, layout, paths, trackers are not
    "trainer.seed": True, "trainer.num_train_steps": True, "trainer.num_epochs": True, "trainer.train_tokens": True,
    "trainer.train_batch_size": True, "trainer.mp": True, "trainer.initialize_from": True,
    "trainer.per_device_parallelism": False, "trainer.gradient_accumulation_steps": False, "trainer.device_memory_gib": False, "trainer.per_device_eval_parallelism": False,
    "trainer.steps_per_eval": False, "trainer.max_eval_batches": False, "trainer.log_every": False,
    "trainer.progress": False, "trainer.id": False, "trainer.log_dir": False,
    "trainer.checkpointer.base_path": False, "trainer.checkpointer.save_interval": False,
    "trainer.checkpointer.keep.every": False, "trainer.checkpointer.keep.until": False,
    "trainer.checkpointer.keep_last": False, "trainer.checkpointer.keep_best": False,
    "trainer.tracker[jsonl].type": False, "trainer.tracker[jsonl].path": False,
    "trainer.tracker[tensorboard].type": False, "trainer.tracker[tensorboard].logdir": False,
    **{f"trainer.tracker[wandb].{f}": False for f in (
        "type", "project", "entity", "tags", "id", "name", "group", "resume", "mode", "save_code")},
    "trainer.tracker[noop].type": False,
    "trainer.load_checkpoint": False, "trainer.load_checkpoint_path": False, "trainer.batch_axis": False,
    "trainer.fsdp_axis": False, "trainer.tensor_parallel_axes": False, "trainer.model_axis_size": False,
    "trainer.axis_resources": False, "trainer.parameter_axis_resources": False,
    "trainer.compute_axis_resources": False,
    "trainer.distributed.coordinator_address": False, "trainer.distributed.num_processes": False,
    "trainer.distributed.process_id": False, "trainer.distributed.local_device_ids": False,
    "trainer.distributed.initialize": False,
    # optimizer: all semantic
    **{f"optimizer.{f}": True for f in (
        "learning_rate", "weight_decay", "beta1", "beta2", "epsilon", "max_grad_norm", "lr_schedule", "min_lr_ratio",
        "warmup", "decay", "rewarmup", "cycles", "cycle_length", "skip_bad_steps", "skip_grad_norm_factor",
        "skip_warmup_steps", "skip_ema_decay")},
    "store.root": False,
    "initialize_from_hf": False, "use_hf_model_config": False,  # the weights enter train_ckpt by content
    # evaluation (eval_report) and export (hf_export) settings
    "eval.batch_size": True, "eval.max_eval_batches": True, "eval.compute_dtype": True,
    "eval.unigram_baseline": True, "eval.report_dir": False,
    "export.hf_save_steps": False, "export.hf_save_path": False, "export.hf_upload": False,
    "export.hf_upload_private": False, "export.max_shard_size": True, "export.dtype": True,
    # downstream tasks (task_eval): what changes a score; batching and the samples file do not
    **{f"eval_harness.{f}": True for f in (
        "max_examples", "max_eval_length", "bootstrap_iters", "apply_chat_template", "include_path", "add_bos_token")},
    "eval_harness.log_samples": False, "eval_harness.batch_size": False,
    **{f"eval_harness.task_spec.{f}": True for f in (
        "task", "task_alias", "num_fewshot", "use_prompt", "description", "target_delimiter", "fewshot_delimiter",
        "doc_to_text", "doc_to_target", "doc_to_choice")},
    "eval_harness_steps": False,
    # Levanter's training features: each changes the weights or what is evaluated and exported
    **{f"model[llama].rope_scaling.{f}": True for f in (
        "type", "factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "beta_fast",
        "beta_slow", "attention_factor", "mscale", "mscale_all_dim")},
    "model[llama].use_layer_norm_weight": True,
    **{f"optimizer.{f}": True for f in ("type", "adam_lr", "ema_beta", "gamma", "momentum", "update_interval")},
    **{f"trainer.{f}": True for f in ("max_epochs", "z_loss_weight", "quantization.fp8", "quantization.int8",
                                      "quantization.targets")},    # Levanter's how-not-what keys: they change the compute plan, not the results
    **{f"model[{m}].{f}": False for m in ("gpt2", "llama") for f in (
        "attn_backend", "cross_entropy_block_size", "flash_attention_block_size", "scan_layers")},
    **{f"trainer.{f}": False for f in ("profiler", "profiler_num_steps", "profiler_start_step")},
}


def _sections(tp: typing.Any) -> list[tuple[str, type]]:
    """The config dataclasses inside a field's type: ``(tag, class)``, one per Choice family member."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType, tuple, list):
        return [s for arg in typing.get_args(tp) for s in _sections(arg)]
    if origin is dict:
        return _sections(typing.get_args(tp)[1])
    if isinstance(tp, type) and issubclass(tp, Choice):
        return [(f"[{k}]", c) for k, c in sorted(tp.family().registry.items())]
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return [("", tp)]
    return []


def _leaf_fields(cls: type, prefix: str = "", parent_semantic: bool = True) -> dict[str, bool]:
    """Every leaf field of a config dataclass, recursively (Choice families per member), with its
    effective semantic flag (a non-semantic section makes all its fields non-semantic)."""
    out: dict[str, bool] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        semantic = parent_semantic and f.metadata.get("semantic", True)
        name = f"{prefix}.{f.name}" if prefix else f.name
        subs = _sections(hints[f.name])
        if subs:
            for tag, sub in subs:
                out.update(_leaf_fields(sub, name + tag, semantic))
        else:
            out[name] = semantic
    return out


def test_semantic_fields_are_pinned_field_by_field():
    from lm_pipeline.eval import EvalConfig
    from lm_pipeline.hf import ExportConfig

    found = _leaf_fields(RunConfig)
    # eval_report and hf_export fingerprints use these sections (from RunConfig once it has them)
    if not any(k.startswith("eval.") for k in found):
        found.update({f"eval.{k}": v for k, v in _leaf_fields(EvalConfig).items()})
    if not any(k.startswith("export.") for k in found):
        found.update({f"export.{k}": v for k, v in _leaf_fields(ExportConfig).items()})
    unclassified = sorted(set(found) - set(EXPECTED_SEMANTIC))
    gone = sorted(set(EXPECTED_SEMANTIC) - set(found))
    assert not unclassified, f"new config fields: classify them in EXPECTED_SEMANTIC: {unclassified}"
    assert not gone, f"fields no longer exist: {gone}"
    wrong = {k: found[k] for k in found if found[k] != EXPECTED_SEMANTIC[k]}
    assert not wrong, f"semantic flag differs from the pinned table (field: actual): {wrong}"


# --------------------------------------------------------------------------------------------
# What each edit re-runs (fingerprints) and marks stale (config versions)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def tiny(tmp_path):
    """(raw config dict, path of the tiny experiment YAML)."""
    path = pt.write_config(tmp_path)
    return pt.tiny_config(tmp_path), path


def _pipe(path: Path, overrides: dict | None = None, **kw) -> Pipeline:
    return Pipeline(load_config(path, overrides or {}), progress=False, **kw)


#: The stages of a config without eval_harness tasks (the tiny one): all but those that may not apply.
STAGE_NAMES = tuple(s.name for s in STAGES if s.not_applicable is None)


def _addresses(p: Pipeline) -> dict[str, str]:
    return {s: p.address(s).fingerprint for s in STAGE_NAMES}


def _changed(a: dict[str, str], b: dict[str, str]) -> set[str]:
    return {k for k in a if a[k] != b[k]}


NON_SEMANTIC_EDITS = [
    {"trainer.log_every": 1}, {"trainer.steps_per_eval": 1}, {"trainer.max_eval_batches": 1},
    {"trainer.progress": True}, {"trainer.checkpointer.save_interval": "1m"},
    {"trainer.checkpointer.keep": [{"every": 2}]}, {"trainer.tracker": [{"type": "tensorboard"}]},
    {"trainer.per_device_parallelism": 2}, {"trainer.log_dir": "elsewhere"}, {"trainer.model_axis_size": 1},
    {"data.num_workers": 2}, {"data.shard_group_size": 3}, {"model.gradient_checkpointing": True},
    {"store.root": "/somewhere/else"},
]


@pytest.mark.parametrize("edit", NON_SEMANTIC_EDITS, ids=lambda e: next(iter(e)))
def test_non_semantic_edit_changes_no_address(tiny, edit):
    _, path = tiny
    base, edited = _pipe(path), _pipe(path, edit)
    assert _addresses(edited) == _addresses(base)
    assert edited.config_versions() == base.config_versions()


ALL = set(STAGE_NAMES)
DOWNSTREAM_OF_TOKENIZER = ALL - {"raw_shards"}
DOWNSTREAM_OF_TRAINING = {"train_ckpt", "eval_report", "hf_export"}


@pytest.mark.parametrize("edit, expected", [
    ({"data.tokenizer.vocab_size": 320}, DOWNSTREAM_OF_TOKENIZER),
    ({"data.tokenizer.min_frequency": 3}, DOWNSTREAM_OF_TOKENIZER),
    ({"data.min_length": 5}, ALL),
    ({"optimizer.learning_rate": 2e-3}, DOWNSTREAM_OF_TRAINING),
    ({"trainer.num_train_steps": 7}, DOWNSTREAM_OF_TRAINING),
    ({"model.num_layers": 2}, DOWNSTREAM_OF_TRAINING),
    ({"model.seq_len": 16}, DOWNSTREAM_OF_TRAINING),
    ({"data.packing": "greedy"}, DOWNSTREAM_OF_TRAINING),
], ids=lambda x: next(iter(x)) if isinstance(x, dict) else "")
def test_semantic_edit_changes_exactly_its_downstream(tiny, edit, expected):
    _, path = tiny
    base, edited = _pipe(path), _pipe(path, edit)
    assert _changed(_addresses(base), _addresses(edited)) == expected
    # the config-only versions (Dagster code versions) flag exactly the same stages, reading no data
    assert _changed(base.config_versions(), edited.config_versions()) == expected


def test_eval_and_export_settings_change_only_their_stage(tiny):
    from lm_pipeline.eval import EvalConfig
    from lm_pipeline.hf import ExportConfig

    _, path = tiny
    base = _pipe(path)
    ev = _pipe(path, eval_config=EvalConfig(max_eval_batches=3))
    ex = _pipe(path, export_config=ExportConfig(dtype="bfloat16"))
    bs = _pipe(path, eval_config=EvalConfig(batch_size=2))  # with max_eval_batches it picks the rows
    saves = _pipe(path, export_config=ExportConfig(hf_save_steps=5))
    assert _changed(_addresses(base), _addresses(ev)) == {"eval_report"}
    assert _changed(_addresses(base), _addresses(ex)) == {"hf_export"}
    assert _changed(_addresses(base), _addresses(bs)) == {"eval_report"}
    assert _changed(_addresses(base), _addresses(saves)) == set()
    assert _changed(base.config_versions(), ev.config_versions()) == {"eval_report"}
    assert _changed(base.config_versions(), ex.config_versions()) == {"hf_export"}


def test_experiments_sharing_data_and_tokenizer_share_artifacts(tiny, tmp_path):
    _, path = tiny
    a = _pipe(path)
    b = _pipe(path, {"optimizer.learning_rate": 5e-3, "model.num_layers": 2, "trainer.log_every": 3})
    for stage in ("raw_shards", "tokenizer", "token_cache"):
        assert a.store.artifact(stage, a.address(stage).fingerprint).path == b.store.artifact(stage, b.address(stage).fingerprint).path


def test_run_id_and_checkpoints_derive_from_the_fingerprint(tiny, tmp_path):
    _, path = tiny
    p = _pipe(path)
    fp = p.address("train_ckpt").fingerprint
    assert p.run_id() == fp
    assert p.run_dir() == f"{tmp_path}/store/train_ckpt/{fp}"
    moved = _pipe(path, {"trainer.checkpointer.base_path": str(tmp_path / "runs")})
    assert moved.run_dir() == f"{tmp_path}/runs/{fp}"
    named = _pipe(path, {"trainer.id": "my-run", "trainer.checkpointer.base_path": str(tmp_path / "runs")})
    assert named.run_dir() == f"{tmp_path}/runs/my-run"
    assert named.address("train_ckpt").fingerprint == fp  # the id is not semantic
    # the checkpoint-reading stages are addressed by (run, step)
    assert p.address("eval_report", step=3).fingerprint != p.address("eval_report", step=6).fingerprint
    assert p.address("eval_report").fingerprint == p.address("eval_report", step=6).fingerprint  # final = 6


def test_complete_checkpoints_lists_only_marked_step_dirs(tmp_path):
    run = tmp_path / "run"
    for step, marker in ((3, True), (6, True), (9, False)):
        d = run / f"step-{step}"
        d.mkdir(parents=True)
        if marker:
            (d / "checkpoint.json").write_text(json.dumps({"step": step, "kind": "permanent"}))
    (run / "best").mkdir()
    (run / "metrics.jsonl").write_text("")
    assert [(c["step"], c["kind"]) for c in complete_checkpoints(str(run))] == [(3, "permanent"), (6, "permanent")]
    assert complete_checkpoints(str(tmp_path / "missing")) == []


# --------------------------------------------------------------------------------------------
# Plan
# --------------------------------------------------------------------------------------------


def test_plan_reports_hits_misses_and_field_diffs(tiny, tmp_path):
    from lm_pipeline import cli

    _, path = tiny
    p = _pipe(path)
    p.tokenizer()  # raw_shards + tokenizer complete
    rows = {r["stage"]: r for r in p.plan()}
    assert [rows[s]["hit"] for s in STAGE_NAMES] == [True, True, False, False, False, False]
    assert rows["token_cache"]["changes"] == ["no earlier artifact of this stage"]

    edited = _pipe(path, {"data.tokenizer.vocab_size": 320})
    rows = {r["stage"]: r for r in edited.plan()}
    assert rows["raw_shards"]["hit"] and not rows["tokenizer"]["hit"]
    assert rows["tokenizer"]["compared_with"] == p.address("tokenizer").fingerprint
    assert rows["tokenizer"]["changes"] == ["config.vocab_size: 300 -> 320"]

    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["plan", "--config_path", str(path), "--data.tokenizer.vocab_size", "320"]) == 0
    text = out.getvalue()
    assert f"hit  raw_shards   {p.address('raw_shards').fingerprint}" in text
    assert f"MISS tokenizer    {edited.address('tokenizer').fingerprint}" in text
    assert "config.vocab_size: 300 -> 320" in text
    assert f"changed since {p.address('tokenizer').fingerprint}" in text


# --------------------------------------------------------------------------------------------
# Token cache: fan-out over shard groups == one process
# --------------------------------------------------------------------------------------------


def cache_digest(split_dir: Path) -> dict:
    """What a token cache holds: its ledger and marker (bytes) and its arrays' contents."""
    from lm_pipeline.data.cache import open_cache

    c = open_cache(str(split_dir))
    return {
        "ledger": (split_dir / "ledger.json").read_bytes(),
        "complete": (split_dir / "COMPLETE").read_bytes(),
        "tokens": np.asarray(c.read_tokens(0, c.num_tokens)).tobytes(),
        "offsets": np.asarray(c.doc_offsets).tobytes(),
        "doc_bytes": np.asarray(c.doc_bytes).tobytes(),
    }


def test_fanned_out_token_cache_equals_the_single_process_one(tmp_path):
    path = pt.write_config(tmp_path)
    single = _pipe(path)
    res_single = single.token_cache()
    fan = Pipeline(load_config(path), ArtifactStore(str(tmp_path / "fan")), progress=False)
    groups = fan.token_cache_groups()
    assert [g.key for g in groups] == ["train_00000", "train_00001", "train_00002", "train_00003", "validation_00000"]
    parts = [fan.token_cache_part(g) for g in reversed(groups[1:])]  # any order; one group left to the commit
    res_fan = fan.token_cache_commit(parts)
    assert not res_fan.hit and res_fan.fingerprint == res_single.fingerprint
    assert res_fan.manifest["built_by"] == "fan-out" and res_single.manifest["built_by"] == "single"
    for split in ("train", "validation"):
        assert cache_digest(Path(res_fan.path) / split) == cache_digest(Path(res_single.path) / split)
    assert res_fan.manifest["summary"] == res_single.manifest["summary"]
    assert not list((tmp_path / "fan" / "token_cache").glob(".parts-*"))  # scratch parts removed
    again = fan.token_cache_commit([])
    assert again.hit
    assert fan.token_cache().hit  # both paths address the same artifact


# --------------------------------------------------------------------------------------------
# Several processes of one training run: only process 0 locks and commits
# --------------------------------------------------------------------------------------------


def test_only_process_0_of_a_distributed_run_locks_and_commits_the_training_artifact(tiny):
    import threading

    _, path = tiny
    dist = {"trainer.distributed.num_processes": 2, "trainer.distributed.coordinator_address": "127.0.0.1:1"}
    follower = _pipe(path, {**dist, "trainer.distributed.process_id": 1})
    leader = _pipe(path, {**dist, "trainer.distributed.process_id": 0})
    fp = leader.address("train_ckpt").fingerprint
    assert follower.address("train_ckpt").fingerprint == fp  # distributed settings are not semantic
    art = leader.store.artifact("train_ckpt", fp)
    wrote: list[str] = []

    def write(where: str):
        wrote.append(where)
        return {"steps": 1}, {}

    done = threading.Event()
    with leader.store.lock(art):  # process 0 holds the builders' lock for the whole run
        t = threading.Thread(target=lambda: (follower.run("train_ckpt", write), done.set()), daemon=True)
        t.start()
        assert done.wait(60), "a follower process waited for the lock process 0 holds (deadlock in a real run)"
    assert wrote == [art.path]
    assert leader.store.manifest("train_ckpt", fp) is None  # the follower committed nothing
    res = leader.run("train_ckpt", write)
    assert not res.hit and leader.store.manifest("train_ckpt", fp) is not None
    # other stages lock and commit in every process as before
    assert _pipe(path, {**dist, "trainer.distributed.process_id": 1}).raw_shards().manifest is not None
