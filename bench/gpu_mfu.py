"""Model FLOPs utilisation of the real train step on one accelerator, against the card's measured peak.

Needs only the core (``lm_pipeline`` with JAX, Equinox, Optax): no Dagster, no data, no
tokenizer. For each shape it builds this trainer's jitted step
(:func:`lm_pipeline.train.trainer.build_step_functions`, bf16 compute with f32 parameters,
AdamW, cuDNN flash attention, no gradient checkpointing unless a variant asks for it), picks
the micro-batch with ``per_device_parallelism: auto`` (the estimator against the device's
memory), times ``--steps`` steps after warm-up on random tokens, and reports:

* step time, tokens/s, model FLOPs per token (``flops_per_token``: 6N + attention, as in
  Levanter's MFU; recomputation is not counted), achieved FLOP/s;
* the ceiling: the fastest of JAX's and (where installed) PyTorch's bf16 matmul
  (8192 x 8192 x 8192 by default) on the same device, measured in the same run after warming
  the card; ``mfu`` = achieved / that ceiling (and against the vendor's dense bf16 peak where
  the card is known: ``PEAK_BF16_FLOPS``);
* memory: the device's ``peak_bytes_in_use`` after the shape's steps (process-wide, so a
  later row shows the largest so far), XLA's plan of the compiled step, and the estimate.

Shapes::

    gpt2_124m:  GPT-2, 12 layers, 12 heads, width 768, seq 1024, vocab 50257, batch 32
    llama_350m: Llama, 24 layers, 16 heads, width 1024, MLP 2816, seq 2048, vocab 32000, batch 16

    python bench/gpu_mfu.py [--shapes gpt2_124m,llama_350m] [--steps 20] [--variants default,unroll=0]
                            [--per_device_parallelism auto] [--profile DIR] [--smoke]

``--variants`` runs each shape once per variant in this one process, so that changes can be
compared on the same card: ``default`` (the library as it is) or ``+``-joined settings, e.g.
``attention=xla`` (XLA's attention instead of cuDNN's), ``vocab_pad=1`` (no LM-head vocabulary
padding), ``unroll=0`` (scan the layer stack), ``remat=1`` (gradient checkpointing).
``--profile DIR`` writes a ``jax.profiler`` trace of 3 steps per run.

``--smoke`` runs tiny versions of both shapes (on any backend, CPU included) to check the
script itself; its numbers mean nothing. The last line is ``RESULT {json}`` with ``ratio`` =
the smallest MFU (achieved / measured ceiling) over the shapes for the first variant listed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import host_info, host_line  # noqa: E402

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


def matmul_peak(n: int, seconds: float = 2.0) -> dict[str, float]:
    """FLOP/s of ``n x n @ n x n`` bf16 matmuls on device 0, random inputs, by each library here.

    ``jax``: bf16 output (f32 accumulation inside the kernel); ``jax_f32_out``: f32 output cast
    back to bf16; ``torch``: ``torch.matmul`` on the same card when PyTorch with CUDA is
    installed. Each warms the card for about ``seconds`` first (clocks ramp up from idle), then
    times batches of back-to-back products with one synchronisation per batch, so launches and
    host round trips don't count against the card; the median over batches. The ceiling for
    MFU is the fastest of them."""
    import jax
    import jax.numpy as jnp

    def timed(run, sync) -> float:
        reps, t_end = 10, time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            sync(run(reps))
        rates = []
        for _ in range(10):
            t0 = time.perf_counter()
            sync(run(reps))
            rates.append(2 * n**3 * reps / (time.perf_counter() - t0))
        return statistics.median(rates)

    keys = jax.random.split(jax.random.key(0), 4)
    xs = [jax.random.normal(k, (n, n), jnp.bfloat16) for k in keys]
    out = {}
    for label, f in {
        "jax": jax.jit(lambda x, y: x @ y),
        "jax_f32_out": jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16)),
    }.items():
        out[label] = timed(lambda r, f=f: [f(xs[i % 4], xs[(i + 1) % 4]) for i in range(r)], jax.block_until_ready)
    try:
        import torch
    except ImportError:
        return out
    if torch.cuda.is_available() and jax.devices()[0].platform == "gpu":
        ts = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        out["torch"] = timed(lambda r: [ts[i % 4] @ ts[(i + 1) % 4] for i in range(r)], lambda _: torch.cuda.synchronize())
        del ts
        torch.cuda.empty_cache()
    return out


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """``"attention=xla+unroll=0"`` -> (label, settings); ``"default"`` -> the library's defaults."""
    if spec == "default":
        return spec, {}
    settings = {}
    for item in spec.split("+"):
        key, sep, value = item.partition("=")
        if not sep or key not in ("attention", "vocab_pad", "unroll", "remat"):
            raise SystemExit(f"--variants: {item!r} is not attention=..., vocab_pad=N, unroll=N or remat=0|1")
        settings[key] = value
    return spec, settings


