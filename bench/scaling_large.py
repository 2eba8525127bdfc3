"""Corpora larger than memory: token cache build time, peak memory and loader cost vs corpus size.

Generates one corpus of ``max(--sizes-mb)`` MB of text (default 1 GB; never committed: it lives in
a temporary directory under ``/tmp``, removed at the end) as many JSONL/zstd shards of
``--shard-mb`` MB of text each (``train-00000.jsonl.zst``, ...; one ``{"id", "text"}`` record per
line), as a user's data would be. Documents are seeded mixes of line-aligned slices of the Python
standard library's ``.py`` files (no download): 1-3 slices of random files per document, lengths
log-normal around 3 kB (200 B - 200 kB). Each size is a prefix of the shard list, so every size
has the same mix. A byte-level BPE (vocab 2048) is trained once on a fixed 8 MB sample drawn with
another seed.

For each size, largest first (so the figures that matter most come first on a busy machine), in
child processes with tcmalloc preloaded as the ``lm-pipeline`` command line runs (``--allocator
glibc`` for plain malloc; with glibc the builder's RSS creeps up slowly with the bytes written --
allocator arenas of TensorStore's threads -- see ``docs/benchmarks.md``):

1. **Build** -- a fresh child process resolves the shards through the real data path
   (:func:`lm_pipeline.data.sources.resolve.resolve_shards`: fingerprints = sha256 of the
   compressed files; streamed decompression, per-record validation) and runs
   :func:`lm_pipeline.data.cache.build_cache` (``--workers`` tokenizer processes, groups of 8
   shards). Measured: wall time and CPU time (builder + workers) of ``build_cache`` alone, the
   builder's peak RSS (``VmHWM``) and its RSS before building, the workers' peak RSS
   (``getrusage(RUSAGE_CHILDREN)``), and the peak of the whole process tree's summed RSS
   (sampled by this process every 0.25 s from ``/proc``).
2. **Loader** -- a fresh child process (no JAX imported: the loader alone) opens the cache with
   :func:`lm_pipeline.data.loader.open_dataset` (``seq_len`` 128; ``concat``, and ``greedy``
   whose stored layout is derived on first open) and reads ``--batches`` step batches of 8 rows
   through :class:`~lm_pipeline.batch.StepBatchSource` synchronously (after 5 warm-up batches):
   per-batch time (median, p95) and RSS after importing, after opening, after the batches, and
   its peak. 1000 batches of 8 random rows touch more distinct 16 KiB chunks than TensorStore's
   64 MB chunk cache holds, so the cache is full at every size and the RSS is comparable. The cache is deleted after this step (at most one cache on disk at a time).
3. **Train step** -- once, in a child process: the real jitted train step
   (``bench/scaling.py``'s :class:`StepTimer`: GPT-2 4 layers x width 128, context 128, batch 8,
   f32, AdamW, one CPU device), median of ``--steps``; loader ms / step ms is the share of a
   step that reading its batch would cost if it were not prefetched at all.

Fits: time vs MB (least squares, R^2; log-log slope, 1 = linear), MB/s and CPU s/MB per size
(CPU time is less sensitive to other processes' load than wall time; the load average is
printed). Caches are read while still in the page cache (the machine has more memory than the
largest cache): loader times are warm-cache times.

    python bench/scaling_large.py [--sizes-mb 128,256,512,1024] [--shard-mb 8] [--workers 2]
                                  [--batches 1000] [--allocator tcmalloc]
                                  [--smoke] [--work-root /tmp]

``--smoke``: 1/2/4 MB in 0.5 MB shards, 1 worker, 20 batches, a tiny model (seconds; the test).

The last line is ``RESULT {json}``; ``ratio`` = the builder's peak RSS at the largest size / at
the smallest (1.0 = flat in corpus size; the corpus grows ``max/min`` times).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, host_info, host_line, loadavg  # noqa: E402

VOCAB = 2048
BATCH = 8
GROUP = 8
SAMPLE_MB = 8.0


# --- process memory ----------------------------------------------------------------------------


def proc_status(pid: int | str = "self") -> dict[str, float]:
    """VmRSS and VmHWM of a process, in MB (10^6 bytes); {} if it is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, kb = line.split()[:2]
                    out[key[:-1]] = int(kb) * 1024 / 1e6
    except OSError:
        pass
    return out


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


