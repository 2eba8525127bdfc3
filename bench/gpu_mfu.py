"""Model FLOPs utilisation of the real train step on one accelerator, against the card's measured peak.

Needs only the core (``lm_pipeline`` with JAX, Equinox, Optax): no Dagster, no data, no
tokenizer. For each shape it builds this trainer's jitted step
(:func:`lm_pipeline.train.trainer.build_step_functions`, bf16 compute with f32 parameters,
AdamW, fused attention through ``jax.nn.dot_product_attention``), picks the micro-batch with
``per_device_parallelism: auto`` (the estimator against the device's memory), times
``--steps`` steps after warm-up on random tokens, and reports:

* step time, tokens/s, model FLOPs per token (``flops_per_token``: 6N + attention, as in
  Levanter's MFU), achieved FLOP/s;
* the ceiling: the median FLOP/s of a large bf16 matmul (8192 x 8192 x 8192 by default) on
  the same device, measured in the same run; ``mfu`` = achieved / that peak (and against the
  vendor's dense bf16 peak where the card is known: ``PEAK_BF16_FLOPS``);
* memory: the device's ``peak_bytes_in_use`` after the shape's steps, beside the estimate.

Shapes::

    gpt2_124m:  GPT-2, 12 layers, 12 heads, width 768, seq 1024, vocab 50257, batch 32
    llama_350m: Llama, 24 layers, 16 heads, width 1024, MLP 2816, seq 2048, vocab 32000, batch 16

    python bench/gpu_mfu.py [--shapes gpt2_124m,llama_350m] [--steps 20] [--smoke]

``--smoke`` runs tiny versions of both shapes (on any backend, CPU included) to check the
script itself; its numbers mean nothing. The last line is ``RESULT {json}`` with ``ratio`` =
the smallest MFU (achieved / measured matmul peak) over the shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    "gpt2_124m": {
        "model.type": "gpt2", "model.hidden_dim": 768, "model.num_heads": 12, "model.num_layers": 12,
        "model.seq_len": 1024, "trainer.train_batch_size": 32, "vocab": 50257,
    },
    "llama_350m": {
        "model.type": "llama", "model.hidden_dim": 1024, "model.num_heads": 16, "model.num_kv_heads": 16,
        "model.intermediate_dim": 2816, "model.num_layers": 24, "model.seq_len": 2048,
        "trainer.train_batch_size": 16, "vocab": 32000,
    },
}
SMOKE = {  # same families, tiny: checks the script on any backend
    "gpt2_124m": {"model.hidden_dim": 64, "model.num_heads": 4, "model.num_layers": 2, "model.seq_len": 64,
                  "trainer.train_batch_size": 4, "vocab": 512},
    "llama_350m": {"model.hidden_dim": 64, "model.num_heads": 4, "model.num_kv_heads": 4,
                   "model.intermediate_dim": 128, "model.num_layers": 2, "model.seq_len": 64,
                   "trainer.train_batch_size": 4, "vocab": 512},
}


def matmul_peak(n: int, reps: int = 10) -> float:
    """Median FLOP/s of an ``n x n @ n x n`` bf16 matmul with f32 accumulation on device 0."""
    import jax
    import jax.numpy as jnp

    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    f(a, b).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def bench_shape(name: str, overrides: dict, steps: int, warmup: int) -> dict:
    import jax
    import numpy as np

    from lm_pipeline.batch import LmBatch
    from lm_pipeline.config import load_config
    from lm_pipeline.estimate import estimate, resolve_auto_parallelism
    from lm_pipeline.train.sharding import make_mesh
    from lm_pipeline.train.trainer import build_step_functions, put_batch

    vocab = overrides.pop("vocab")
    cfg = load_config(None, {
        **overrides, "trainer.mp": "p=f32,c=bfloat16", "trainer.per_device_parallelism": "auto",
        "model.gradient_checkpointing": False, "optimizer.lr_schedule": "constant", "optimizer.warmup": 0,
        "optimizer.weight_decay": 0.1,
    })
    cfg = resolve_auto_parallelism(cfg, 1, vocab, segments=False)
    plan = make_mesh(cfg.trainer, jax.devices()[:1])
    fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=vocab, num_train_steps=10**6,
                               plan=plan, has_segments=False)
    state = fns.init(jax.random.key_data(jax.random.key(0)))
    rng = np.random.default_rng(0)
    b, t = cfg.trainer.train_batch_size, cfg.model.seq_len
    batches = [put_batch(LmBatch(rng.integers(0, vocab, (b, t), dtype=np.int32)), plan) for _ in range(2)]
    t0 = time.perf_counter()
    state, m = fns.train_step(state, *batches[0])
    jax.block_until_ready(state)
    compile_s = time.perf_counter() - t0
    for i in range(warmup):
        state, m = fns.train_step(state, *batches[i % 2])
    jax.block_until_ready(state)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, m = fns.train_step(state, *batches[i % 2])
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens = b * t
    fpt = float(cfg.model.flops_per_token(vocab))
    stats = jax.devices()[0].memory_stats() or {}
    est = estimate(cfg, num_devices=1, vocab_size=vocab, segments=False)
    return {
        "shape": name, "batch": b, "seq_len": t, "micro_batch": cfg.trainer.per_device_parallelism,
        "step_s": step_s, "step_s_min": min(times), "tokens_per_s": tokens / step_s,
        "flops_per_token": fpt, "achieved_flops": fpt * tokens / step_s, "compile_s": compile_s,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "bytes_limit": stats.get("bytes_limit"),
        "estimated_bytes": est.total, "loss": float(m["train/loss"]),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--steps", type=int, default=20, help="timed steps per shape")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--matmul", type=int, default=8192, help="side of the square matmul that measures the peak")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, any backend: checks the script only")
    args = p.parse_args(argv)
    import jax

    from lm_pipeline.train.trainer import device_peak_flops

    device = jax.devices()[0]
    if args.smoke:
        args.steps, args.warmup, args.matmul = min(args.steps, 3), 1, 256
    peak = matmul_peak(args.matmul)
    vendor = device_peak_flops()
    print(f"device: {device.device_kind} ({device.platform}); measured bf16 matmul peak {peak / 1e12:.1f} TFLOP/s"
          + (f"; vendor dense bf16 peak {vendor / 1e12:.0f} TFLOP/s" if vendor else ""))
    results = []
    for name in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        if name not in SHAPES:
            p.error(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
        overrides = {**SHAPES[name], **(SMOKE[name] if args.smoke else {})}
        r = bench_shape(name, overrides, args.steps, args.warmup)
        r["mfu"] = r["achieved_flops"] / peak
        r["mfu_vendor"] = r["achieved_flops"] / vendor if vendor else None
        results.append(r)
        mem = r["peak_bytes_in_use"]
        print(f"{name:<11} batch {r['batch']} x {r['seq_len']} (micro {r['micro_batch']}/device)  "
              f"step {r['step_s'] * 1e3:8.1f} ms  {r['tokens_per_s']:>10,.0f} tok/s  "
              f"{r['achieved_flops'] / 1e12:6.1f} TFLOP/s  MFU {100 * r['mfu']:5.1f}%"
              + (f" ({100 * r['mfu_vendor']:.1f}% of vendor peak)" if r["mfu_vendor"] else "")
              + (f"  memory {mem / 2**30:.1f} GiB (estimate {r['estimated_bytes'] / 2**30:.1f})" if mem else "")
              + f"  compile {r['compile_s']:.1f} s", flush=True)
    print("RESULT " + json.dumps({
        "ratio": round(min(r["mfu"] for r in results), 4),
        "device": device.device_kind, "platform": device.platform, "smoke": args.smoke,
        "matmul_peak_flops": peak, "vendor_peak_flops": vendor,
        **{f"{r['shape']}_mfu": round(r["mfu"], 4) for r in results},
        "shapes": results,
    }, default=float))


if __name__ == "__main__":
    main()