def bench_shape(name: str, overrides: dict, steps: int, warmup: int, profile_dir: str | None = None,
                per_device: str = "auto", variant: dict | None = None, mp: str = "p=f32,c=bfloat16") -> dict:
    """One shape's timed steps (see the module's docstring); ``mp`` is the trainer's precision
    policy (``bench/gpu_peers.py`` passes f32 for its CPU smoke run)."""
    import dataclasses

    import equinox as eqx
    import jax
    import numpy as np

    from lm_pipeline.batch import LmBatch
    from lm_pipeline.compute import plan_for_mesh
    from lm_pipeline.config import load_config
    from lm_pipeline.estimate import estimate, planned_bytes, resolve_auto_parallelism
    from lm_pipeline.train.sharding import make_mesh
    from lm_pipeline.train.trainer import build_step_functions, put_batch

    vocab = overrides.pop("vocab")
    cfg = load_config(None, {
        **overrides, "trainer.mp": mp, "trainer.per_device_parallelism": per_device if per_device == "auto" else int(per_device),
        "optimizer.lr_schedule": "constant", "optimizer.warmup": 0,
        "optimizer.weight_decay": 0.1,
    })
    cfg = resolve_auto_parallelism(cfg, 1, vocab, segments=False)
    plan = make_mesh(cfg.trainer, jax.devices()[:1])
    variant = variant or {}
    compute = plan_for_mesh(plan.mesh, cfg.trainer.precision.compute, attention=variant.get("attention"))
    compute = dataclasses.replace(
        compute,
        vocab_pad_multiple=int(variant.get("vocab_pad", compute.vocab_pad_multiple)),
        unroll_max_layers=int(variant.get("unroll", compute.unroll_max_layers)),
    )
    fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=vocab, num_train_steps=10**6,
                               plan=plan, has_segments=False, compute=compute)
    state = fns.init(jax.random.key_data(jax.random.key(0)))
    num_params = sum(x.size for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_inexact_array)))
    rng = np.random.default_rng(0)
    b, t = cfg.trainer.train_batch_size, cfg.model.seq_len
    batches = [put_batch(LmBatch(rng.integers(0, vocab, (b, t), dtype=np.int32)), plan) for _ in range(2)]
    t0 = time.perf_counter()
    with jax.set_mesh(plan.mesh):  # compiled once: XLA's memory plan and the steps below
        step = fns.train_step.lower(fns.abstract_state, *batches[0]).compile()
    compile_s = time.perf_counter() - t0
    xla_bytes = planned_bytes(step)
    state, m = step(state, *batches[0])
    for i in range(warmup):
        state, m = step(state, *batches[i % 2])
    jax.block_until_ready(state)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, *batches[i % 2])
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    if profile_dir:
        jax.profiler.start_trace(profile_dir)
        for i in range(3):
            state, m = step(state, *batches[i % 2])
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
    tokens = b * t
    fpt = float(cfg.model.flops_per_token(vocab))
    stats = jax.devices()[0].memory_stats() or {}
    est = estimate(cfg, num_devices=1, vocab_size=vocab, segments=False)
    return {
        "shape": name, "batch": b, "seq_len": t, "micro_batch": cfg.trainer.per_device_parallelism,
        "num_params": int(num_params), "config_params": int(cfg.model.num_params(vocab)),
        "step_s": step_s, "step_s_min": min(times), "tokens_per_s": tokens / step_s,
        "flops_per_token": fpt, "achieved_flops": fpt * tokens / step_s, "compile_s": compile_s,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "bytes_limit": stats.get("bytes_limit"),
        "xla_bytes": xla_bytes, "estimated_bytes": est.total, "loss": float(m["train/loss"]),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--steps", type=int, default=20, help="timed steps per shape")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--matmul", type=int, default=8192, help="side of the square matmul that measures the peak")
    p.add_argument("--variants", default="default", help=(
        "comma-separated variants to compare, each 'default' or '+'-joined settings among "
        "attention=auto|xla|cudnn, vocab_pad=N (1 = none), unroll=N (largest unrolled layer stack; 0 = scan), "
        "remat=0|1 (gradient checkpointing; default 0)"))
    p.add_argument("--per_device_parallelism", default="auto",
                   help="micro-batch per device: auto (the estimator picks against the device's memory) or N (-1: the whole batch)")
    p.add_argument("--profile", default=None, help="write a jax.profiler trace of 3 steps per run under this folder")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, any backend: checks the script only")
    args = p.parse_args(argv)
    import jax

    from lm_pipeline.train.trainer import device_peak_flops

    device = jax.devices()[0]
    host = host_info(gpu=device.device_kind if device.platform == "gpu" else None)
    print(host_line(host))
    if args.smoke:
        args.steps, args.warmup, args.matmul = min(args.steps, 3), 1, 256
    peaks = matmul_peak(args.matmul)
    peak = max(peaks.values())
    vendor = device_peak_flops()
    print(f"device: {device.device_kind} ({device.platform}); bf16 {args.matmul}^3 matmul: "
          + ", ".join(f"{k} {v / 1e12:.1f}" for k, v in peaks.items())
          + f" TFLOP/s; ceiling (the fastest) {peak / 1e12:.1f} TFLOP/s"
          + (f"; vendor dense bf16 peak {vendor / 1e12:.0f} TFLOP/s" if vendor else ""))
    results = []
    variants = [parse_variant(v.strip()) for v in args.variants.split(",") if v.strip()]
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for name in names:
        if name not in SHAPES:
            p.error(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    for name, (label, v) in itertools.product(names, variants):
        overrides = {**SHAPES[name], **(SMOKE[name] if args.smoke else {}),
                     "model.gradient_checkpointing": bool(int(v.get("remat", 0)))}
        trace = f"{args.profile}/{name}_{label}" if args.profile else None
        r = bench_shape(name, overrides, args.steps, args.warmup, trace, args.per_device_parallelism, v)
        r["variant"] = label
        r["mfu"] = r["achieved_flops"] / peak
        r["mfu_vendor"] = r["achieved_flops"] / vendor if vendor else None
        results.append(r)
        mem = r["peak_bytes_in_use"]
        print(f"{name:<11} {label:<12} batch {r['batch']} x {r['seq_len']} (micro {r['micro_batch']}/device)  "
              f"step {r['step_s'] * 1e3:8.1f} ms  {r['tokens_per_s']:>10,.0f} tok/s  "
              f"{r['achieved_flops'] / 1e12:6.1f} TFLOP/s  MFU {100 * r['mfu']:5.1f}%"
              + (f" ({100 * r['mfu_vendor']:.1f}% of vendor peak)" if r["mfu_vendor"] else "")
              + (f"  memory peak {mem / 2**30:.1f} GiB" if mem else "")
              + (f", XLA's plan {r['xla_bytes'] / 2**30:.1f} GiB" if r["xla_bytes"] else "")
              + f", estimate {r['estimated_bytes'] / 2**30:.1f} GiB"
              + f"  compile {r['compile_s']:.1f} s", flush=True)
    print("RESULT " + json.dumps({
        "ratio": round(min(r["mfu"] for r in results if r["variant"] == variants[0][0]), 4),
        "device": device.device_kind, "platform": device.platform, "smoke": args.smoke,
        "jax": jax.__version__, "matmul_peak_flops": peak, "matmul_flops": peaks, "vendor_peak_flops": vendor,
        **{f"{r['shape']}_{r['variant']}_mfu": round(r["mfu"], 4) for r in results},
        "shapes": results,
        **host,
    }, default=float))


if __name__ == "__main__":
    main()