class TreeSampler:
    """Peak of the summed RSS of a process and its descendants, sampled on a thread."""

    def __init__(self, pid: int, period_s: float = 0.25):
        self.pid, self.period, self.peak_mb = pid, period_s, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            total = sum(proc_status(p).get("VmRSS", 0.0) for p in _descendants(self.pid))
            self.peak_mb = max(self.peak_mb, total)
            self._stop.wait(self.period)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_mb


def child_env(allocator: str) -> dict[str, str]:
    """The children's environment: tcmalloc preloaded (as the ``lm-pipeline`` command line runs) or
    plain glibc malloc."""
    from lm_pipeline import launch

    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", JAX_PLATFORMS="cpu")
    kept = [x for x in env.get("LD_PRELOAD", "").replace(":", " ").split() if "tcmalloc" not in x]
    if allocator == "tcmalloc":
        lib = launch.find_tcmalloc()
        if lib is None:
            raise SystemExit("--allocator tcmalloc: no tcmalloc library found (use --allocator glibc)")
        kept.append(lib)
    env["LD_PRELOAD"] = " ".join(kept)
    env[launch.OPT_OUT_ENV] = "1"
    return env


CHILD_ENV: dict[str, str] = {}


def run_child(mode: str, payload: dict, timeout: float | None = None) -> tuple[dict, float]:
    """Run this script as ``--_<mode> <json>`` in a fresh process; (its ``<MODE> {json}`` line, tree peak RSS MB)."""
    env = CHILD_ENV or dict(os.environ, TOKENIZERS_PARALLELISM="false", JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, __file__, f"--_{mode}", json.dumps(payload)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    sampler = TreeSampler(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        peak = sampler.stop()
        if proc.poll() is None:
            proc.kill()
    tag = mode.upper() + " "
    lines = [ln for ln in out.splitlines() if ln.startswith(tag)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} child failed (rc {proc.returncode}):\n{out[-2000:]}\n{err[-4000:]}")
    return json.loads(lines[-1][len(tag):]), peak


# --- the corpus --------------------------------------------------------------------------------


def stdlib_pool() -> list[str]:
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    pool = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) > 200:
            pool.append(text)
    return pool


def documents(pool: list[str], seed: int):
    """Endless seeded documents: 1-3 line-aligned slices of random stdlib files, ~3 kB log-normal."""
    rng = random.Random(seed)
    while True:
        target = int(min(max(rng.lognormvariate(math.log(3000), 1.0), 200), 200_000))
        parts, total = [], 0
        for _ in range(rng.choice((1, 1, 2, 3))):
            f = pool[rng.randrange(len(pool))]
            start = f.rfind("\n", 0, rng.randrange(len(f))) + 1
            end = f.find("\n", start + max(1, target - total))
            piece = f[start:] if end < 0 else f[start : end + 1]
            parts.append(piece)
            total += len(piece)
            if total >= target:
                break
        yield "".join(parts)


def write_corpus(out_dir: str, total_mb: float, shard_mb: float, seed: int = 0) -> list[dict]:
    """JSONL/zstd shards of ``shard_mb`` MB of text each, ``total_mb`` in all; per-shard counts."""
    import zstandard

    pool = stdlib_pool()
    docs = documents(pool, seed)
    shards, n_shards = [], max(1, round(total_mb / shard_mb))
    cctx = zstandard.ZstdCompressor(level=3)
    doc_id = 0
    for i in range(n_shards):
        path = os.path.join(out_dir, f"train-{i:05d}.jsonl.zst")
        nbytes = ndocs = 0
        with open(path, "wb") as raw, cctx.stream_writer(raw) as w:
            while nbytes < shard_mb * 1e6:
                text = next(docs)
                w.write((json.dumps({"id": doc_id, "text": text}) + "\n").encode("utf-8"))
                nbytes += len(text.encode("utf-8"))
                ndocs += 1
                doc_id += 1
        shards.append({"path": path, "text_bytes": nbytes, "docs": ndocs, "file_bytes": os.path.getsize(path)})
    return shards


def train_tokenizer(tok_dir: str, sample_mb: float, seed: int = 12345) -> str:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_tok", Path(__file__).resolve().parent / "tokenize_throughput.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    texts, budget, docs = [], sample_mb * 1e6, documents(stdlib_pool(), seed)
    while budget > 0:
        texts.append(next(docs))
        budget -= len(texts[-1].encode("utf-8"))
    return mod.train_tokenizer(texts, tok_dir, VOCAB)


# --- child processes ---------------------------------------------------------------------------


def _cpu_s() -> float:
    import resource

    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def build_child(p: dict) -> dict:
    import resource

    from lm_pipeline.data.cache import build_cache
    from lm_pipeline.data.config import DataConfig
    from lm_pipeline.data.sources.resolve import resolve_shards

    rss_start = proc_status()["VmRSS"]
    cpu0, t0 = _cpu_s(), time.perf_counter()
    shards = resolve_shards(DataConfig(train_urls=tuple(p["urls"])), "train")
    ledger = build_cache(p["out"], shards, p["tokdir"], num_workers=p["workers"], shard_group_size=GROUP,
                         progress=False)
    wall, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
    c = ledger["committed"]
    du = sum(f.stat().st_size for f in Path(p["out"]).rglob("*") if f.is_file())
    return {"build_s": wall, "cpu_s": cpu, "rss_start_mb": rss_start, "builder_peak_mb": proc_status()["VmHWM"],
            "workers_peak_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e6,
            "docs": c["docs"], "tokens": c["tokens"], "text_bytes": c["bytes"], "shards": c["shards"],
            "cache_bytes": du, "ledger_bytes": os.path.getsize(os.path.join(p["out"], "ledger.json"))}


def loader_child(p: dict) -> dict:
    import numpy as np

    from lm_pipeline.data.loader import make_batch_source, open_dataset

    rss_import = proc_status()["VmRSS"]
    t0 = time.perf_counter()
    ds = open_dataset(p["cache"], p["seq_len"], p["packing"])
    open_s = time.perf_counter() - t0
    rss_open = proc_status()["VmRSS"]
    src = make_batch_source(ds, BATCH, seed=0, process_index=0, process_count=1)
    for k in range(5):
        src.batch(k)
    times = []
    for k in range(5, 5 + p["batches"]):
        t0 = time.perf_counter()
        b = src.batch(k)
        times.append(time.perf_counter() - t0)
        assert b.tokens.shape == (BATCH, p["seq_len"])
    st = proc_status()
    return {"packing": p["packing"], "rows": len(ds), "open_s": open_s, "batches": len(times),
            "batch_ms_median": 1e3 * statistics.median(times), "batch_ms_p95": 1e3 * float(np.percentile(times, 95)),
            "batch_ms_mean": 1e3 * statistics.fmean(times), "rss_import_mb": rss_import, "rss_open_mb": rss_open,
            "rss_end_mb": st["VmRSS"], "peak_mb": st["VmHWM"]}


def step_child(p: dict) -> dict:
    import scaling

    timer = scaling.StepTimer(p["layers"], p["width"], p["ctx"])
    times = [timer.step() for _ in range(p["steps"])]
    return {"step_ms_median": 1e3 * statistics.median(times), "step_ms_min": 1e3 * min(times),
            "layers": p["layers"], "width": p["width"], "ctx": p["ctx"], "batch": scaling.BATCH, "steps": len(times)}


# --- the sweep ---------------------------------------------------------------------------------


def linear_fit(xs: list[float], ys: list[float]) -> dict:
    import numpy as np

    x, y = np.asarray(xs, float), np.asarray(ys, float)
    if len(x) < 2:
        return {"slope": float("nan"), "intercept": float("nan"), "r2": float("nan"), "loglog": float("nan")}
    b, a = np.polyfit(x, y, 1)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - (a + b * x)) ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    return {"slope": float(b), "intercept": float(a), "r2": r2,
            "loglog": float(np.polyfit(np.log(x), np.log(y), 1)[0])}


