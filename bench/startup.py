"""Time to first step: the CLI's ``lm-pipeline train`` and the default pipeline's training step,
without and with the persistent XLA compilation cache (:mod:`lm_pipeline.xla_cache`).

Each measurement is a fresh process tree started from here, on data built beforehand (the token
cache is a hit in every run, so only training's start-up is timed); before each run the
``train_ckpt`` artifact is deleted, so the run starts from step 0 again. Modes:

* ``off``: ``LM_PIPELINE_XLA_CACHE=off``: every program compiled (the behaviour before the cache);
* ``cold``: an empty cache directory (compiles, and writes the cache);
* ``warm``: the cache directory a previous run of the same config filled (a re-run).

Targets:

* ``cli``: ``lm-pipeline train --config_path CONFIG --store.root STORE`` (the console script:
  re-executed with tcmalloc, as a user runs it);
* ``pipeline``: ``python -m assets materialize --select "*<experiment>/train_ckpt"`` with
  ``LM_PIPELINE_EXPERIMENT`` (default ``configs/experiments/default.yaml``) and a fresh
  ``DAGSTER_HOME``: the upstream assets are cache hits, the training step is the Pipes child
  ``python -m lm_pipeline.pipes_train``.

The first step's end is when its line appears in the run's ``metrics.jsonl`` (polled every
10 ms); the time is counted from the moment the process is started. Phases, from the run's log
timestamps where the process prints them: ``start`` (interpreter, imports, tcmalloc re-exec:
until the first log line), ``data`` (config, the cached data stages: until the training stage
starts building), ``prepare`` (mesh, step functions, state initialisation: until the first step
starts), ``step1`` (the first step, its compilation included: its ``throughput/step_seconds``).
Rounds alternate the modes (``off, cold, warm`` in each round), so a slow stretch of a shared
machine hits every mode; medians are reported, with the load average before and after.

    python bench/startup.py [--targets cli,pipeline] [--rounds 2] [--steps 3] [--config configs/tiny_gpt2.yaml]

The last line is ``RESULT {json}``: ``ratio`` = warm / cold time to first step of the CLI
(median over rounds). The pipeline's ``pipeline_ratio`` is its training stage's (from the start
of Dagster's ``train_ckpt`` step to the first step); ``pipeline_whole_run_ratio`` counts from the
Dagster command's start, the data assets' steps included. Target: ratio <= 1/3.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from common import host_info, host_line, log_marks  # noqa: E402

PY = sys.executable
CLI = str(Path(PY).with_name("lm-pipeline"))
MODES = ("off", "cold", "warm")
#: (phase, the log line that ends it), in order; a phase whose line is missing merges into the next.
MARKS = (
    ("dagster", r"RUN_START"),  # pipeline: the Dagster CLI loaded the definitions and started the run
    ("upstream", r"train_ckpt - STEP_START"),  # pipeline: the data assets (cache hits) ran
    ("child", r"\[pipes\] external process successfully opened"),  # pipeline: the Pipes child started
    ("start", r"lm_pipeline.cli: allocator"),  # CLI: interpreter, imports, tcmalloc re-exec
    ("data", r"train_ckpt [0-9a-f]+: building at"),  # config and the cached data stages
)


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def _first_step(store: str, deadline: float, proc: subprocess.Popen) -> tuple[float | None, dict]:
    """Wall time at which step 1's line appears in a ``metrics.jsonl`` under ``store``, and the line."""
    pattern = os.path.join(store, "train_ckpt", "*", "metrics.jsonl")
    while time.time() < deadline:
        for path in glob.glob(pattern):
            try:
                with open(path) as f:
                    first = f.readline()
            except OSError:
                continue
            if first.endswith("\n"):
                now = time.time()
                rec = json.loads(first)
                if rec.get("step") == 1:
                    return now, rec
        if proc.poll() is not None:
            return None, {}
        time.sleep(0.01)
    return None, {}


def _phases(log_text: str, t0: float, t_first: float, step1: float) -> dict[str, float]:
    """Phase durations from the log's timestamps (a phase whose line is missing merges forward;
    Dagster's own lines have whole seconds)."""
    found = log_marks(log_text, MARKS)
    out: dict[str, float] = {}
    prev = t0
    for name, t in [*((n, found.get(n)) for n, _ in MARKS), ("prepare", t_first - step1)]:
        if t is None or t < prev:
            continue
        out[name] = t - prev
        prev = t
    out["step1"] = t_first - prev
    return out


