"""How cost grows: train step vs model shape, cache build vs corpus size, no-op pipeline vs shard
count, parameter + optimizer memory per device vs FSDP device count.

Four sweeps, each against the quantity it should scale with:

1. **Train step vs shape** -- the real trainer step (:func:`lm_pipeline.train.trainer.build_step_functions`,
   batches through :func:`put_batch`, a one-device mesh from :func:`make_mesh`, as in
   ``bench/train_throughput.py``): GPT-2, f32, AdamW, vocab 2048, batch 8, no remat. Three
   sweeps around a base of 4 layers x width 128 x context 128: width (heads of 32 dims), depth,
   context. Every shape is compiled and warmed up first; then ``--steps`` rounds time one step
   of every shape each, round-robin (rotating order), and each shape's median is kept.
   Beside each time, the model's training FLOPs per step (``flops_per_token(vocab) * tokens``,
   the PaLM formula: 6 x matmul weights + attention) and the achieved FLOP/s, so a point that
   costs more or less than its FLOPs predict shows up as a FLOP/s change. Log-log slopes
   (``numpy.polyfit``) of time and of FLOPs per sweep: equal slopes = FLOP-proportional cost.
2. **Cache build vs corpus size** -- :func:`lm_pipeline.data.cache.build_cache` (``num_workers=1``:
   tokenization in this process, so no worker start-up; TensorStore writes, commits) of the
   first 0.5 / 1 / 2 / 4 MB of a fixed shuffle of the standard library's ``.py`` files (no download;
   shuffled so every size has the same mix of document sizes), 8 documents
   per :class:`TextShard`, with one byte-level BPE (vocab 2048) trained once on every 8th
   document. 3 rounds over the sizes (1 with ``--quick``), each build into a fresh directory;
   the best build per size; slope of time vs MB (1 = linear) and MB/s per size. Beside it, the
   tokenizer alone (``encode_batch_fast`` on the same documents), to tell a non-linearity of
   the text or tokenizer from one of the cache.
3. **No-op pipeline vs number of shards** -- a tiny experiment with N = 1 / 4 / 16 / 64 JSONL
   training shards (3 tiny documents each) + one validation shard: ``Pipeline.token_cache()``
   (raw_shards -> tokenizer -> token_cache) is built once, then a *fresh* ``Pipeline`` (as a new
   process would; addresses are memoised per object) repeats it -- three cache hits, whose
   cost is resolving the shards, hashing their bytes for the fingerprints and reading three
   manifests -- and ``plan()`` (all six stages' hit/miss). Medians of 5. Separately, Dagster's
   own cost: ``dagster.materialize`` of 1 / 3 / 6 trivial no-op assets in a chain, in-process,
   on an ephemeral instance (median of 5 after one warm-up), and a linear fit = per-run +
   per-step overhead, i.e. what wrapping the same three no-op stages in Dagster adds.
4. **Memory per device vs FSDP devices** -- in a subprocess with
   ``XLA_FLAGS=--xla_force_host_platform_device_count=8``: for N = 1 / 2 / 4 / 8 CPU devices, a mesh
   over the first N (``trainer.fsdp_axis: embed``, the default: parameters and AdamW moments
   sharded over ``data``), ``fns.init``, then the bytes of device 0's shards of the parameters and
   of the optimizer state (``addressable_shards``), beside :func:`lm_pipeline.estimate.estimate`'s
   params + optimizer for N devices. Model: GPT-2 4 layers x width 256, vocab 2048, context 128.
   Efficiency = bytes(1) / (N x bytes(N)) (1.0 = perfect 1/N); leaves that stay replicated
   (biases, norms, leaves with no ``embed`` axis, AdamW's step count) are counted apart.

The 2-core development machine is shared, so absolute times are noisy: the load average is
printed; medians (and a best-of for builds) are used. Writes ``docs/img/scaling.png`` (4 panels)
and rewrites the region between ``<!-- scaling:begin -->`` and ``<!-- scaling:end -->`` of
``docs/benchmarks.md`` (appending it under a ``## Scaling`` heading if absent); ``--no-write``
skips both.

    python bench/scaling.py [--quick] [--sections train,cache,pipeline,memory] [--no-write]

``--quick`` (about a minute): fewer points per sweep, fewer repeats, smaller corpora.

The last line is ``RESULT {json}``; ``ratio`` is the FSDP memory efficiency at the largest
device count, bytes(1) / (N x bytes(N)) (ideal 1.0).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, host_info, host_line, loadavg  # noqa: E402

VOCAB = 2048
BATCH = 8
BASE = {"layers": 4, "width": 128, "ctx": 128}
SWEEPS = {  # name -> (varied key, values, values with --quick)
    "width": ("width", (64, 128, 256, 384), (64, 128)),
    "depth": ("layers", (1, 2, 4, 8), (2, 4)),
    "context": ("ctx", (64, 128, 256, 512), (64, 128)),
}
CACHE_MB = ((0.5, 1.0, 2.0, 4.0), (0.25, 0.5, 1.0))
PIPE_SHARDS = ((1, 4, 16, 64), (1, 8, 64))
DAGSTER_STEPS = (1, 3, 6)
MEM_DEVICES = (1, 2, 4, 8)
MEM_DEVICES_QUICK = (1, 8)
MEM_SHAPE = {"layers": 4, "width": 256, "ctx": 128}
BEGIN, END = "<!-- scaling:begin -->", "<!-- scaling:end -->"


def slope(xs, ys) -> float:
    """Least-squares slope of log(y) on log(x)."""
    import numpy as np

    return float(np.polyfit(np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float)), 1)[0])


def gpt2_overrides(layers: int, width: int, ctx: int, batch: int = BATCH) -> dict:
    return {
        "model.type": "gpt2", "model.seq_len": ctx, "model.hidden_dim": width, "model.num_layers": layers,
        "model.num_heads": max(1, width // 32), "model.gradient_checkpointing": False,
        "trainer.train_batch_size": batch, "trainer.mp": "f32", "optimizer.lr_schedule": "constant",
        "optimizer.warmup": 0,
    }


# --- 1. train step vs shape ------------------------------------------------------------------


class StepTimer:
    """The real jitted train step at one shape (one CPU device), compiled and warmed up."""

    def __init__(self, layers: int, width: int, ctx: int):
        import jax
        import numpy as np

        from lm_pipeline.batch import LmBatch
        from lm_pipeline.config import load_config
        from lm_pipeline.train.sharding import make_mesh
        from lm_pipeline.train.trainer import build_step_functions, put_batch

        self.shape = (layers, width, ctx)
        cfg = load_config(None, gpt2_overrides(layers, width, ctx))
        self.plan = make_mesh(cfg.trainer, jax.devices()[:1])
        self.fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=VOCAB,
                                        num_train_steps=10**6, plan=self.plan, has_segments=False)
        self.state = self.fns.init(jax.random.key_data(jax.random.key(0)))
        rng = np.random.default_rng(0)
        self.batches = [LmBatch(rng.integers(0, VOCAB, (BATCH, ctx), dtype=np.int32)) for _ in range(2)]
        self._put, self._jax = put_batch, jax
        self.flops = cfg.model.flops_per_token(VOCAB) * BATCH * ctx
        self.params = cfg.model.num_params(VOCAB)
        self.i = 0
        self.times: list[float] = []
        self.first_s = self.step()  # trace + compile + one step
        self.step()  # warm-up

    def step(self) -> float:
        t0 = time.perf_counter()
        tokens, seg = self._put(self.batches[self.i % 2], self.plan)
        self.state, metrics = self.fns.train_step(self.state, tokens, seg)
        float(metrics["train/loss"])
        self._jax.block_until_ready(self.state)
        self.i += 1
        return time.perf_counter() - t0

    def summary(self) -> dict:
        med = statistics.median(self.times)
        layers, width, ctx = self.shape
        return {"layers": layers, "width": width, "ctx": ctx, "step_s": med, "min_s": min(self.times),
                "max_s": max(self.times), "compile_s": max(0.0, self.first_s - med), "flops": self.flops,
                "flops_per_s": self.flops / med, "params": self.params}


def train_section(args) -> dict:
    """Compile every shape, then time one step of each shape per round, round-robin (the order
    rotates), so load from other processes spreads over all shapes alike; medians over rounds."""
    shapes: list[tuple[int, int, int]] = []
    for key, full, quick in SWEEPS.values():
        for v in (quick if args.quick else full):
            shape = {**BASE, key: v}
            k = (shape["layers"], shape["width"], shape["ctx"])
            if k not in shapes:
                shapes.append(k)
    timers = {}
    for k in shapes:
        timers[k] = StepTimer(*k)
        print(f"  train {k[0]} layers x {k[1]} x ctx {k[2]}: compiled + first step {timers[k].first_s:.1f}s",
              flush=True)
    for r in range(args.steps):
        order = shapes[r % len(shapes):] + shapes[: r % len(shapes)]
        for k in order:
            timers[k].times.append(timers[k].step())
    points = {k: t.summary() for k, t in timers.items()}
    del timers
    sweeps = {}
    for name, (key, full, quick) in SWEEPS.items():
        rows = []
        for v in (quick if args.quick else full):
            shape = {**BASE, key: v}
            rows.append({"x": v, **points[(shape["layers"], shape["width"], shape["ctx"])]})
        sweeps[name] = {
            "key": key, "rows": rows,
            "time_slope": slope([r["x"] for r in rows], [r["step_s"] for r in rows]),
            "flops_slope": slope([r["x"] for r in rows], [r["flops"] for r in rows]),
        }
    return sweeps


def print_train(sw: dict) -> None:
    print(f"\n{'sweep':<8} {'layers':>6} {'width':>6} {'ctx':>5} {'params':>9} {'GFLOP/step':>11} "
          f"{'step ms':>8} {'GFLOP/s':>8} {'compile s':>9}")
    for name, s in sw.items():
        for r in s["rows"]:
            print(f"{name:<8} {r['layers']:>6} {r['width']:>6} {r['ctx']:>5} {r['params'] / 1e6:>8.2f}M "
                  f"{r['flops'] / 1e9:>11.2f} {1e3 * r['step_s']:>8.1f} {r['flops_per_s'] / 1e9:>8.2f} "
                  f"{r['compile_s']:>9.1f}")
    for name, s in sw.items():
        print(f"{name}: log-log slope of step time {s['time_slope']:.2f}, of FLOPs {s['flops_slope']:.2f}")


# --- 2. cache build vs corpus size -----------------------------------------------------------


def cache_section(args, work: str) -> dict:
    from bench_tok import stdlib_texts, train_tokenizer  # see _import_tok

    from lm_pipeline.data.cache import build_cache
    from lm_pipeline.data.textshard import TextShard

    sizes = CACHE_MB[1] if args.quick else CACHE_MB[0]
    # A fixed shuffle of (up to) 4x the largest size of stdlib files, so that every prefix has the
    # same mix of document sizes: in sorted path order the first files are much larger than the
    # later ones, and the document count (a per-document and per-shard cost) would grow faster
    # than the megabytes.
    texts_all = stdlib_texts(4 * max(sizes))
    random.Random(0).shuffle(texts_all)
    # Trained on every 8th document of the largest corpus, so every prefix is equally in-distribution
    # (training it on the first documents makes the smallest corpus compress -- and encode -- better).
    tokdir = train_tokenizer(texts_all[::8], os.path.join(work, "tok"), VOCAB)
    # Warm-up: one small build, so one-time costs (tokenizer load, TensorStore set-up) do not
    # land on the first timed size.
    build_cache(os.path.join(work, "cache-warm"), [TextShard("warm", tuple(texts_all[:4]))], tokdir, num_workers=1,
                progress=False)
    corpora = []
    for mb in sizes:
        budget, texts = int(mb * 1e6), []
        for t in texts_all:
            if budget <= 0:
                break
            texts.append(t)
            budget -= len(t.encode("utf-8"))
        shards = [TextShard(f"stdlib-{i:04d}", tuple(texts[i : i + 8])) for i in range(0, len(texts), 8)]
        corpora.append((texts, shards))
    # Rounds over all sizes (interleaved, so a burst of load hits one build of each size at most
    # once per round); the best build per size is kept.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tokdir, "tokenizer.json"))
    times: list[list[float]] = [[] for _ in corpora]
    enc_times: list[list[float]] = [[] for _ in corpora]
    tokens: list[int] = [0 for _ in corpora]
    for r in range(args.cache_repeats):
        for j, (texts, shards) in enumerate(corpora):
            # The tokenizer alone on the same text (what build_cache's in-process encoder calls),
            # to tell the text's share of any non-linearity from the cache's.
            t0 = time.perf_counter()
            for i in range(0, len(texts), 64):
                tok.encode_batch_fast(texts[i : i + 64], add_special_tokens=True)
            enc_times[j].append(time.perf_counter() - t0)
            out = os.path.join(work, f"cache-{j}-{r}")
            t0 = time.perf_counter()
            ledger = build_cache(out, shards, tokdir, num_workers=1, shard_group_size=8, progress=False)
            times[j].append(time.perf_counter() - t0)
            tokens[j] = ledger["committed"]["tokens"]
            shutil.rmtree(out, ignore_errors=True)
    rows = []
    for (texts, shards), ts_, es, n_tok in zip(corpora, times, enc_times, tokens, strict=True):
        nbytes = sum(len(t.encode("utf-8")) for t in texts)
        best = min(ts_)
        rows.append({"mb": nbytes / 1e6, "docs": len(texts), "shards": len(shards), "tokens": n_tok,
                     "build_s": best, "encode_s": min(es), "median_s": statistics.median(ts_), "mb_per_s": nbytes / 1e6 / best,
                     "tokens_per_s": n_tok / best})
        print(f"  cache {nbytes / 1e6:.2f} MB: best {best:.2f}s of {len(ts_)}", flush=True)
    return {"rows": rows, "slope": slope([r["mb"] for r in rows], [r["build_s"] for r in rows]),
            "token_slope": slope([r["tokens"] for r in rows], [r["build_s"] for r in rows]),
            "encode_slope": slope([r["mb"] for r in rows], [r["encode_s"] for r in rows]), "workers": 1}


def print_cache(c: dict) -> None:
    print(f"\n{'corpus MB':>9} {'docs':>6} {'shards':>6} {'tokens':>9} {'build s (best)':>14} {'median':>7} "
          f"{'MB/s':>6} {'Mtok/s':>7} {'encode-only s':>13} {'build-encode s':>14}")
    for r in c["rows"]:
        print(f"{r['mb']:>9.2f} {r['docs']:>6} {r['shards']:>6} {r['tokens']:>9} {r['build_s']:>14.2f} "
              f"{r['median_s']:>7.2f} {r['mb_per_s']:>6.2f} {r['tokens_per_s'] / 1e6:>7.3f} {r['encode_s']:>13.2f} "
              f"{r['build_s'] - r['encode_s']:>14.2f}")
    print(f"cache build: log-log slope of time vs MB {c['slope']:.2f}, vs tokens {c['token_slope']:.2f} "
          f"(1 = linear); the tokenizer alone (encode_batch_fast, 64 docs a call): {c['encode_slope']:.2f}; num_workers=1")


# --- 3. no-op pipeline vs number of shards ----------------------------------------------------


def tiny_experiment(root: Path, num_shards: int) -> dict:
    """A tiny experiment dict: ``num_shards`` JSONL training shards of 3 small docs + 1 validation shard."""
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    train = []
    for s in range(num_shards):
        p = data / f"train-{s:03d}.jsonl"
        with open(p, "w", encoding="utf-8") as f:
            for d in range(3):
                text = " ".join(words[(s * 7 + d * 3 + i) % len(words)] for i in range(60)) + f" shard {s} doc {d}"
                f.write(json.dumps({"text": text}) + "\n")
        train.append(str(p))
    val = data / "validation-00.jsonl"
    val.write_text(json.dumps({"text": " ".join(reversed(words)) * 5}) + "\n", encoding="utf-8")
    return {
        "data": {"train_urls": train, "validation_urls": [str(val)], "shard_group_size": 8, "num_workers": 1,
                 "tokenizer": {"kind": "bpe", "vocab_size": 300}, "packing": "concat"},
        "model": {"type": "gpt2", "seq_len": 32, "hidden_dim": 32, "num_heads": 2, "num_layers": 1,
                  "gradient_checkpointing": False},
        "trainer": {"seed": 0, "num_train_steps": 6, "train_batch_size": 4, "mp": "f32", "progress": False,
                    "log_dir": str(root / "logs")},
        "store": {"root": str(root / "store")},
    }


def dagster_overhead(n_steps: int, repeats: int) -> list[float]:
    """Wall seconds of ``dagster.materialize`` of a chain of ``n_steps`` no-op assets, in-process."""
    from dagster import AssetIn, DagsterInstance, asset, materialize

    assets = []
    for i in range(n_steps):
        if i == 0:
            @asset(name=f"noop_{n_steps}_{i}")
            def first():
                return 0

            assets.append(first)
        else:
            @asset(name=f"noop_{n_steps}_{i}", ins={"up": AssetIn(f"noop_{n_steps}_{i - 1}")})
            def nxt(up):
                return up

            assets.append(nxt)
    # Console logging at ERROR keeps the output readable; the events are still written to the instance.
    quiet = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
    times = []
    with DagsterInstance.ephemeral() as instance:
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            res = materialize(assets, instance=instance, raise_on_error=True, run_config=quiet)
            dt = time.perf_counter() - t0
            assert res.success
            if r:  # the first run is a warm-up (imports, instance set-up)
                times.append(dt)
    return times


def pipeline_section(args, work: str) -> dict:
    import numpy as np

    from lm_pipeline.config import load_config
    from lm_pipeline.steps import Pipeline

    rows = []
    for n in (PIPE_SHARDS[1] if args.quick else PIPE_SHARDS[0]):
        root = Path(work) / f"pipe-{n}"
        overrides = {}
        for section, values in tiny_experiment(root, n).items():
            for k, v in values.items():
                overrides[f"{section}.{k}"] = v
        cfg = load_config(None, overrides)
        t0 = time.perf_counter()
        first = Pipeline(cfg, progress=False).token_cache()
        build_s = time.perf_counter() - t0
        assert not first.hit
        hits, plans = [], []
        for _ in range(args.repeats):
            pipe = Pipeline(cfg, progress=False)  # fresh: addresses are memoised per object
            t0 = time.perf_counter()
            r = pipe.token_cache()
            hits.append(time.perf_counter() - t0)
            assert r.hit
            pipe = Pipeline(cfg, progress=False)
            t0 = time.perf_counter()
            pipe.plan()
            plans.append(time.perf_counter() - t0)
        rows.append({"shards": n, "first_build_s": build_s, "noop_s": statistics.median(hits),
                     "plan_s": statistics.median(plans)})
        print(f"  pipeline {n} shards: build {build_s:.2f}s, no-op {1e3 * rows[-1]['noop_s']:.1f} ms", flush=True)
    dag = {}
    for k in DAGSTER_STEPS:
        dag[k] = statistics.median(dagster_overhead(k, args.repeats))
        print(f"  dagster {k} no-op assets: {1e3 * dag[k]:.0f} ms", flush=True)
    per_step, per_run = (float(v) for v in np.polyfit(list(dag), list(dag.values()), 1))
    xs = [r["shards"] for r in rows]
    return {"rows": rows, "dagster": {str(k): v for k, v in dag.items()}, "dagster_per_step_s": per_step,
            "dagster_per_run_s": per_run, "noop_slope": slope(xs, [r["noop_s"] for r in rows]),
            "plan_slope": slope(xs, [r["plan_s"] for r in rows]),
            "noop_ms_per_shard": float(np.polyfit(xs, [1e3 * r["noop_s"] for r in rows], 1)[0])}


def print_pipeline(p: dict) -> None:
    d3 = p["dagster"].get("3")
    print(f"\n{'shards':>6} {'first build s':>13} {'no-op 3 stages ms':>17} {'plan() ms':>9} "
          f"{'Dagster 3 no-op steps ms':>24}")
    for r in p["rows"]:
        print(f"{r['shards']:>6} {r['first_build_s']:>13.2f} {1e3 * r['noop_s']:>17.1f} {1e3 * r['plan_s']:>9.1f} "
              f"{'' if d3 is None else f'{1e3 * d3:.0f}':>24}")
    print("Dagster materialize of k chained no-op assets: "
          + ", ".join(f"{k}: {1e3 * v:.0f} ms" for k, v in p["dagster"].items())
          + f"; fit {1e3 * p['dagster_per_run_s']:.0f} ms per run + {1e3 * p['dagster_per_step_s']:.0f} ms per step")
    print(f"no-op: log-log slope vs shards {p['noop_slope']:.2f} ({p['noop_ms_per_shard']:.2f} ms per shard), "
          f"plan(): {p['plan_slope']:.2f}")


# --- 4. memory per device vs FSDP devices -----------------------------------------------------


def memory_per_device(device_counts=MEM_DEVICES, shape=None) -> list[dict]:
    """Bytes of parameters and optimizer state on device 0, per FSDP device count (measured
    after ``init``), and the estimator's figure. Needs ``jax.device_count() >= max(device_counts)``
    (run under ``XLA_FLAGS=--xla_force_host_platform_device_count=8``)."""
    import jax

    from lm_pipeline.config import load_config
    from lm_pipeline.estimate import estimate
    from lm_pipeline.train.sharding import make_mesh
    from lm_pipeline.train.trainer import build_step_functions

    shape = shape or MEM_SHAPE
    cfg = load_config(None, gpt2_overrides(shape["layers"], shape["width"], shape["ctx"]))
    dev0 = jax.devices()[0]

    def on_dev0(tree, kinds: dict) -> tuple[int, int]:
        """(bytes on device 0, of which in leaves not split over any mesh axis); ``kinds`` collects
        the replicated bytes by the leaf's last path element (bias, weight, count, ...)."""
        total = repl = 0
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if not isinstance(leaf, jax.Array):
                continue
            b = sum(s.data.nbytes for s in leaf.addressable_shards if s.device == dev0)
            total += b
            spec = getattr(leaf.sharding, "spec", None)
            if spec is None or all(a is None for a in spec):
                repl += b
                name = jax.tree_util.keystr(path[-2:]) if path else "?"
                kinds[name] = kinds.get(name, 0) + b
        return total, repl

    out = []
    for n in device_counts:
        plan = make_mesh(cfg.trainer, jax.devices()[:n])
        fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=VOCAB, num_train_steps=1000,
                                   plan=plan, has_segments=False)
        with plan.mesh:
            state = fns.init(jax.random.key_data(jax.random.key(0)))
            jax.block_until_ready(state)
        kinds: dict[str, int] = {}
        p, p_rep = on_dev0(state.model, kinds)
        o, o_rep = on_dev0(state.opt_state, kinds)
        est = estimate(cfg, num_devices=n, vocab_size=VOCAB, platform="cpu")
        out.append({"devices": n, "params_bytes": p, "opt_bytes": o, "replicated_bytes": p_rep + o_rep,
                    "replicated_by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1])[:6]),
                    "est_params_bytes": est.params, "est_opt_bytes": est.optimizer})
        del state
    return out