def sweep(args, work: str) -> dict:
    sizes = sorted(args.sizes_mb)
    shard_mb = min(args.shard_mb, sizes[0])
    corpus = os.path.join(work, "corpus")
    os.makedirs(corpus)
    t0 = time.perf_counter()
    shards = write_corpus(corpus, sizes[-1], shard_mb)
    gen_s = time.perf_counter() - t0
    print(f"corpus: {len(shards)} shards, {sum(s['text_bytes'] for s in shards) / 1e6:.1f} MB of text, "
          f"{sum(s['file_bytes'] for s in shards) / 1e6:.1f} MB zstd, {gen_s:.0f} s", flush=True)
    t0 = time.perf_counter()
    tokdir = train_tokenizer(os.path.join(work, "tok"), args.sample_mb)
    print(f"tokenizer: trained on {args.sample_mb:g} MB in {time.perf_counter() - t0:.0f} s", flush=True)
    step_shape = {"layers": 1, "width": 32, "ctx": args.seq_len} if args.smoke else \
        {"layers": 4, "width": 128, "ctx": args.seq_len}
    step, _ = run_child("step", {**step_shape, "steps": args.steps})
    print(f"train step ({step_shape}, batch {BATCH}): {step['step_ms_median']:.1f} ms", flush=True)
    rows = []
    for mb in sorted(sizes, reverse=True):  # the largest first: its figures are the ones that must come
        n = max(1, round(mb / shard_mb))
        urls = [s["path"] for s in shards[:n]]
        out = os.path.join(work, f"cache-{mb:g}")
        load0 = loadavg()
        b, tree = run_child("build", {"urls": urls, "out": out, "tokdir": tokdir, "workers": args.workers})
        row = {"mb": b["text_bytes"] / 1e6, "file_mb": sum(s["file_bytes"] for s in shards[:n]) / 1e6, **b,
               "tree_peak_mb": tree, "load_before": load0, "mb_per_s": b["text_bytes"] / 1e6 / b["build_s"],
               "cpu_s_per_mb": b["cpu_s"] / (b["text_bytes"] / 1e6)}
        print(f"  {row['mb']:.0f} MB: build {b['build_s']:.1f} s ({row['mb_per_s']:.2f} MB/s, cpu "
              f"{row['cpu_s_per_mb']:.2f} s/MB), builder peak {b['builder_peak_mb']:.0f} MB (start "
              f"{b['rss_start_mb']:.0f}), workers {b['workers_peak_mb']:.0f} MB, tree {tree:.0f} MB, "
              f"cache {b['cache_bytes'] / 1e6:.0f} MB, load {load0:.1f}", flush=True)
        row["loader"] = {}
        for packing in args.packings:
            ld, _ = run_child("loader", {"cache": out, "seq_len": args.seq_len, "packing": packing,
                                         "batches": args.batches})
            row["loader"][packing] = ld
            print(f"    loader {packing}: {ld['rows']} rows, open {ld['open_s']:.2f} s, "
                  f"{ld['batch_ms_median']:.2f} ms/batch (p95 {ld['batch_ms_p95']:.2f}), RSS import "
                  f"{ld['rss_import_mb']:.0f} / open {ld['rss_open_mb']:.0f} / end {ld['rss_end_mb']:.0f} / "
                  f"peak {ld['peak_mb']:.0f} MB", flush=True)
        shutil.rmtree(out, ignore_errors=True)
        rows.append(row)
        print("ROW " + json.dumps(row), flush=True)
    rows.sort(key=lambda r: r["mb"])
    fit = linear_fit([r["mb"] for r in rows], [r["build_s"] for r in rows])
    cpu_fit = linear_fit([r["mb"] for r in rows], [r["cpu_s"] for r in rows])
    rates = [r["mb_per_s"] for r in rows]
    return {"rows": rows, "step": step, "fit": fit, "cpu_fit": cpu_fit, "shard_mb": shard_mb,
            "corpus_gen_s": gen_s, "mb_per_s_spread": max(rates) / min(rates)}


