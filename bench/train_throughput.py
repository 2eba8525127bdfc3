"""Train-step throughput on CPU: this trainer's jitted step vs Hugging Face GPT-2 in eager PyTorch.

Both sides train the same GPT-2 (pre-norm, learned positions, tanh GELU, tied LM head, no
dropout, no gradient checkpointing: HF's default) on the same random token batches with the
same AdamW (lr 3e-4 constant, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices only,
not on embeddings/biases/norms; global-norm gradient clipping at 1.0), f32 parameters:

* ``jax_f32`` / ``jax_bf16``: :func:`lm_pipeline.train.trainer.build_step_functions`'s
  ``train_step`` (jitted, donated state), ``trainer.mp: f32`` and ``p=f32,c=bfloat16``; each
  step's batch goes through :func:`put_batch` as in the training loop.
* ``torch_f32`` / ``torch_bf16``: ``transformers.GPT2LMHeadModel`` (SDPA attention) with
  ``loss.backward()``, ``clip_grad_norm_``, ``torch.optim.AdamW`` (foreach), eager; bf16 is
  ``torch.autocast("cpu", dtype=torch.bfloat16)`` around the forward and loss.
* ``jax_bf16mm``: ``trainer.mp: p=f32,c=f32,m=bf16``: float32 everywhere but the projections' and
  the LM head's operands, rounded to bf16 (float32 accumulation): what autocast does to the
  linear layers, so ``bf16mm`` (it over ``torch_bf16``) is the like-for-like bf16 ratio.

Shapes (vocab 8192 for both)::

    tiny:   4 layers, 4 heads, width 128, context 64,  batch 12
    medium: 6 layers, 6 heads, width 384, context 256, batch 8

Method: one process; per shape, every variant is built, compiled and warmed up, then timed
windows run round-robin (the order rotates every round, with a short pause between windows
so one framework's spinning worker threads do not eat into the next one's window). Reported:
the median tokens/s over the windows with min/max and IQR; each ratio is a ratio of medians,
with the range of the per-round ratios and the best-window / best-window ratio beside it,
how many cores other processes on the machine used during the windows, and how many the
hypervisor took from this virtual machine's vCPUs (``steal``), both from ``/proc/stat``: on a
shared machine or a contended host these say how far to trust the rest (a step whose two
threads wait for each other loses more than the stolen share: its other thread idles). Threads:
torch uses all cores (``torch.set_num_threads``), XLA's CPU client uses all cores by default; ``--threads 1``
runs both single-threaded (on a busy machine torch's two OpenMP threads lose far more to
preemption than one thread does, so this is the fairer comparison there).
JAX's compile time is its first step's time (trace + compile + one step) minus a median step.

tcmalloc: when the library exists and ``LD_PRELOAD`` is not set, the script re-executes itself
with tcmalloc preloaded (both frameworks then use it); ``--no-tcmalloc`` measures glibc malloc.

    python bench/train_throughput.py [--shapes tiny,medium] [--windows 7] [--quick] [--no-tcmalloc] [--verbose]

``--quick`` shortens the windows and the warm-up (a smoke test; noisier).

The last line is ``RESULT {json}``: ``ratio`` is the smallest of the equal-precision ratios
(JAX f32 / torch f32 and JAX bf16 / torch bf16-autocast, per shape).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Counters, ensure_allocator, fmt_rate, host_info, host_line, loadavg, summarize  # noqa: E402

BLAS_ENV = "LM_PIPELINE_BLAS"  # lm_pipeline.compute.BLAS_ENV (not imported before the allocator is set)

VOCAB = 8192
LR, BETAS, EPS, WD, CLIP = 3e-4, (0.9, 0.95), 1e-8, 0.1, 1.0


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    width: int
    ctx: int
    batch: int


SHAPES = {
    "tiny": Shape(layers=4, heads=4, width=128, ctx=64, batch=12),
    "medium": Shape(layers=6, heads=6, width=384, ctx=256, batch=8),
}
VARIANTS = ("jax_f32", "torch_f32", "jax_bf16", "torch_bf16", "jax_bf16mm")


def token_batches(shape: Shape, n: int = 4, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, (shape.batch, shape.ctx), dtype=np.int32) for _ in range(n)]


# --- JAX: the project's trainer ---------------------------------------------------------------


class JaxRunner:
    def __init__(self, shape: Shape, mp: str, extra: dict | None = None):
        import jax

        from lm_pipeline.batch import LmBatch
        from lm_pipeline.config import load_config
        from lm_pipeline.train.sharding import make_mesh
        from lm_pipeline.train.trainer import build_step_functions, put_batch

        overrides = {
            "model.type": "gpt2", "model.seq_len": shape.ctx, "model.hidden_dim": shape.width,
            "model.num_layers": shape.layers, "model.num_heads": shape.heads,
            "model.gradient_checkpointing": False,
            "trainer.train_batch_size": shape.batch, "trainer.mp": mp,
            "optimizer.learning_rate": LR, "optimizer.beta1": BETAS[0], "optimizer.beta2": BETAS[1],
            "optimizer.epsilon": EPS, "optimizer.weight_decay": WD, "optimizer.max_grad_norm": CLIP,
            "optimizer.lr_schedule": "constant", "optimizer.warmup": 0,
            **(extra or {}),
        }
        cfg = load_config(None, overrides)
        self.plan = make_mesh(cfg.trainer, jax.devices()[:1])
        t0 = time.perf_counter()
        self.fns = build_step_functions(
            cfg.model, cfg.optimizer, cfg.trainer, vocab_size=VOCAB, num_train_steps=10**6,
            plan=self.plan, has_segments=False,
        )
        self.state = self.fns.init(jax.random.key_data(jax.random.key(0)))
        jax.block_until_ready(self.state)
        self.init_s = time.perf_counter() - t0
        self.batches = [LmBatch(t) for t in token_batches(shape)]
        self._put = put_batch
        self._jax = jax
        self.i = 0
        self.loss = float("nan")

    def run(self, steps: int) -> None:
        metrics = None
        for _ in range(steps):
            tokens, seg = self._put(self.batches[self.i % len(self.batches)], self.plan)
            self.state, metrics = self.fns.train_step(self.state, tokens, seg)
            self.i += 1
        self.loss = float(metrics["train/loss"])  # waits for the last step
        self._jax.block_until_ready(self.state)


# --- PyTorch: Hugging Face GPT-2 ----------------------------------------------------------------


class TorchRunner:
    def __init__(self, shape: Shape, bf16: bool):
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        cfg = GPT2Config(
            vocab_size=VOCAB, n_positions=shape.ctx, n_embd=shape.width, n_layer=shape.layers,
            n_head=shape.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            activation_function="gelu_new", layer_norm_epsilon=1e-5, bos_token_id=0, eos_token_id=0,
        )
        self.model = GPT2LMHeadModel(cfg).train()
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (decay if p.ndim >= 2 and "wte" not in name and "wpe" not in name else no_decay).append(p)
        self.params = [p for p in self.model.parameters()]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
            lr=LR, betas=BETAS, eps=EPS, foreach=True,
        )
        self.batches = [torch.from_numpy(t.astype("int64")) for t in token_batches(shape)]
        self.bf16 = bf16
        self.torch = torch
        self.i = 0
        self.loss = float("nan")
        self.init_s = 0.0

    def run(self, steps: int) -> None:
        torch = self.torch
        loss = None
        for _ in range(steps):
            x = self.batches[self.i % len(self.batches)]
            if self.bf16:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = self.model(input_ids=x, labels=x).loss
            else:
                loss = self.model(input_ids=x, labels=x).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, CLIP)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.i += 1
        self.loss = float(loss.detach())


# --- driver -----------------------------------------------------------------------------------


def f32_product_kernel() -> str:
    """What computes the JAX trainer's float32 products on this machine: ``oneMKL sgemm`` where
    the compute plan takes it (Intel CPUs), else ``XLA``."""
    import jax.numpy as jnp

    from lm_pipeline.compute import plan_for

    return "oneMKL sgemm" if plan_for("cpu", jnp.float32).blas else "XLA"


def make_runner(name: str, shape: Shape):
    if name == "jax_f32":
        return JaxRunner(shape, "f32")
    if name == "jax_bf16":
        return JaxRunner(shape, "p=f32,c=bfloat16")
    if name == "jax_bf16mm":
        return JaxRunner(shape, "p=f32,c=f32,m=bf16")
    if name == "torch_f32":
        return TorchRunner(shape, bf16=False)
    if name == "torch_bf16":
        return TorchRunner(shape, bf16=True)
    raise ValueError(name)


def bench_shape(shape_name: str, args) -> dict:
    shape = SHAPES[shape_name]
    tokens_per_step = shape.batch * shape.ctx
    runners, first_step, steps = {}, {}, {}
    for name in VARIANTS:
        r = make_runner(name, shape)
        t0 = time.perf_counter()
        r.run(1)  # JAX: trace + compile + one step; torch: first step
        first_step[name] = time.perf_counter() - t0
        runners[name] = r
    # Warm-up (at least warmup_s seconds and warmup_steps steps each; a variant whose steps are
    # so slow that this would pass 10 windows' time stops after 2), then steps per window for
    # about window_s seconds (at least one), from the warm-up's later half.
    for name, r in runners.items():
        t_start, times = time.perf_counter(), []
        while True:
            elapsed = time.perf_counter() - t_start
            enough_steps = len(times) >= args.warmup_steps or (len(times) >= 2 and elapsed > 10 * args.window_s)
            if enough_steps and elapsed >= args.warmup_s:
                break
            t0 = time.perf_counter()
            r.run(1)
            times.append(time.perf_counter() - t0)
        later = sorted(times[len(times) // 2:])
        per_step = later[len(later) // 2]
        steps[name] = max(1, round(args.window_s / per_step))
    rates = {n: [] for n in VARIANTS}
    cpu = {n: [] for n in VARIANTS}
    others = []
    for w in range(args.windows):
        order = VARIANTS[w % len(VARIANTS):] + VARIANTS[: w % len(VARIANTS)]
        for name in order:
            time.sleep(args.pause)
            c0 = Counters.now()
            runners[name].run(steps[name])
            d = Counters.now() - c0
            rates[name].append(steps[name] * tokens_per_step / d.wall)
            cpu[name].append((d.user / d.wall, d.sys / d.wall, d.minflt / steps[name], d.steal_cores))
            others.append(d.others_cores)
        if args.verbose:
            print(f"  [{shape_name} window {w + 1}/{args.windows}, others {others[-1]:.1f} cores, "
                  f"steal {d.steal_cores:.2f} cores] "
                  + "  ".join(f"{n} {fmt_rate(rates[n][-1])}" for n in VARIANTS), flush=True)
    out = {
        "shape": vars_shape(shape),
        "tokens_per_s": {n: summarize(v) for n, v in rates.items()},
        "rounds": rates,
        "steps_per_window": steps,
        "first_step_s": first_step,
        # JAX compile time: the first call (trace + compile + one step) minus one median step.
        "compile_s": {
            n: max(0.0, first_step[n] - tokens_per_step / summarize(rates[n])["median"])
            for n in VARIANTS if n.startswith("jax")
        },
        "cpu": {n: {"user": med([c[0] for c in v]), "sys": med([c[1] for c in v]), "minflt_per_step": med([c[2] for c in v]),
                    "steal": med([c[3] for c in v])}
                for n, v in cpu.items()},
        "final_loss": {n: r.loss for n, r in runners.items()},
        "others_cores": summarize(others),
        "steal_cores": summarize([c[3] for v in cpu.values() for c in v]),  # every window of every variant
    }
    del runners
    return out


def med(xs):
    import statistics

    return statistics.median(xs)


def vars_shape(s: Shape) -> dict:
    return {"layers": s.layers, "heads": s.heads, "width": s.width, "ctx": s.ctx, "batch": s.batch, "vocab": VOCAB}


PAIRS = {  # ratio name -> (numerator, denominator)
    "f32": ("jax_f32", "torch_f32"),
    "bf16": ("jax_bf16", "torch_bf16"),
    "bf16_vs_torch_f32": ("jax_bf16", "torch_f32"),
    "bf16mm": ("jax_bf16mm", "torch_bf16"),
    "bf16_vs_own_f32": ("jax_bf16", "jax_f32"),
    "bf16mm_vs_own_f32": ("jax_bf16mm", "jax_f32"),
}


def ratios(res: dict) -> dict:
    out = {}
    for key, (a, b) in PAIRS.items():
        ra, rb = res["rounds"][a], res["rounds"][b]
        per_round = [x / y for x, y in zip(ra, rb, strict=True)]
        out[key] = {
            "ratio": res["tokens_per_s"][a]["median"] / res["tokens_per_s"][b]["median"],
            "round_min": min(per_round),
            "round_max": max(per_round),
            # best window vs best window: the least disturbed by other processes on the machine
            "best": res["tokens_per_s"][a]["max"] / res["tokens_per_s"][b]["max"],
        }
    return out


def print_table(results: dict, rat: dict) -> None:
    print()
    print(f"{'shape':<8} {'variant':<11} {'tok/s median':>13} {'min':>9} {'max':>9} {'IQR':>19} "
          f"{'steps/win':>9} {'user':>5} {'sys':>5} {'steal':>5} {'faults/step':>11} {'compile s':>9}")
    for shape_name, res in results.items():
        for n in VARIANTS:
            s = res["tokens_per_s"][n]
            c = res["cpu"][n]
            comp = res["compile_s"].get(n)
            print(f"{shape_name:<8} {n:<11} {fmt_rate(s['median']):>13} {fmt_rate(s['min']):>9} {fmt_rate(s['max']):>9} "
                  f"{fmt_rate(s['q1']) + '-' + fmt_rate(s['q3']):>19} {res['steps_per_window'][n]:>9} "
                  f"{c['user']:>5.2f} {c['sys']:>5.2f} {c['steal']:>5.2f} {c['minflt_per_step']:>11.0f} "
                  f"{'' if comp is None else f'{comp:.1f}':>9}")
    print()
    print(f"{'shape':<8} {'ratio':<34} {'median':>7} {'per-round range':>17} {'best/best':>10}")
    labels = {"f32": "JAX f32 / torch f32", "bf16": "JAX bf16 / torch bf16-autocast",
              "bf16_vs_torch_f32": "JAX bf16 / torch f32", "bf16mm": "JAX bf16 matmuls / torch autocast",
              "bf16_vs_own_f32": "JAX bf16 / JAX f32", "bf16mm_vs_own_f32": "JAX bf16 matmuls / JAX f32"}
    for shape_name, rs in rat.items():
        for key, r in rs.items():
            print(f"{shape_name:<8} {labels[key]:<34} {r['ratio']:>7.2f} {r['round_min']:>8.2f}-{r['round_max']:<8.2f} {r['best']:>10.2f}")
    print()
    for shape_name, res in results.items():
        o = res["others_cores"]
        st = res["steal_cores"]
        print(f"{shape_name}: other processes used {o['median']:.1f} cores (median over windows; {o['min']:.1f}-{o['max']:.1f}); "
              f"the hypervisor stole {st['median']:.2f} cores (steal; {st['min']:.2f}-{st['max']:.2f})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="tiny,medium", help="comma-separated: tiny, medium")
    p.add_argument("--windows", type=int, default=7, help="timed windows per variant (>= 5 recommended)")
    p.add_argument("--window-s", type=float, default=None, help="target seconds per window (default 2, --quick 0.6)")
    p.add_argument("--warmup-steps", type=int, default=None, help="minimum warm-up steps per variant (default 4, --quick 2)")
    p.add_argument("--warmup-s", type=float, default=None, help="minimum warm-up seconds per variant (default 3, --quick 1)")
    p.add_argument("--pause", type=float, default=0.2, help="seconds of idle between windows")
    p.add_argument("--quick", action="store_true", help="short windows (a smoke test; noisier)")
    p.add_argument("--no-tcmalloc", action="store_true", help="do not preload tcmalloc (glibc malloc)")
    p.add_argument("--threads", type=int, default=None,
                   help="cores for both frameworks (default: all); fewer pins the process to that many cores "
                        "(sched_setaffinity, which XLA sizes its thread pools from) and sets torch.set_num_threads")
    p.add_argument("--verbose", action="store_true", help="print every window")
    args = p.parse_args(argv)
    allocator = ensure_allocator(not args.no_tcmalloc)
    if args.window_s is None:
        args.window_s = 0.6 if args.quick else 2.0
    if args.warmup_steps is None:
        args.warmup_steps = 2 if args.quick else 4
    if args.warmup_s is None:
        args.warmup_s = 1.0 if args.quick else 3.0
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in shapes:
        if s not in SHAPES:
            p.error(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")

    host = host_info()  # before any pinning below: the machine's cores
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = args.threads or cores
    if threads < cores:
        # XLA:CPU sizes its thread pools from the CPUs this process may run on (its
        # intra_op_parallelism_threads flag does not limit the YNNPACK dots), so pin the whole
        # process to `threads` cores before JAX starts; torch gets set_num_threads below.
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])
        if threads == 1:
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()

    import jax
    import torch

    torch.set_num_threads(threads)
    print(host_line(host))
    print(f"allocator: {allocator}")
    print(f"jax {jax.__version__} ({jax.devices()[0].platform}, {jax.device_count()} device), torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), XLA {threads} threads, {cores} cores, load {loadavg():.1f}")
    f32_products = f32_product_kernel()
    print(f"JAX float32 products: {f32_products} (the compute plan's choice; ${BLAS_ENV}=xla|mkl overrides)")
    print(f"vocab {VOCAB}; windows {args.windows} x ~{args.window_s}s per variant, alternated")
    results, rat = {}, {}
    for s in shapes:
        sh = SHAPES[s]
        print(f"{s}: {sh.layers} layers, {sh.heads} heads, width {sh.width}, context {sh.ctx}, batch {sh.batch}", flush=True)
        results[s] = bench_shape(s, args)
        rat[s] = ratios(results[s])
    print_table(results, rat)
    equal = {f"{s}_{k}": rat[s][k]["ratio"] for s in shapes for k in ("f32", "bf16")}
    result = {
        "ratio": round(min(equal.values()), 4),
        **{k: round(v, 4) for k, v in equal.items()},
        **{f"{s}_{k}": round(rat[s][k]["ratio"], 4) for s in shapes
           for k in ("bf16_vs_torch_f32", "bf16mm", "bf16_vs_own_f32", "bf16mm_vs_own_f32")},
        "ratio_round_range": {f"{s}_{k}": [round(rat[s][k]["round_min"], 3), round(rat[s][k]["round_max"], 3)] for s in shapes for k in PAIRS},
        "tokens_per_s": {s: {n: {k: round(v, 1) for k, v in results[s]["tokens_per_s"][n].items()} for n in VARIANTS} for s in shapes},
        "compile_s": {s: {n: round(v, 2) for n, v in results[s]["compile_s"].items()} for s in shapes},
        "tcmalloc": "tcmalloc" in allocator and "not" not in allocator and "disabled" not in allocator,
        "vocab": VOCAB,
        "f32_products": f32_products,
        "threads": threads,
        "windows": args.windows,
        "best_window_ratio": {f"{s}_{k}": round(rat[s][k]["best"], 4) for s in shapes for k in PAIRS},
        "others_cores": {s: round(results[s]["others_cores"]["median"], 2) for s in shapes},
        "steal_cores": {s: {k: round(results[s]["steal_cores"][k], 2) for k in ("median", "min", "max")} for s in shapes},
        "final_loss": {s: {n: round(v, 4) for n, v in results[s]["final_loss"].items()} for s in shapes},
        **host,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
