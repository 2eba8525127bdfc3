"""LLM-Trainer's names (docs/llm-trainer.md): YAML aliases, the Python API, refusals in one line,
gradient_accumulation_steps and num_epochs honoured, and the guide's example run end to end."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from lm_pipeline.batch import LmBatch
from lm_pipeline.compat.llm_trainer import DataConfig, ModelConfig, TrainingConfig, fit_warmup, to_run_config
from lm_pipeline.config import RunConfig, load_config
from lm_pipeline.schema import ConfigError, from_dict, to_dict
from lm_pipeline.train.sharding import make_mesh
from lm_pipeline.train.trainer import build_step_functions, put_batch

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "llm-trainer.md"


def same(a: dict, b: dict) -> None:
    """Two override sets load to the same RunConfig (every field)."""
    assert to_dict(load_config(None, a)) == to_dict(load_config(None, b))


# --- YAML aliases ------------------------------------------------------------------------------


def test_model_keys_load_to_the_same_config_as_ours():
    same({"model.d_model": 256, "model.n_heads": 4, "model.n_layers": 3, "model.max_seq_len": 128, "model.d_ff": 1024,
          "model.dropout": 0.1, "model.attention_dropout": 0.2, "model.activation": "gelu", "model.pre_norm": True},
         {"model.hidden_dim": 256, "model.num_heads": 4, "model.num_layers": 3, "model.seq_len": 128,
          "model.mlp_scale": 4, "model.resid_pdrop": 0.1, "model.embed_pdrop": 0.1, "model.attn_pdrop": 0.2,
          "model.activation_function": "gelu"})
    cfg = load_config(None, {"model.d_model": 64, "model.n_heads": 4, "model.d_ff": 96})
    assert cfg.model.mlp_scale == 1.5 and cfg.model.mlp_dim == 96
    assert load_config(None, {"model.d_ff": 3072}).model.mlp_dim == 3072  # with the default width 768
    assert load_config(None, {"model.activation": "swish"}).model.activation_function == "silu"
    llama = {"model.type": "llama", "model.num_kv_heads": 2}
    same({**llama, "model.d_model": 64, "model.n_heads": 4, "model.n_layers": 2, "model.max_seq_len": 32,
          "model.d_ff": 176, "model.dropout": 0.0, "model.attention_dropout": 0, "model.activation": "silu"},
         {**llama, "model.hidden_dim": 64, "model.num_heads": 4, "model.num_layers": 2, "model.seq_len": 32,
          "model.intermediate_dim": 176, "model.activation_function": "silu"})


def test_trainer_keys_load_to_the_same_config_as_ours():
    same({"trainer.train_batch_size": 32, "trainer.per_device_batch_size": 8, "trainer.gradient_accumulation_steps": 2,
          "trainer.eval_steps": 50, "trainer.logging_steps": 5, "trainer.save_steps": 100, "trainer.save_total_limit": 3,
          "trainer.checkpoint_dir": "ckpts", "trainer.use_amp": True, "trainer.amp_dtype": "float16",
          "trainer.report_to": ["tensorboard", "wandb"], "trainer.resume_from_checkpoint": "old/run"},
         {"trainer.train_batch_size": 32, "trainer.per_device_parallelism": 8, "trainer.gradient_accumulation_steps": 2,
          "trainer.steps_per_eval": 50, "trainer.log_every": 5,
          "trainer.checkpointer": {"keep": [{"every": 100}], "keep_last": 3, "base_path": "ckpts", "keep_best": True},
          "trainer.mp": "p=f32,c=float16", "trainer.tracker": [{"type": "tensorboard"}, {"type": "wandb"}],
          "trainer.load_checkpoint_path": "old/run"})
    best = {"trainer.checkpointer.keep_best": True}  # LLM-Trainer's keys: the best model is kept (as there)
    same({"trainer.use_amp": False}, {"trainer.mp": "f32", **best})
    same({"trainer.use_amp": True, "trainer.amp_dtype": "bfloat16"}, {"trainer.mp": "p=f32,c=bfloat16", **best})
    same({"trainer.use_amp": True}, {"trainer.mp": "auto", **best})
    same({"trainer.report_to": "none"}, best)
    same({"trainer.checkpointer.save_total_limit": 2}, {"trainer.checkpointer.keep_last": 2, **best})
    # Levanter's spellings still work, and `batch_size` stays Levanter's GLOBAL batch
    same({"trainer.batch_size": 64, "trainer.per_device_train_parallelism": 16},
         {"trainer.train_batch_size": 64, "trainer.per_device_parallelism": 16})
    assert load_config(None, {"trainer.batch_size": 64}).trainer.train_batch_size == 64


def test_data_keys_of_the_yaml_example_and_the_doc_yaml_loads():
    same({"data.dataset_name": "wikitext", "data.dataset_config": "wikitext-2-raw-v1", "data.dataset_split": "train",
          "data.validation_split": "validation", "data.text_column": "body", "data.pack_sequences": True,
          "data.preprocessing_num_workers": 3},
         {"data.hf_id": "wikitext", "data.hf_name": "wikitext-2-raw-v1", "data.hf_split": "train",
          "data.hf_validation_split": "validation", "data.text_key": "body", "data.packing": "greedy",
          "data.num_workers": 3})
    block = re.search(r"```yaml\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S).group(1)
    cfg = load_config(None, [(k, v) for k, v in _flatten(yaml.safe_load(block))])
    assert (cfg.model.hidden_dim, cfg.model.num_heads, cfg.model.num_layers, cfg.model.mlp_dim, cfg.model.seq_len) == (
        256, 4, 4, 1024, 512)
    assert (cfg.model.resid_pdrop, cfg.model.embed_pdrop, cfg.model.attn_pdrop) == (0.1, 0.1, 0.1)
    tc = cfg.trainer
    assert (tc.train_batch_size, tc.per_device_parallelism, tc.gradient_accumulation_steps) == (32, 16, 2)
    assert tc.micro_batching(1, tc.per_device_parallelism) == (16, 2)
    assert (tc.steps_per_eval, tc.log_every, tc.checkpointer.keep[0].every, tc.checkpointer.keep_last) == (1000, 100, 2000, 3)
    assert [t.type for t in tc.tracker] == ["tensorboard"] and cfg.data.packing == "greedy"


def _flatten(d: dict, prefix: str = ""):
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k != "tokenizer":
            yield from _flatten(v, key + ".")
        else:
            yield key, v


# --- refusals: one line naming the field -------------------------------------------------------

SMALL = dict(d_model=32, n_heads=2, n_layers=1, d_ff=64, max_seq_len=32)
LOCAL = dict(dataset_name=None, builtin="python_stdlib", max_length=32)


@pytest.mark.parametrize("make, field", [
    (lambda: load_config(None, {"model.pre_norm": False}), "pre_norm"),
    (lambda: load_config(None, {"model.vocab_size": 50000}), "vocab_size"),
    (lambda: load_config(None, {"model.type": "llama", "model.dropout": 0.1}), "dropout"),
    # both spellings in one file (an override of one replaces the other: tests/test_config.py)
    (lambda: from_dict(RunConfig, {"model": {"d_ff": 1024, "mlp_scale": 4}}), "d_ff"),
    (lambda: from_dict(RunConfig, {"trainer": {"use_amp": True, "mp": "f32"}}), "use_amp"),
    (lambda: load_config(None, {"trainer.amp_dtype": "int8"}), "amp_dtype"),
    (lambda: load_config(None, {"trainer.report_to": ["mlflow"]}), "report_to"),
    (lambda: load_config(None, {"trainer.train_batch_size": 30, "trainer.gradient_accumulation_steps": 4}),
     "gradient_accumulation_steps"),
    (lambda: load_config(None, {"trainer.gradient_accumulation_steps": 2, "trainer.per_device_parallelism": "auto"}),
     "gradient_accumulation_steps"),
    (lambda: load_config(None, {"trainer.train_batch_size": 32, "trainer.gradient_accumulation_steps": 2,
                                "trainer.per_device_parallelism": 4}).trainer.check_devices(1),
     "gradient_accumulation_steps"),
    (lambda: to_run_config(ModelConfig(**SMALL), TrainingConfig(use_deepspeed=True), DataConfig(**LOCAL), devices=1),
     "TrainingConfig.use_deepspeed"),
    (lambda: to_run_config(ModelConfig(**SMALL), TrainingConfig(distributed_backend="nccl"), DataConfig(**LOCAL),
                           devices=1), "TrainingConfig.distributed_backend"),
    (lambda: to_run_config(ModelConfig(**SMALL), TrainingConfig(world_size=4), DataConfig(**LOCAL), devices=1),
     "TrainingConfig.world_size"),
    (lambda: to_run_config(ModelConfig(**SMALL), TrainingConfig(optimizer="sgd"), DataConfig(**LOCAL), devices=1),
     "TrainingConfig.optimizer"),
    (lambda: to_run_config(ModelConfig(**SMALL, pre_norm=False), TrainingConfig(), DataConfig(**LOCAL), devices=1),
     "ModelConfig.pre_norm"),
    (lambda: to_run_config(ModelConfig(**SMALL), TrainingConfig(), DataConfig(builtin="python_stdlib", max_length=32),
                           devices=1), "DataConfig.dataset_name"),
    (lambda: to_run_config(ModelConfig(**SMALL), TrainingConfig(), DataConfig(**{**LOCAL, "max_length": 64}),
                           devices=1), "DataConfig.max_length"),
    (lambda: to_run_config(ModelConfig(**SMALL), TrainingConfig(), DataConfig(**{**LOCAL, "pack_sequences": False}),
                           devices=1), "pack_sequences"),
])
def test_unsupported_settings_fail_in_one_line_naming_the_field(make, field):
    with pytest.raises(ConfigError) as e:
        make()
    text = str(e.value)
    assert "\n" not in text and re.match(rf"config field '([\w.]+\.)?{re.escape(field)}': .{{20,}}", text), text


# --- the Python API -------------------------------------------------------------------------------


def test_python_api_translates_per_device_batch_and_every_field():
    cfg = to_run_config(
        ModelConfig(vocab_size=1000, d_model=256, n_heads=4, n_layers=4, d_ff=1024, max_seq_len=512, dropout=0.05,
                    attention_dropout=0.0, activation="relu", gradient_checkpointing=True),
        TrainingConfig(batch_size=16, learning_rate=5e-4, weight_decay=0.02, num_epochs=3, lr_scheduler="linear",
                       warmup_steps=100, gradient_accumulation_steps=2, use_amp=True, amp_dtype="bfloat16",
                       max_grad_norm=0.5, save_steps=500, save_total_limit=2, eval_steps=250, logging_steps=10,
                       checkpoint_dir="ck", report_to=["tensorboard"], resume_from_checkpoint="old"),
        DataConfig(dataset_name="wikitext", dataset_config="wikitext-2-raw-v1", max_length=512, min_length=10,
                   packing_strategy="first_fit", preprocessing_num_workers=2),
        devices=4)
    tc, m, o, d = cfg.trainer, cfg.model, cfg.optimizer, cfg.data
    assert tc.train_batch_size == 128  # 4 devices x 16 per device x 2 micro-batches: the GLOBAL batch
    assert tc.micro_batching(4, tc.per_device_parallelism) == (16, 2)
    assert (tc.num_epochs, tc.mp, tc.steps_per_eval, tc.log_every) == (3, "p=f32,c=bfloat16", 250, 10)
    assert (tc.checkpointer.base_path, tc.checkpointer.keep[0].every, tc.checkpointer.keep_last) == ("ck", 500, 2)
    assert [t.type for t in tc.tracker] == ["tensorboard"] and tc.load_checkpoint_path == "old"
    assert (m.type, m.hidden_dim, m.num_heads, m.num_layers, m.mlp_dim, m.seq_len) == ("gpt2", 256, 4, 4, 1024, 512)
    assert (m.resid_pdrop, m.embed_pdrop, m.attn_pdrop, m.activation_function, m.gradient_checkpointing) == (
        0.05, 0.05, 0.0, "relu", True)
    assert (o.learning_rate, o.weight_decay, o.lr_schedule, o.min_lr_ratio, o.warmup, o.max_grad_norm) == (
        5e-4, 0.02, "linear", 0.0, 100, 0.5)
    assert (o.beta1, o.beta2, o.epsilon) == (0.9, 0.999, 1e-8)
    assert (d.hf_id, d.hf_name, d.hf_split, d.hf_validation_split, d.text_key) == (
        "wikitext", "wikitext-2-raw-v1", "train", "validation", "text")
    assert (d.packing, d.num_workers, d.min_length, d.on_invalid, d.tokenizer.vocab_size) == (
        "first_fit", 2, 10, "skip", 1000)
    # the same trainer settings in YAML with LLM-Trainer's keys (global batch written out)
    yaml_cfg = load_config(None, {"trainer.train_batch_size": 128, "trainer.per_device_batch_size": 16,
                                  "trainer.gradient_accumulation_steps": 2, "trainer.num_epochs": 3,
                                  "trainer.use_amp": True, "trainer.amp_dtype": "bfloat16", "trainer.eval_steps": 250,
                                  "trainer.logging_steps": 10, "trainer.save_steps": 500, "trainer.save_total_limit": 2,
                                  "trainer.checkpoint_dir": "ck", "trainer.report_to": ["tensorboard"],
                                  "trainer.resume_from_checkpoint": "old"})
    assert to_dict(yaml_cfg.trainer) == to_dict(tc)
    assert to_run_config(ModelConfig(**SMALL), TrainingConfig(use_amp=False), DataConfig(**LOCAL),
                         devices=1).trainer.mp == "f32"


def test_num_epochs_is_ceil_of_epochs_times_rows_over_the_global_batch():
    cfg = to_run_config(ModelConfig(**SMALL), TrainingConfig(batch_size=4, num_epochs=3, gradient_accumulation_steps=2),
                        DataConfig(**LOCAL), devices=4)
    assert cfg.trainer.train_batch_size == 32
    for rows, expected in ((100, 10), (64, 6), (33, 4), (1, 1)):  # 300/32 = 9.375 -> 10; 192/32 = 6; 99/32 -> 4
        assert cfg.trainer.resolve_num_steps(rows, 32) == expected == math.ceil(3 * rows / 32)
    half = load_config(None, {"trainer.num_epochs": 0.5, "trainer.train_batch_size": 8})
    assert half.trainer.resolve_num_steps(20, 32) == 2  # 10 rows -> 2 steps of 8 (round would give 1)


def test_warmup_longer_than_the_run_gives_pytorchs_learning_rates():
    cfg = to_run_config(ModelConfig(**SMALL), TrainingConfig(learning_rate=4e-4, warmup_steps=2000), DataConfig(**LOCAL),
                        devices=1)
    fitted = fit_warmup(cfg, 8)
    schedule = fitted.optimizer.lr_scheduler(8)
    # PyTorch's warmup: lr(t) = learning_rate * t / warmup_steps for t < warmup_steps
    assert [float(schedule(t)) for t in range(8)] == pytest.approx([4e-4 * t / 2000 for t in range(8)], rel=1e-6)
    assert fit_warmup(cfg, 5000) is cfg


# --- gradient_accumulation_steps: the microbatches used, and the same update ------------------


def _first_step(gas: int | None):
    """One f32 optimizer step of a tiny GPT-2 on a fixed packed batch of 8 rows (documents of
    unequal lengths, so the two halves hold different numbers of predicted tokens)."""
    over = {"model.hidden_dim": 32, "model.num_heads": 2, "model.num_layers": 2, "model.seq_len": 32,
            "model.gradient_checkpointing": False, "trainer.mp": "f32", "trainer.train_batch_size": 8,
            "optimizer.warmup": 0, "optimizer.learning_rate": 1e-2, "optimizer.weight_decay": 0.1}
    if gas is not None:
        over["trainer.gradient_accumulation_steps"] = gas
    cfg = load_config(None, over)
    plan = make_mesh(cfg.trainer, jax.devices()[:1])
    fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=64, num_train_steps=10, plan=plan,
                               has_segments=True)
    rng = np.random.default_rng(3)
    seg = np.zeros((8, 32), np.int32)
    for r in range(8):
        cut = 32 - 3 * r  # later rows end in more padding (segment 0)
        seg[r, :cut] = 1 + (np.arange(cut) >= cut // 2)
    batch = LmBatch(rng.integers(0, 64, (8, 32)).astype(np.int32), seg)
    state = fns.init(jax.random.key_data(jax.random.key(0)))
    init = [np.asarray(x, np.float64) for x in jax.tree.leaves(state.model)]
    state, metrics = fns.train_step(state, *put_batch(batch, plan))
    params = [np.asarray(x, np.float64) for x in jax.tree.leaves(state.model)]
    return fns, {k: float(v) for k, v in metrics.items()}, init, params


@pytest.mark.slow  # two step compiles, ~20 s (tests/test_trainer.py covers accumulation in the default tier)
def test_two_accumulated_microbatches_give_the_one_microbatch_update():
    one, m1, init, p1 = _first_step(None)
    two, m2, _, p2 = _first_step(2)
    assert (one.accumulation_steps, one.micro_batch_rows) == (1, 8)
    assert (two.accumulation_steps, two.micro_batch_rows) == (2, 4)  # what the step's scan runs over
    assert m2["train/loss"] == pytest.approx(m1["train/loss"], rel=1e-6)
    assert m2["optim/grad_norm"] == pytest.approx(m1["optim/grad_norm"], rel=1e-5)
    # the updated parameters, relative to the whole update (Adam's first step is about lr x sign(grad), so a
    # gradient that is zero in exact arithmetic, like the key bias's, moves by rounding noise either way; a
    # wrongly scaled gradient shows in grad_norm above)
    update = math.sqrt(sum(np.sum((a - c) ** 2) for a, c in zip(p1, init, strict=True)))
    diff = math.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(p1, p2, strict=True)))
    assert update > 1e-2 and diff <= 1e-5 * update, (diff, update)


# --- the documented example, end to end (the docs test of docs/llm-trainer.md) -------------------


@pytest.mark.slow  # a whole pipeline run (tokenizer, cache, training): ~20 s
def test_the_guides_small_model_example_runs_end_to_end(tmp_path, monkeypatch, caplog):
    text = DOC.read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    shrink = re.search(r'export LM_PIPELINE_OVERRIDES="([^"]+)"', text).group(1)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LM_PIPELINE_OVERRIDES", shrink)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    caplog.set_level(logging.INFO)
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)  # noqa: S102 - the documented example, as written
    result = scope["result"]
    # its config: the guide's training settings, as this project holds them
    from lm_pipeline.steps import Pipeline

    saved = yaml.safe_load((Path(result.summary["final_checkpoint"]) / "config.yaml").read_text())
    assert saved["trainer"]["train_batch_size"] == 32  # 1 device x 16 x 2
    assert saved["trainer"]["gradient_accumulation_steps"] == 2 and saved["trainer"]["num_epochs"] == 3
    # num_epochs honoured: steps from the cache's training rows, counted independently
    pipe = Pipeline(to_run_config(scope["model"], scope["training"], scope["data"], overrides=_pairs(shrink)))
    rows = len(pipe.datasets(pipe.token_cache())[0])
    assert rows > 32
    assert result.summary["final_step"] == math.ceil(3 * rows / 32)
    # gradient accumulation honoured: the step ran 2 micro-batches of 16 rows
    assert "train step: 2 micro-batch(es) of 16 rows" in caplog.text
    assert Path(result.manifest["run_dir"]).resolve().parent == (tmp_path / "checkpoints").resolve()


def _pairs(text: str):
    from lm_pipeline.config import parse_override_text

    return parse_override_text(text)