def summarize(res: dict, packings: list[str]) -> dict:
    rows, step_ms = res["rows"], res["step"]["step_ms_median"]
    first, last = rows[0], rows[-1]
    out = {"builder_peak_ratio": last["builder_peak_mb"] / first["builder_peak_mb"],
           "builder_peak_max_mb": max(r["builder_peak_mb"] for r in rows),
           "builder_growth_max_mb": max(r["builder_peak_mb"] - r["rss_start_mb"] for r in rows),
           "workers_peak_max_mb": max(r["workers_peak_mb"] for r in rows),
           "tree_peak_max_mb": max(r["tree_peak_mb"] for r in rows), "size_ratio": last["mb"] / first["mb"]}
    for p in packings:
        out[f"loader_{p}_peak_ratio"] = last["loader"][p]["peak_mb"] / first["loader"][p]["peak_mb"]
        out[f"loader_{p}_max_share_of_step"] = max(r["loader"][p]["batch_ms_median"] for r in rows) / step_ms
    return out


def print_table(res: dict, packings: list[str]) -> None:
    step_ms = res["step"]["step_ms_median"]
    head = "| MB text | shards | tokens | build s | MB/s | CPU s/MB | builder peak RSS MB (start) | workers MB | tree MB |"
    for p in packings:
        head += f" loader {p} peak RSS MB | {p} ms/batch |"
    print("\n" + head + " step ms |")
    print("|" + "---|" * (head.count("|") - 1 + 1))
    for r in res["rows"]:
        line = (f"| {r['mb']:.0f} | {r['shards']} | {r['tokens'] / 1e6:.1f} M | {r['build_s']:.1f} | "
                f"{r['mb_per_s']:.2f} | {r['cpu_s_per_mb']:.2f} | {r['builder_peak_mb']:.0f} ({r['rss_start_mb']:.0f}) | "
                f"{r['workers_peak_mb']:.0f} | {r['tree_peak_mb']:.0f} |")
        for p in packings:
            ld = r["loader"][p]
            line += f" {ld['peak_mb']:.0f} | {ld['batch_ms_median']:.2f} |"
        print(line + f" {step_ms:.1f} |")
    f, c = res["fit"], res["cpu_fit"]
    print(f"\nbuild time = {f['intercept']:.2f} s + {f['slope']:.3f} s/MB (R² {f['r2']:.4f}, log-log slope "
          f"{f['loglog']:.3f}); CPU time = {c['intercept']:.2f} s + {c['slope']:.3f} s/MB (R² {c['r2']:.4f}, "
          f"log-log {c['loglog']:.3f}); MB/s max/min {res['mb_per_s_spread']:.2f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", default="128,256,512,1024", help="comma-separated corpus sizes (MB of text)")
    p.add_argument("--shard-mb", type=float, default=8.0, help="MB of text per shard file")
    p.add_argument("--workers", type=int, default=2, help="tokenizer worker processes of build_cache")
    p.add_argument("--batches", type=int, default=1000,
                   help="timed loader batches per cache and packing (1000 x 8 rows fill TensorStore's 64 MB chunk cache)")
    p.add_argument("--packings", default="concat,greedy")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=10, help="timed train steps")
    p.add_argument("--sample-mb", type=float, default=SAMPLE_MB, help="tokenizer training sample")
    p.add_argument("--work-root", default=tempfile.gettempdir(), help="where the temporary directory goes")
    p.add_argument("--allocator", choices=("tcmalloc", "glibc"), default="tcmalloc",
                   help="malloc of the measured children (the command line preloads tcmalloc when installed)")
    p.add_argument("--smoke", action="store_true", help="1/2/4 MB, 0.5 MB shards, 1 worker, 20 batches, tiny model")
    for mode in ("build", "loader", "step"):
        p.add_argument(f"--_{mode}", dest=f"child_{mode}", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for mode, fn in (("build", build_child), ("loader", loader_child), ("step", step_child)):
        payload = getattr(args, f"child_{mode}")
        if payload is not None:
            print(f"{mode.upper()} " + json.dumps(fn(json.loads(payload))), flush=True)
            return
    if args.smoke:
        args.sizes_mb, args.shard_mb, args.workers, args.batches = "1,2,4", 0.5, 1, 20
        args.sample_mb, args.steps, args.seq_len = min(args.sample_mb, 0.5), 3, 32
    args.sizes_mb = [float(x) for x in str(args.sizes_mb).split(",") if x.strip()]
    args.packings = [x.strip() for x in args.packings.split(",") if x.strip()]
    need = 3.5 * max(args.sizes_mb) * 1e6  # zstd corpus (~0.3x) + the largest cache (~1.4x) + layouts, with room
    free = shutil.disk_usage(args.work_root).free
    if free < need:
        p.error(f"{args.work_root}: {free / 1e9:.1f} GB free, need about {need / 1e9:.1f} GB")
    cores = len(os.sched_getaffinity(0))
    from lm_pipeline import launch

    if args.allocator == "tcmalloc" and launch.find_tcmalloc() is None:
        args.allocator = "glibc"
        print("no tcmalloc library found: the children use glibc malloc", flush=True)
    CHILD_ENV.update(child_env(args.allocator))
    res: dict = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "cores": cores,
                 "load_start": loadavg(), "smoke": args.smoke, "workers": args.workers, "seq_len": args.seq_len,
                 "batch": BATCH, "sizes_mb": args.sizes_mb, "packings": args.packings,
                 "allocator": args.allocator, **host_info()}
    print(host_line(res))
    print(f"{cores} cores, load average {res['load_start']:.2f}; sizes {args.sizes_mb} MB, {args.workers} workers, "
          f"{args.allocator} malloc", flush=True)
    t0 = time.perf_counter()
    work = tempfile.mkdtemp(prefix="lm_scaling_large_", dir=args.work_root)
    try:
        res.update(sweep(args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["load_end"], res["elapsed_s"] = loadavg(), time.perf_counter() - t0
    res["summary"] = summarize(res, args.packings)
    print_table(res, args.packings)
    s = res["summary"]
    print(f"builder peak RSS: max {s['builder_peak_max_mb']:.0f} MB, largest/smallest {s['builder_peak_ratio']:.3f} "
          f"while the corpus grows {s['size_ratio']:.1f}x; load average {res['load_start']:.2f} at start, "
          f"{res['load_end']:.2f} at end; {res['elapsed_s']:.0f} s")

    def r4(x):
        if isinstance(x, float):
            return round(x, 6 if abs(x) < 1 else 4)
        if isinstance(x, dict):
            return {k: r4(v) for k, v in x.items()}
        if isinstance(x, list):
            return [r4(v) for v in x]
        return x

    print("RESULT " + json.dumps({"ratio": round(s["builder_peak_ratio"], 4), **r4(res)}))


if __name__ == "__main__":
    main()