def _run_once(target: str, mode: str, args, work: Path, xla_dir: str | None) -> dict:
    store = str(work / ("store_" + target))
    shutil.rmtree(os.path.join(store, "train_ckpt"), ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["LM_PIPELINE_XLA_CACHE"] = "off" if mode == "off" else str(xla_dir)
    overrides = [f"trainer.num_train_steps={args.steps}", "trainer.log_every=1", "trainer.progress=false",
                 f"store.root={store}", "trainer.steps_per_eval=100000"]
    if target == "cli":
        cmd = [CLI, "train", "--config_path", str(ROOT / args.config)]
        for o in overrides:
            k, v = o.split("=", 1)
            cmd += [f"--{k}", v]
    else:
        home = work / f"dagster_home_{mode}_{time.time_ns()}"
        env.update(DAGSTER_HOME=str(home), LM_PIPELINE_EXPERIMENT=str(ROOT / args.experiment),
                   LM_PIPELINE_OVERRIDES=" ".join(overrides))
        name = Path(args.experiment).stem
        cmd = [PY, "-m", "assets", "materialize", "--select", f"*{name}/train_ckpt"]
    log_path = work / f"{target}_{mode}_{time.time_ns()}.log"
    with open(log_path, "w") as log:
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT)
        t_first, rec = _first_step(store, t0 + args.timeout, proc)
        rc = proc.wait(timeout=args.timeout)
    text = log_path.read_text(errors="replace")
    if t_first is None or rc != 0:
        raise SystemExit(f"{target}/{mode}: no first step (exit {rc}); log {log_path}:\n{text[-3000:]}")
    step1 = float(rec.get("throughput/step_seconds", 0.0))
    # The training stage's own time to first step: from the start of Dagster's train_ckpt step
    # (the pipeline), or the whole process (the CLI, which is the training stage).
    stage_start = log_marks(text, MARKS).get("upstream") if target == "pipeline" else None
    stage = t_first - stage_start if stage_start is not None else t_first - t0
    return {"ttfs": t_first - t0, "stage": stage, "phases": _phases(text, t0, t_first, step1), "total": time.time() - t0}


def _prepare_data(target: str, args, work: Path) -> None:
    """Build the data stages once (untimed), so every timed run finds them cached."""
    store = str(work / ("store_" + target))
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    if target == "cli":
        cmd = [CLI, "cache", "--config_path", str(ROOT / args.config), "--store.root", store]
    else:
        env.update(DAGSTER_HOME=str(work / "dagster_home_data"), LM_PIPELINE_EXPERIMENT=str(ROOT / args.experiment),
                   LM_PIPELINE_OVERRIDES=f"store.root={store}")
        name = Path(args.experiment).stem
        cmd = [PY, "-m", "assets", "materialize", "--select", f"*{name}/token_cache"]
    r = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{target}: building the data failed:\n{(r.stdout + r.stderr)[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="cli,pipeline")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--config", default="configs/tiny_gpt2.yaml", help="the CLI's config")
    p.add_argument("--experiment", default="configs/experiments/default.yaml", help="the pipeline's experiment")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, stores)")
    args = p.parse_args()
    targets = [t for t in args.targets.split(",") if t]
    work = Path(tempfile.mkdtemp(prefix="lm_startup_"))
    load_before = _loadavg()
    host = host_info()
    print(host_line(host))
    print(f"work dir {work}; load average before: {load_before}")
    results: dict[str, dict[str, list[dict]]] = {t: {m: [] for m in MODES} for t in targets}
    try:
        for target in targets:
            _prepare_data(target, args, work)
            warm_dir = str(work / f"xla_warm_{target}")
            _run_once(target, "cold", args, work, warm_dir)  # untimed: fills the warm cache
            for r in range(args.rounds):
                for mode in MODES:
                    xla_dir = warm_dir if mode == "warm" else str(work / f"xla_cold_{target}_{r}")
                    res = _run_once(target, mode, args, work, xla_dir)
                    results[target][mode].append(res)
                    ph = " ".join(f"{k} {v:5.2f}" for k, v in res["phases"].items())
                    print(f"  {target:8s} round {r} {mode:4s}: first step at {res['ttfs']:6.2f} s, "
                          f"{res['stage']:6.2f} s after the training stage started  ({ph})  "
                          f"[load {_loadavg()}]", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    load_after = _loadavg()
    print(f"\nload average after: {load_after}")
    summary: dict[str, object] = {"load_before": load_before, "load_after": load_after, "rounds": args.rounds,
                                  "cpu_count": os.cpu_count(), **host}
    print(f"\n{'target':9s} {'mode':5s} {'first step s':>12s} {'stage s':>8s}  phases (median s)")
    for target in targets:
        med, stage = {}, {}
        for mode in MODES:
            runs = results[target][mode]
            med[mode] = statistics.median(r["ttfs"] for r in runs)
            stage[mode] = statistics.median(r["stage"] for r in runs)
            names = list(dict.fromkeys(k for r in runs for k in r["phases"]))
            ph = "  ".join(f"{k} {statistics.median(r['phases'].get(k, 0.0) for r in runs):.2f}" for k in names)
            print(f"{target:9s} {mode:5s} {med[mode]:12.2f} {stage[mode]:8.2f}  {ph}")
            summary[f"{target}_{mode}_s"] = round(med[mode], 3)
            if target == "pipeline":
                summary[f"{target}_stage_{mode}_s"] = round(stage[mode], 3)
        # The ratio is the training stage's: the CLI process, the pipeline's train_ckpt step.
        summary[f"{target}_ratio"] = round(stage["warm"] / stage["cold"], 3)
        summary[f"{target}_ratio_vs_off"] = round(stage["warm"] / stage["off"], 3)
        if target == "pipeline":
            summary["pipeline_whole_run_ratio"] = round(med["warm"] / med["cold"], 3)
    summary["ratio"] = summary[f"{targets[0]}_ratio"]
    print("RESULT " + json.dumps(summary))


if __name__ == "__main__":
    main()
