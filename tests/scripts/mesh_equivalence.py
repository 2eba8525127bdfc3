"""Run the same 20-step f32 training on several meshes; print per-step losses as JSON.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""

import json
import sys

import jax
import numpy as np

from lm_pipeline.batch import ArrayDataset, StepBatchSource
from lm_pipeline.config import load_config
from lm_pipeline.kernels.cpu import fused_head_loss
from lm_pipeline.train.sharding import make_mesh
from lm_pipeline.train.trainer import build_step_functions, put_batch

# Small head chunks, so that the CPU's fused LM head + loss runs in several chunks (8 for the
# 16 x 32 batch) under every mesh, sharded batch and vocabulary included.
fused_head_loss.HEAD_CHUNK_ROWS = 64

STEPS = 20


def run(overrides: dict, devices) -> dict:
    base = {
        "model.type": "llama", "model.seq_len": 32, "model.hidden_dim": 64, "model.num_heads": 4,
        "model.num_kv_heads": 4, "model.intermediate_dim": 128, "model.num_layers": 2,
        "model.gradient_checkpointing": False, "trainer.train_batch_size": 16, "trainer.mp": "f32",
        "optimizer.learning_rate": 3e-3, "optimizer.warmup": 2, "optimizer.weight_decay": 0.1,
    }
    cfg = load_config(None, {**base, **overrides})
    plan = make_mesh(cfg.trainer, devices)
    fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=256, num_train_steps=STEPS,
                               plan=plan, has_segments=False)
    rng = np.random.default_rng(0)
    tokens = np.tile(rng.integers(0, 256, 300), 20)
    src = StepBatchSource(ArrayDataset(tokens, 32), 16, seed=0)
    losses = []
    with plan.mesh:
        state = fns.init(jax.random.key_data(jax.random.key(0)))
        for k in range(STEPS):
            t, s = put_batch(src.batch(k), plan)
            state, m = fns.train_step(state, t, s)
            losses.append(float(m["train/loss"]))
    params = [np.asarray(x).ravel() for x in jax.tree.leaves(state.model)]
    shardings = {str(x.sharding.spec) for x in jax.tree.leaves(state.model)}
    return {"losses": losses, "params": np.concatenate(params).tolist()[:4096], "param_l2": float(np.sqrt(sum((p.astype(np.float64) ** 2).sum() for p in params))), "shardings": sorted(shardings)}


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.device_count()
    devs = jax.devices()
    which = sys.argv[1:] or ["single", "fsdp8", "dp2_tp4", "accum4"]
    runs = {
        "single": ({}, devs[:1]),
        "fsdp8": ({}, devs),
        "dp2_tp4": ({"trainer.model_axis_size": 4, "trainer.fsdp_axis": None}, devs),
        "accum4": ({"trainer.per_device_parallelism": 4}, devs[:1]),
    }
    out = {name: run(*runs[name]) for name in which}
    print("RESULT " + json.dumps(out))