def memory_section(args) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={max(MEM_DEVICES)}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    counts = MEM_DEVICES_QUICK if args.quick else MEM_DEVICES
    proc = subprocess.run([sys.executable, __file__, "--_memory-worker", ",".join(map(str, counts))], env=env, capture_output=True, text=True,
                          check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MEMORY ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"memory worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = json.loads(lines[-1][len("MEMORY "):])
    base = rows[0]["params_bytes"] + rows[0]["opt_bytes"]
    for r in rows:
        r["total"] = r["params_bytes"] + r["opt_bytes"]
        r["est_total"] = r["est_params_bytes"] + r["est_opt_bytes"]
        r["efficiency"] = base / (r["devices"] * r["total"])
        r["n_times_bytes_rel"] = r["devices"] * r["total"] / base
    ns = [r["devices"] for r in rows]
    return {"rows": rows, "slope": slope(ns, [r["total"] for r in rows]), "shape": MEM_SHAPE}


def print_memory(m: dict) -> None:
    print(f"\n{'devices':>7} {'params/dev':>11} {'opt/dev':>11} {'total/dev':>11} {'replicated':>10} "
          f"{'estimate':>11} {'meas/est':>8} {'N*bytes(N)/bytes(1)':>19} {'efficiency':>10}")
    for r in m["rows"]:
        print(f"{r['devices']:>7} {r['params_bytes'] / 1e6:>10.3f}M {r['opt_bytes'] / 1e6:>10.3f}M "
              f"{r['total'] / 1e6:>10.3f}M {r['replicated_bytes'] / 1e3:>9.1f}k {r['est_total'] / 1e6:>10.3f}M "
              f"{r['total'] / r['est_total']:>8.3f} {r['n_times_bytes_rel']:>19.3f} {r['efficiency']:>10.3f}")
    s = m["shape"]
    print(f"params + AdamW state per device (bytes on device 0), GPT-2 {s['layers']}x{s['width']}, vocab {VOCAB}; "
          f"log-log slope vs devices {m['slope']:.2f} (-1 = 1/N)")


# --- output: plot, markdown --------------------------------------------------------------------


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    def plain(axis) -> None:  # plain numbers on log axes, no minor labels
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())

    fig, axes = plt.subplots(2, 2, figsize=(11, 8.5))
    ax = axes[0][0]
    if "train" in res:
        for name, s in res["train"].items():
            xs = [r["flops"] / 1e9 for r in s["rows"]]
            ys = [1e3 * r["step_s"] for r in s["rows"]]
            ax.loglog(xs, ys, "o-", label=f"{name} (slope {s['time_slope']:.2f} vs FLOPs {s['flops_slope']:.2f})")
        allr = [r for s in res["train"].values() for r in s["rows"]]
        big = max(allr, key=lambda r: r["flops"])
        lo, hi = min(r["flops"] for r in allr), big["flops"]
        ax.loglog([lo / 1e9, hi / 1e9], [1e3 * big["step_s"] * lo / hi, 1e3 * big["step_s"]], "k--", lw=0.8,
                  label="FLOP-proportional (through largest)")
        ax.legend(fontsize=7)
        plain(ax.xaxis)
        plain(ax.yaxis)
    ax.set(xlabel="GFLOP per step (model)", ylabel="step time, ms (median)", title="Train step vs shape")
    ax = axes[0][1]
    if "cache" in res:
        rows = res["cache"]["rows"]
        xs = [r["mb"] for r in rows]
        ax.plot(xs, [r["build_s"] for r in rows], "o-", label=f"build_cache (slope {res['cache']['slope']:.2f})")
        ax.plot([0, max(xs)], [0, rows[-1]["build_s"]], "k--", lw=0.8, label="linear through largest")
        ax.legend(fontsize=8)
    ax.set(xlabel="corpus MB", ylabel="build time, s (best of repeats)", title="Cache build vs corpus size")
    ax = axes[1][0]
    if "pipeline" in res:
        p = res["pipeline"]
        xs = [r["shards"] for r in p["rows"]]
        ax.loglog(xs, [1e3 * r["noop_s"] for r in p["rows"]], "o-", label="core: 3 cached stages")
        ax.loglog(xs, [1e3 * r["plan_s"] for r in p["rows"]], "s-", label="core: plan() (6 stages)")
        if "3" in p["dagster"]:
            ax.axhline(1e3 * p["dagster"]["3"], color="C3", ls="--", label="Dagster: materialize 3 no-op assets")
        ax.legend(fontsize=8)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.xaxis.set_minor_formatter(NullFormatter())
        plain(ax.yaxis)
    ax.set(xlabel="training shards", ylabel="ms (median)", title="No-op pipeline vs shards")
    ax = axes[1][1]
    if "memory" in res:
        rows = res["memory"]["rows"]
        ns = [r["devices"] for r in rows]
        ax.loglog(ns, [r["total"] / 1e6 for r in rows], "o-", label="measured (device 0)")
        ax.loglog(ns, [r["est_total"] / 1e6 for r in rows], "x--", label="lm_pipeline.estimate")
        ax.loglog(ns, [rows[0]["total"] / 1e6 / n for n in ns], "k:", label="ideal 1/N")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.xaxis.set_minor_formatter(NullFormatter())
        plain(ax.yaxis)
        ax.legend(fontsize=8)
    ax.set(xlabel="FSDP devices", ylabel="params + optimizer MB per device", title="Memory per device vs FSDP")
    fig.suptitle(f"bench/scaling.py — {res['date']}, load average {res['load_start']:.1f}→{res['load_end']:.1f}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def deviations(res: dict) -> list[str]:
    """Sentences on where the measured trends deviate from the expected ones, from the numbers."""
    out = []
    if "train" in res:
        for name, s in res["train"].items():
            rows = s["rows"]
            fl = [r["flops_per_s"] / 1e9 for r in rows]
            d = s["time_slope"] - s["flops_slope"]
            kind = ("grows more slowly than its FLOPs" if d < -0.1 else "grows faster than its FLOPs" if d > 0.1
                    else "tracks its FLOPs")
            out.append(f"Train/{name}: step time {kind} (slope {s['time_slope']:.2f} vs {s['flops_slope']:.2f}); "
                       f"achieved {fl[0]:.1f} → {fl[-1]:.1f} GFLOP/s from the smallest to the largest point.")
    if "cache" in res:
        rows = res["cache"]["rows"]
        out.append(f"Cache build: slope {res['cache']['slope']:.2f} vs MB, {res['cache']['token_slope']:.2f} vs tokens "
                   f"(tokenizer alone {res['cache']['encode_slope']:.2f}); "
                   f"{rows[0]['mb_per_s']:.2f} MB/s at "
                   f"{rows[0]['mb']:.2f} MB vs {rows[-1]['mb_per_s']:.2f} MB/s at {rows[-1]['mb']:.2f} MB.")
    if "pipeline" in res:
        p = res["pipeline"]
        r0, r1 = p["rows"][0], p["rows"][-1]
        out.append(f"No-op pipeline: {1e3 * r0['noop_s']:.1f} ms at {r0['shards']} shard(s) → {1e3 * r1['noop_s']:.1f} ms "
                   f"at {r1['shards']} (≈{p['noop_ms_per_shard']:.2f} ms per shard: resolving, stat-ing and hashing "
                   f"each shard file for the raw_shards fingerprint); Dagster adds ≈{1e3 * p['dagster_per_run_s']:.0f} ms "
                   f"per run + {1e3 * p['dagster_per_step_s']:.0f} ms per step regardless of shards.")
    if "memory" in res:
        rows = res["memory"]["rows"]
        last = rows[-1]
        kinds = ", ".join(f"`{k.lstrip('.')}` {v / 1e3:.1f} kB" for k, v in last.get("replicated_by_kind", {}).items())
        out.append(f"FSDP memory: efficiency {last['efficiency']:.3f} at {last['devices']} devices; "
                   f"{last['replicated_bytes'] / 1e3:.1f} kB per device stays replicated (×{last['devices']} = "
                   f"{last['devices'] * last['replicated_bytes'] / rows[0]['total']:.1%} of the 1-device total): "
                   f"leaves with no `embed` axis, which FSDP leaves whole ({kinds}; AdamW's mu/nu of these follow "
                   f"the parameters); measured / estimate {last['total'] / last['est_total']:.3f}.")
    return out


def markdown(res: dict) -> str:
    cpu = res.get("cpu") or {}
    where = f"{cpu['model']} ({', '.join(cpu['isa'])}), " if cpu else ""
    L = [f"Run {res['date']} on {where}{res['cores']} cores, load average {res['load_start']:.1f} at start / "
         f"{res['load_end']:.1f} at end{' (`--quick`)' if res['quick'] else ''}; total {res['elapsed_s']:.0f} s. "
         "Generated by the script; absolute times are noisy on the shared machine.", "",
         "![scaling](img/scaling.png)", ""]
    if "train" in res:
        L += [f"**Train step vs shape** (GPT-2 f32, AdamW, vocab {VOCAB}, batch {BATCH}, one CPU device, "
              "median step):", "",
              "| sweep | layers | width | ctx | params | GFLOP/step | step ms | GFLOP/s |", "|---|---|---|---|---|---|---|---|"]
        for name, s in res["train"].items():
            for r in s["rows"]:
                L.append(f"| {name} | {r['layers']} | {r['width']} | {r['ctx']} | {r['params'] / 1e6:.2f} M | "
                         f"{r['flops'] / 1e9:.2f} | {1e3 * r['step_s']:.1f} | {r['flops_per_s'] / 1e9:.2f} |")
        L += ["", "Log-log slopes (time vs FLOPs of the model, per sweep): "
              + "; ".join(f"{n} {s['time_slope']:.2f} vs {s['flops_slope']:.2f}" for n, s in res["train"].items()), ""]
    if "cache" in res:
        c = res["cache"]
        L += ["**Cache build vs corpus size** (`build_cache`, `num_workers=1`, stdlib `.py` text, best of "
              f"{res['cache_repeats']}):", "", "| MB | docs | shards | tokens | build s | MB/s | M tokens/s | encode-only s |",
              "|---|---|---|---|---|---|---|---|"]
        L += [f"| {r['mb']:.2f} | {r['docs']} | {r['shards']} | {r['tokens']:,} | {r['build_s']:.2f} | "
              f"{r['mb_per_s']:.2f} | {r['tokens_per_s'] / 1e6:.3f} | {r['encode_s']:.2f} |" for r in c["rows"]]
        L += ["", f"Slope of time vs MB: **{c['slope']:.2f}**, vs tokens {c['token_slope']:.2f} (1 = linear); "
              f"the tokenizer alone on the same text (`encode_batch_fast`, 64 documents a call): "
              f"{c['encode_slope']:.2f}.", ""]
    if "pipeline" in res:
        p = res["pipeline"]
        L += ["**No-op pipeline vs shards** (fresh `Pipeline`, `token_cache()` = 3 cache hits; `plan()` = 6 stages; "
              "medians):", "", "| shards | first build s | no-op ms | plan() ms |", "|---|---|---|---|"]
        L += [f"| {r['shards']} | {r['first_build_s']:.2f} | {1e3 * r['noop_s']:.1f} | {1e3 * r['plan_s']:.1f} |"
              for r in p["rows"]]
        L += ["", "Dagster's own overhead, `materialize` of k chained no-op assets (ephemeral instance, in-process): "
              + ", ".join(f"k={k}: {1e3 * v:.0f} ms" for k, v in p["dagster"].items())
              + f" → {1e3 * p['dagster_per_run_s']:.0f} ms per run + {1e3 * p['dagster_per_step_s']:.0f} ms per step. "
              f"Core no-op slope vs shards {p['noop_slope']:.2f} ({p['noop_ms_per_shard']:.2f} ms/shard).", ""]
    if "memory" in res:
        m = res["memory"]
        s = m["shape"]
        L += [f"**Params + optimizer per device vs FSDP devices** (GPT-2 {s['layers']}×{s['width']}, vocab {VOCAB}, "
              "`fsdp_axis: embed`, simulated CPU devices, bytes of device 0's shards after `init`):", "",
              "| devices | params MB | AdamW MB | total MB | replicated kB | estimate MB | N·bytes(N)/bytes(1) | efficiency |",
              "|---|---|---|---|---|---|---|---|"]
        L += [f"| {r['devices']} | {r['params_bytes'] / 1e6:.3f} | {r['opt_bytes'] / 1e6:.3f} | {r['total'] / 1e6:.3f} | "
              f"{r['replicated_bytes'] / 1e3:.1f} | {r['est_total'] / 1e6:.3f} | {r['n_times_bytes_rel']:.3f} | "
              f"{r['efficiency']:.3f} |" for r in m["rows"]]
        L += ["", f"Slope vs devices **{m['slope']:.2f}** (−1 = 1/N); RESULT ratio = efficiency at "
              f"{m['rows'][-1]['devices']} devices = **{m['rows'][-1]['efficiency']:.3f}**.", ""]
    L += ["Measured deviations (generated):", ""] + [f"- {d}" for d in deviations(res)]
    return "\n".join(L)


def write_docs(md: str) -> None:
    path = ROOT / "docs" / "benchmarks.md"
    text = path.read_text(encoding="utf-8")
    block = f"{BEGIN}\n{md}\n{END}"
    if BEGIN in text and END in text:
        a, b = text.index(BEGIN), text.index(END) + len(END)
        text = text[:a] + block + text[b:]
    else:
        text = text.rstrip("\n") + "\n\n## Scaling (`bench/scaling.py`)\n\n" + block + "\n"
    path.write_text(text, encoding="utf-8")


def _import_tok() -> None:
    """Make bench/tokenize_throughput.py's corpus and tokenizer helpers importable as ``bench_tok``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_tok", Path(__file__).resolve().parent / "tokenize_throughput.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["bench_tok"] = mod


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer points and repeats (about a minute)")
    p.add_argument("--sections", default="train,cache,pipeline,memory", help="comma-separated subset")
    p.add_argument("--steps", type=int, default=None, help="timed train steps per shape (default 7, --quick 3)")
    p.add_argument("--repeats", type=int, default=None, help="no-op pipeline / Dagster repeats (default 5, --quick 3)")
    p.add_argument("--no-write", action="store_true", help="do not write the PNG or docs/benchmarks.md")
    p.add_argument("--_memory-worker", dest="memory_worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_worker:
        counts = tuple(int(x) for x in args.memory_worker.split(","))
        print("MEMORY " + json.dumps(memory_per_device(counts)), flush=True)
        return
    args.steps = args.steps or (3 if args.quick else 7)
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.cache_repeats = 1 if args.quick else 3
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    for s in sections:
        if s not in ("train", "cache", "pipeline", "memory"):
            p.error(f"unknown section {s!r}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _import_tok()

    t_start = time.perf_counter()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    res: dict = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                 "cores": cores, "load_start": loadavg(), "quick": args.quick, "cache_repeats": args.cache_repeats,
                 **host_info()}
    print(host_line(res))
    print(f"{cores} cores, load average {res['load_start']:.1f}; sections {', '.join(sections)}"
          f"{' (--quick)' if args.quick else ''}", flush=True)
    work = tempfile.mkdtemp(prefix="lm_scaling_")
    try:
        if "memory" in sections:  # first: a subprocess, before this process holds JAX's thread pools
            res["memory"] = memory_section(args)
        if "train" in sections:
            res["train"] = train_section(args)
        if "cache" in sections:
            res["cache"] = cache_section(args, work)
        if "pipeline" in sections:
            res["pipeline"] = pipeline_section(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["load_end"] = loadavg()
    res["elapsed_s"] = time.perf_counter() - t_start

    if "train" in res:
        print_train(res["train"])
    if "cache" in res:
        print_cache(res["cache"])
    if "pipeline" in res:
        print_pipeline(res["pipeline"])
    if "memory" in res:
        print_memory(res["memory"])
    print()
    for d in deviations(res):
        print("* " + d)
    print(f"\nload average {res['load_start']:.1f} at start, {res['load_end']:.1f} at end; {res['elapsed_s']:.0f} s")
    if not args.no_write:
        png = ROOT / "docs" / "img" / "scaling.png"
        plot(res, png)
        write_docs(markdown(res))
        print(f"wrote {png.relative_to(ROOT)} and the scaling section of docs/benchmarks.md")

    def r4(x):
        if isinstance(x, float):
            return round(x, 6 if abs(x) < 1 else 4)
        if isinstance(x, dict):
            return {k: r4(v) for k, v in x.items()}
        if isinstance(x, list):
            return [r4(v) for v in x]
        return x

    mem = res.get("memory")
    result = {"ratio": round(mem["rows"][-1]["efficiency"], 4) if mem else None, **r4(res)}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
