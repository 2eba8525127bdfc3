"""Quality per wall time: this project's whole command-line run against nanoGPT's CPU recipe, on
the same corpus, machine, model size and number of training tokens, to a held-out bits-per-byte.

**Ours**: ``lm-pipeline train --config_path CONFIG`` as a fresh process from an empty store: the
built-in corpus materialised into an empty directory (``LM_PIPELINE_BUILTIN_DIR``), raw shards,
tokenizer training, token cache, XLA compilation (the persistent cache lives in the store: cold),
training, the final evaluation on the whole validation set and the final checkpoint, timed end to
end from process start to exit. The config is written by this script: GPT-2, 4 layers, 4 heads,
width 128, context 64 tokens, AdamW with nanoGPT's recipe values (peak learning rate 1e-3, cosine
to 1/10, warmup 5% of the steps, weight decay 0.1, beta2 0.99, clipping at 1.0), and as many
steps as make the recipe's number of training tokens at the variant's batch size. Variants change
our own settings only (``--ours``, below). Machine-wide builds are not removed: the native CPU
attention kernel (built once per source version under ``~/.cache/lm_pipeline/native``) is warm
unless ``--cold-native``.

**nanoGPT**: its README's CPU recipe, unchanged (``python train.py config/train_shakespeare_char.py
--device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12
--n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0``), plus
``--dataset`` and ``--out_dir`` naming this run's data and output. Its code is not part of this
project: ``--nanogpt-dir`` names a checkout (``git clone https://github.com/karpathy/nanoGPT``);
its ``train.py`` runs as a subprocess from a work directory holding ``data/<dataset>/``
(``train.bin``, ``val.bin``: uint16 ids; ``meta.pkl``: ``vocab_size``) and a link to its
``configurator.py``, so the checkout itself is not written to. The dataset is byte-level
(vocabulary 256: each id one UTF-8 byte), so its losses are nats per byte. Its time = the data
preparation (a fresh process that selects the same corpus and writes the three files, as its
``prepare.py`` does) + ``train.py`` (which evaluates 2 x 20 batches every 250 steps, as the
recipe says). It runs as users run it (no allocator preloaded) unless ``--nanogpt-tcmalloc``.

**Corpus and held-out bytes**: the built-in corpus (the Python standard library's source,
``data.builtin_max_bytes`` = ``--corpus-bytes``, default 2 MB as in ``configs/data/builtin_small.yaml``),
split into train / validation by hashed file path (5%). nanoGPT's ``train.bin`` / ``val.bin``
are the UTF-8 bytes of exactly the same training / validation documents. bits-per-byte:

* ours: ``lm-pipeline eval`` of the final checkpoint (``lm_pipeline.eval``: nats over the
  predicted tokens / ln 2 / the UTF-8 bytes of those tokens; the whole validation set), run after
  the timed run and not timed; the in-run final evaluation's ``eval/validation/bpb`` (the set's mean
  bytes per token) is reported beside it;
* nanoGPT: its saved checkpoint (``ckpt.pt``, the last one whose 20-batch val loss improved)
  loaded with the checkout's ``model.py`` and evaluated on the whole of ``val.bin`` in
  non-overlapping windows of 64 bytes (every byte but the first predicted), not timed; its own
  last logged val loss / ln 2 is reported beside it.

Tokens: nanoGPT trains ``max_iters + 1`` = 2001 steps of 12 x 64 = 1,536,768 tokens (= bytes).
Ours trains the same number of tokens (``round(tokens / (batch x 64))`` steps): BPE tokens carry
several bytes each, so it reads more text; both counts are reported.

Where our time goes (from the run's log timestamps and ``metrics.jsonl``): ``start`` (process,
imports, tcmalloc re-exec), ``config`` (the config, the stage table, JAX's import),
``raw_shards`` (the built-in corpus materialised and validated),
``tokenizer`` (BPE training), ``token_cache``, ``setup`` (mesh, batch source, step functions),
``compile`` (the state's initialisation and the first logging window's excess over the steady
step time: the train step's compilation and first-step overheads), ``steps`` (the rest of the
training loop), ``eval`` (the final evaluation, its compilation included), ``finish``
(checkpoint, plots, manifest, exit).

Rounds alternate the two sides (``--rounds``), so a busy stretch of a shared machine hits both;
each run records the load average before and after, the cores other processes used during it
(``/proc/stat`` minus the run's own CPU time) and the cores the hypervisor took from the virtual
machine's vCPUs (``steal``); medians are reported. On a shared machine, ``--quiet-below LOAD``
starts each run only once the 1-minute load average is below LOAD, and ``--retry-above CORES``
runs a side again when other processes and steal together took more than CORES cores during it
(the discarded runs are listed). Steady GFLOP/s = the model's training FLOPs per token
(``6N + 12·L·T·D``) x tokens per step / the steady step time (nanoGPT: its median iteration).

    python bench/quality_per_time.py --nanogpt-dir ~/nanoGPT [--rounds 2]
        [--ours default --ours "big:vocab=2048,batch=48,lr=3e-3"]
    python bench/quality_per_time.py --smoke        # ours only, a tiny run (< 60 s): checks the script

``--ours NAME:key=value,...`` (repeatable) defines a variant of our settings; keys: ``vocab``
(BPE size), ``batch`` (rows per step; steps follow from the tokens), ``lr``, ``mp``
(``trainer.mp``: auto = f32 on CPU, bf16 = ``p=f32,c=bfloat16``, or bf16mm = ``p=f32,c=f32,m=bf16``:
bf16 matmul operands, float32 elsewhere), ``workers``
(``data.num_workers``), ``eval_batch`` (``trainer.per_device_eval_parallelism``), ``tokens``
(another number of training tokens: such a row is not like-for-like and never meets the target), or any dotted
config field (``optimizer.warmup=0.1``). The first variant is the one the ``ratio`` is about.

The last line is ``RESULT {json}``: ``ratio`` = our wall time / nanoGPT's (first variant,
medians over rounds); ``bpb_ours``, ``bpb_nanogpt``, the per-variant results, the phases, loads,
and ``target_met`` (lower bpb in <= half the wall time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, host_info, host_line, loadavg, log_marks, log_time, machine_cpu_s  # noqa: E402

PY = sys.executable
CLI = str(Path(PY).with_name("lm-pipeline"))
DATASET = "stdlib_bytes"
#: nanoGPT's README CPU recipe (after ``train.py config/train_shakespeare_char.py``), verbatim.
NANOGPT_RECIPE = ("--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1", "--block_size=64",
                  "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
                  "--lr_decay_iters=2000", "--dropout=0.0")
MODEL = {"layers": 4, "heads": 4, "width": 128, "ctx": 64}
RECIPE_TOKENS = (2000 + 1) * 12 * 64  # nanoGPT runs iterations 0..max_iters inclusive
DEFAULT_VARIANT = "default:vocab=512,batch=12,lr=1e-3"
#: (phase, the log line that ends it); a phase whose line is missing merges into the next.
MARKS = (
    ("start", r"lm_pipeline\.cli: allocator"),
    ("config", r"raw_shards [0-9a-f]+: building at"),
    ("raw_shards", r"tokenizer [0-9a-f]+: building at"),
    ("tokenizer", r"token_cache [0-9a-f]+: building at"),
    ("token_cache", r"train_ckpt [0-9a-f]+: building at"),
    ("setup", r"lm_pipeline\.train\.trainer: train step:"),
)
_ALIASES = {"vocab": "data.tokenizer.vocab_size", "lr": "optimizer.learning_rate", "mp": "trainer.mp",
            "workers": "data.num_workers", "eval_batch": "trainer.per_device_eval_parallelism"}


# ----------------------------------------------------------------------------- corpus


def corpus_documents(max_bytes: int, validation_fraction: float):
    """The built-in corpus's documents with their split, as ``lm-pipeline`` selects them."""
    sys.path.insert(0, str(ROOT))
    from lm_pipeline.data.builtin import python_stdlib_documents

    return python_stdlib_documents(max_bytes=max_bytes, validation_fraction=validation_fraction)


def prepare_child(spec: dict) -> dict:
    """nanoGPT's dataset (its ``prepare.py`` format, byte-level): ``train.bin`` / ``val.bin``
    (uint16 ids = UTF-8 bytes of the train / validation documents, concatenated) and ``meta.pkl``."""
    import numpy as np

    docs = corpus_documents(spec["corpus_bytes"], spec["validation_fraction"])
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for split, name in (("train", "train.bin"), ("validation", "val.bin")):
        data = b"".join(d.text.encode("utf-8") for d in docs if d.split == split)
        np.frombuffer(data, dtype=np.uint8).astype(np.uint16).tofile(out / name)
        sizes[split] = len(data)
    with open(out / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 256, "encoding": "utf-8 bytes"}, f)
    return {"train_bytes": sizes["train"], "val_bytes": sizes["validation"], "docs": len(docs),
            "val_docs": sum(d.split == "validation" for d in docs)}


def nanogpt_eval_child(spec: dict) -> dict:
    """nats per byte of nanoGPT's ``ckpt.pt`` on the whole ``val.bin``: non-overlapping windows of
    ``block_size`` inputs, every byte after the first predicted once."""
    import numpy as np
    import torch

    sys.path.insert(0, spec["nanogpt_dir"])
    from model import GPT, GPTConfig  # nanoGPT's model.py, from the checkout

    ckpt = torch.load(spec["ckpt"], map_location="cpu", weights_only=False)
    model = GPT(GPTConfig(**ckpt["model_args"]))
    state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
    model.load_state_dict(state)
    model.eval()
    block = ckpt["model_args"]["block_size"]
    data = torch.from_numpy(np.fromfile(spec["val"], dtype=np.uint16).astype(np.int64))
    n = (len(data) - 1) // block  # full windows
    x = data[: n * block].view(n, block)
    y = data[1 : n * block + 1].view(n, block)
    rest = len(data) - 1 - n * block
    nats, count = 0.0, 0
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, n, 64):
            logits, _ = model(x[i : i + 64], y[i : i + 64])
            nats += torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y[i : i + 64].reshape(-1),
                                                      reduction="sum").item()
            count += y[i : i + 64].numel()
        if rest:  # the tail: one shorter window
            xs, ys = data[n * block : n * block + rest].view(1, -1), data[n * block + 1 :].view(1, -1)
            logits, _ = model(xs, ys)
            nats += torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), ys.reshape(-1),
                                                      reduction="sum").item()
            count += ys.numel()
    return {"nats": nats, "bytes": count, "bpb": nats / math.log(2) / count, "iter_num": int(ckpt["iter_num"]),
            "best_val_loss": float(ckpt["best_val_loss"]), "params": sum(p.numel() for p in model.parameters()),
            "eval_s": time.perf_counter() - t0}


def _run_child(mode: str, spec: dict, timeout: float) -> dict:
    out = subprocess.run([PY, str(Path(__file__).resolve()), f"--_{mode}", json.dumps(spec)], capture_output=True,
                         text=True, timeout=timeout)
    line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith(mode.upper() + " ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"{mode} child failed (exit {out.returncode}): {out.stderr[-3000:]}")
    return json.loads(line[len(mode) + 1 :])


# ----------------------------------------------------------------------------- timing


def timed(cmd: list[str], *, env: dict, cwd: str, log_path: Path, timeout: float, stdout_path: Path | None = None) -> dict:
    """Run ``cmd`` to completion (stderr, and stdout unless ``stdout_path``, into ``log_path``);
    wall time from start to exit, its CPU time (the process tree, as reaped), the cores other
    processes used meanwhile and the hypervisor's steal, the load average before and after."""
    load_before = loadavg()
    r0, (m0, s0) = resource.getrusage(resource.RUSAGE_CHILDREN), machine_cpu_s()
    t0 = time.perf_counter()
    with open(log_path, "wb") as log, open(stdout_path or os.devnull, "wb") as out:
        proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=out if stdout_path else log, stderr=log, timeout=timeout)
    wall = time.perf_counter() - t0
    r1, (m1, s1) = resource.getrusage(resource.RUSAGE_CHILDREN), machine_cpu_s()
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return {"rc": proc.returncode, "wall_s": wall, "t_start": time.time() - wall, "cpu_s": cpu,
            "cpu_share": cpu / wall if wall else 0.0, "others_cores": max(0.0, (m1 - m0 - cpu) / wall) if wall else 0.0,
            "steal_cores": max(0.0, (s1 - s0) / wall) if wall else 0.0,
            "load_before": load_before, "load_after": loadavg()}


def wait_for_quiet(below: float | None, max_wait_s: float) -> float:
    """Sleep until the 1-minute load average is below ``below`` (at most ``max_wait_s``); the
    seconds waited. On a shared machine this puts each run into a quiet stretch when there is one."""
    if below is None:
        return 0.0
    t0 = time.perf_counter()
    while loadavg() >= below and time.perf_counter() - t0 < max_wait_s:
        time.sleep(5)
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- ours


#: ``mp=NAME`` spellings for policies whose own spelling has commas (variants are comma-separated).
_MP_SHORT = {"bf16": "p=f32,c=bfloat16", "bf16mm": "p=f32,c=f32,m=bf16"}


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``"name:key=value,key=value"`` -> (name, {dotted config key: value}); bare ``key=value``
    lists are named after themselves. ``batch`` and ``tokens`` stay as they are (they decide the
    step count)."""
    name, sep, body = text.partition(":")
    if not sep:
        name, body = ("default", "") if text.strip() == "default" else (text, text)
    items = {}
    for part in filter(None, (p.strip() for p in body.split(","))):
        k, eq, v = part.partition("=")
        if not eq:
            raise ValueError(f"variant {text!r}: {part!r} is not key=value")
        k = k.strip()
        if k == "mp" and v.strip() in _MP_SHORT:
            v = _MP_SHORT[v.strip()]
        items[k if k in ("batch", "tokens") else _ALIASES.get(k, k)] = v.strip()
    return name.strip(), items


def _yaml_value(v: str):
    import yaml

    return yaml.safe_load(v)


def ours_config(variant: dict[str, str], args, store: Path) -> tuple[dict, int, int]:
    """The config our CLI run reads (a dict, written as YAML/JSON), its batch and its steps."""
    batch = int(variant.get("batch", 12))
    steps = max(1, round(int(float(variant.get("tokens", args.tokens))) / (batch * MODEL["ctx"])))
    cfg = {
        "data": {"builtin": "python_stdlib", "builtin_max_bytes": args.corpus_bytes,
                 "builtin_validation_fraction": args.validation_fraction,
                 "tokenizer": {"kind": "bpe", "vocab_size": 512}, "packing": "concat"},
        "model": {"type": "gpt2", "seq_len": MODEL["ctx"], "hidden_dim": MODEL["width"], "num_heads": MODEL["heads"],
                  "num_layers": MODEL["layers"], "gradient_checkpointing": False},
        "trainer": {"seed": 0, "num_train_steps": steps, "train_batch_size": batch, "mp": "auto",
                    "steps_per_eval": steps, "max_eval_batches": None, "log_every": max(1, min(100, steps // 10)),
                    "progress": False},
        "optimizer": {"learning_rate": 1.0e-3, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.99, "max_grad_norm": 1.0,
                      "warmup": 0.05, "min_lr_ratio": 0.1, "lr_schedule": "cosine"},
        "store": {"root": str(store)},
    }
    for key, value in variant.items():
        if key in ("batch", "tokens"):
            continue
        node = cfg
        *path, leaf = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = _yaml_value(value)
    return cfg, batch, steps


def _ours_env(args, base: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["LM_PIPELINE_BUILTIN_DIR"] = str(base / "builtin")  # the corpus materialised from scratch too
    for k in ("LM_PIPELINE_XLA_CACHE", "JAX_COMPILATION_CACHE_DIR"):  # the store's own (empty) cache
        env.pop(k, None)
    if args.cold_native:
        env["LM_PIPELINE_NATIVE_DIR"] = str(base / "native")
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def phases(log_text: str, t_start: float, wall: float, metrics: list[dict], steps: int, log_every: int) -> dict:
    """Where the run's wall time went (s), from its log's timestamps and its logged step times."""
    found = log_marks(log_text, MARKS)
    evals = [log_time(line) for line in log_text.splitlines() if "lm_pipeline.train.run: eval at step" in line]
    eval_at = next((t for t in reversed(evals) if t is not None), None)  # the last evaluation's start
    out, prev = {}, t_start
    for name, _ in MARKS:
        if name in found:
            out[name] = max(0.0, found[name] - prev)
            prev = found[name]
    train_rows = [m for m in metrics if "throughput/step_seconds" in m]
    steady = statistics.median(m["throughput/step_seconds"] for m in train_rows[1:]) if len(train_rows) > 1 else None
    evals = [m for m in metrics if "eval/seconds" in m]
    eval_s = evals[-1]["eval/seconds"] if evals else 0.0
    if eval_at is not None:
        loop = eval_at - prev - eval_s  # state init, then every step, up to the final evaluation
        if steady is not None:
            # Each logged row covers the steps since the previous one; the first also the
            # compilation of the step (and the state's initialisation runs before it).
            first = train_rows[0]
            first_excess = max(0.0, first["throughput/step_seconds"] * first["step"] - steady * first["step"])
            windows = sum(m["throughput/step_seconds"] * (m["step"] - p["step"])
                          for p, m in zip([{"step": 0}, *train_rows], train_rows, strict=False))
            out["compile"] = max(0.0, loop - windows) + first_excess
            out["steps"] = loop - out["compile"]
        else:
            out["steps"] = loop
        out["eval"] = eval_s
        prev = eval_at
    out["finish"] = max(0.0, t_start + wall - prev)
    out["steady_step_s"] = steady
    return out


def run_ours(name: str, variant: dict[str, str], args, work: Path, tag: str) -> dict:
    base = work / f"ours_{name}_{tag}"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    store = base / "store"
    cfg, batch, steps = ours_config(variant, args, store)
    cfg_path = base / "config.yaml"
    cfg_path.write_text(json.dumps(cfg, indent=1))
    env = _ours_env(args, base)
    res = timed([CLI, "train", "--config_path", str(cfg_path)], env=env, cwd=str(base), log_path=base / "train.log",
                timeout=args.timeout, stdout_path=base / "train.json")
    text = (base / "train.log").read_text(errors="replace")
    if res["rc"] != 0:
        raise RuntimeError(f"ours ({name}) failed (exit {res['rc']}); log {base / 'train.log'}:\n{text[-3000:]}")
    run_dir = json.loads((base / "train.json").read_text())["run_dir"]
    metrics = [json.loads(ln) for ln in Path(run_dir, "metrics.jsonl").read_text().splitlines() if ln.strip()]
    final = [m for m in metrics if "eval/validation/loss" in m][-1]
    res.update(name=name, variant=variant, batch=batch, steps=steps, tokens=steps * batch * MODEL["ctx"],
               in_run_bpb=final.get("eval/validation/bpb"), in_run_loss=final["eval/validation/loss"],
               phases=phases(text, res["t_start"], res["wall_s"], metrics, steps, cfg["trainer"]["log_every"]),
               final_train_loss=[m for m in metrics if "train/loss" in m][-1]["train/loss"])
    res.update(_cache_stats(store))  # before the evaluation below adds a cache of its own
    res["params"] = _num_params(cfg)
    steady = res["phases"].get("steady_step_s")
    if steady:
        fpt = flops_per_token(int(cfg["data"]["tokenizer"]["vocab_size"]))
        res["steady_gflops"] = fpt * batch * MODEL["ctx"] / steady / 1e9
    if "train_bytes_per_token" in res:
        res["train_bytes_seen"] = res["tokens"] * res["train_bytes_per_token"]
    # The project's own evaluation of the final checkpoint (untimed): exact bytes of the predicted tokens.
    if not args.no_exact_eval:
        t0 = time.perf_counter()
        ev = subprocess.run([CLI, "eval", "--config_path", str(cfg_path), "--checkpoint_path", run_dir,
                             "--output_dir", str(base / "eval")], env=env, cwd=str(base), capture_output=True,
                            text=True, timeout=args.timeout)
        if ev.returncode != 0:
            raise RuntimeError(f"lm-pipeline eval failed: {ev.stderr[-3000:]}")
        rows = json.loads((base / "eval" / "eval_report.json").read_text())
        row = next(r for r in rows if r["dataset"] == "validation")
        res.update(bpb=row["bpb"], eval_bytes=row["bytes"], eval_tokens=row["tokens"],
                   exact_eval_s=time.perf_counter() - t0, unigram_bpb=row.get("unigram_bpb"))
    else:
        res["bpb"] = res["in_run_bpb"]
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return res


def _model_config(vocab: int | None = None):
    sys.path.insert(0, str(ROOT))
    from lm_pipeline.config import load_config  # light: no JAX

    return load_config(None, {"model.type": "gpt2", "model.seq_len": MODEL["ctx"], "model.hidden_dim": MODEL["width"],
                              "model.num_heads": MODEL["heads"], "model.num_layers": MODEL["layers"]}).model


def _num_params(cfg: dict) -> int:
    """The model's parameter count at the configured vocabulary (embeddings included)."""
    return _model_config().num_params(int(cfg["data"]["tokenizer"]["vocab_size"]))


def flops_per_token(vocab: int) -> float:
    """Training FLOPs per token of the GPT-2 shape at ``vocab`` (``6N + 12·L·T·D``, the project's
    MFU count; nanoGPT's model is the same shape without biases, so the same count)."""
    return _model_config().flops_per_token(vocab)


def _cache_stats(store: Path) -> dict:
    """Tokens and bytes of the train and validation splits, from the run's token cache manifest."""
    try:
        (manifest,) = (store / "token_cache").glob("*/manifest.json")
        splits = json.loads(manifest.read_text())["summary"]["splits"]
        tr, va = splits["train"], splits["validation"]
        return {"train_tokens_in_cache": tr["num_tokens"], "train_bytes_in_cache": tr["num_bytes"],
                "train_bytes_per_token": tr["num_bytes"] / max(1, tr["num_tokens"]),
                "val_tokens_in_cache": va["num_tokens"], "val_bytes_in_cache": va["num_bytes"]}
    except (OSError, ValueError, KeyError) as e:  # a statistic, not a result
        return {"cache_stats_error": repr(e)}


# ----------------------------------------------------------------------------- nanoGPT


def run_nanogpt(args, work: Path, tag: str) -> dict:
    ng = Path(args.nanogpt_dir).resolve()
    base = work / f"nanogpt_{tag}"
    shutil.rmtree(base, ignore_errors=True)
    (base / "data").mkdir(parents=True)
    os.symlink(ng / "configurator.py", base / "configurator.py")
    env = dict(os.environ)
    if not args.nanogpt_tcmalloc:
        env.pop("LD_PRELOAD", None)
    else:
        from lm_pipeline import launch

        lib = launch.find_tcmalloc()
        if lib:
            env["LD_PRELOAD"] = lib
    spec = {"corpus_bytes": args.corpus_bytes, "validation_fraction": args.validation_fraction,
            "out": str(base / "data" / DATASET)}
    prep = timed([PY, str(Path(__file__).resolve()), "--_prepare", json.dumps(spec)], env=env, cwd=str(base),
                 log_path=base / "prepare.log", timeout=args.timeout)
    if prep["rc"] != 0:
        raise RuntimeError(f"nanoGPT data preparation failed: {(base / 'prepare.log').read_text()[-3000:]}")
    info = json.loads(next(ln for ln in (base / "prepare.log").read_text().splitlines()
                           if ln.startswith("PREPARE "))[len("PREPARE ") :])
    out_dir = base / "out"
    cmd = [PY, str(ng / "train.py"), str(ng / "config" / "train_shakespeare_char.py"), *NANOGPT_RECIPE,
           f"--dataset={DATASET}", f"--out_dir={out_dir}"]
    train = timed(cmd, env=env, cwd=str(base), log_path=base / "train.log", timeout=args.timeout)
    text = (base / "train.log").read_text(errors="replace")
    if train["rc"] != 0:
        raise RuntimeError(f"nanoGPT train.py failed (exit {train['rc']}):\n{text[-3000:]}")
    vals = re.findall(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", text)
    iters = [float(t) for t in re.findall(r"^iter \d+: loss [\d.]+, time ([\d.]+)ms", text, re.M)]
    ev = _run_child("nanoeval", {"nanogpt_dir": str(ng), "ckpt": str(out_dir / "ckpt.pt"),
                                 "val": str(base / "data" / DATASET / "val.bin")}, args.timeout)
    res = {
        "wall_s": prep["wall_s"] + train["wall_s"], "prepare": prep, "train": train, **info,
        "cpu_s": prep["cpu_s"] + train["cpu_s"],
        **{k: (prep[k] * prep["wall_s"] + train[k] * train["wall_s"]) / (prep["wall_s"] + train["wall_s"])
           for k in ("others_cores", "steal_cores")},
        "load_before": prep["load_before"], "load_after": train["load_after"],
        "steps": len(iters), "tokens": len(iters) * 12 * 64,
        "iter_ms_median": statistics.median(iters) if iters else None,
        "own_val_loss": float(vals[-1][2]) if vals else None,
        "own_val_bpb": float(vals[-1][2]) / math.log(2) if vals else None,
        "bpb": ev["bpb"], "eval_bytes": ev["bytes"], "ckpt_iter": ev["iter_num"], "params": ev["params"],
        "exact_eval_s": ev["eval_s"], "tcmalloc": bool(args.nanogpt_tcmalloc),
    }
    if res["iter_ms_median"]:
        res["steady_gflops"] = flops_per_token(256) * 12 * 64 / (res["iter_ms_median"] / 1e3) / 1e9
    res["cpu_share"] = res["cpu_s"] / res["wall_s"]
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return res


# ----------------------------------------------------------------------------- report


def _med(rows: list[dict], key: str):
    xs = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(xs) if xs else None


def _print_run(r: int, side: str, res: dict) -> None:
    if side == "nanogpt":
        print(f"  round {r} nanoGPT: {res['wall_s']:.1f} s (prepare {res['prepare']['wall_s']:.1f}, "
              f"train.py {res['train']['wall_s']:.1f}; {res['iter_ms_median']:.1f} ms/iter median), "
              f"bpb {res['bpb']:.4f} (own val {res['own_val_bpb']:.4f}); cpu share "
              f"{res['cpu_share']:.2f}, others {res['others_cores']:.2f} cores, steal {res['steal_cores']:.2f}, load "
              f"{res['load_before']:.2f} -> {res['load_after']:.2f}", flush=True)
    else:
        ph = " ".join(f"{k} {v:.1f}" for k, v in res["phases"].items() if k != "steady_step_s" and v is not None)
        print(f"  round {r} ours {side}: {res['wall_s']:.1f} s ({ph}; {res['steps']} steps x {res['batch']}), "
              f"bpb {res['bpb']:.4f} (in-run {res['in_run_bpb']:.4f}); cpu share {res['cpu_share']:.2f}, "
              f"others {res['others_cores']:.2f} cores, steal {res['steal_cores']:.2f}, load {res['load_before']:.2f} -> "
              f"{res['load_after']:.2f}", flush=True)


def _round(x, n):
    return None if x is None else round(x, n)


def _phase_medians(rows: list[dict]) -> dict:
    names = list(dict.fromkeys(k for r in rows for k in r["phases"]))
    return {k: _med([r["phases"] for r in rows], k) for k in names}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt-dir", help="a checkout of github.com/karpathy/nanoGPT (not modified)")
    p.add_argument("--ours", action="append", default=[], metavar="NAME:key=value,...",
                   help=f"a variant of our settings (repeatable; default {DEFAULT_VARIANT!r})")
    p.add_argument("--rounds", type=int, default=1, help="alternated rounds of every side")
    p.add_argument("--corpus-bytes", type=int, default=2_000_000, help="data.builtin_max_bytes of the built-in corpus")
    p.add_argument("--validation-fraction", type=float, default=0.05)
    p.add_argument("--tokens", type=int, default=RECIPE_TOKENS, help="training tokens (default: nanoGPT's recipe)")
    p.add_argument("--nanogpt-tcmalloc", action="store_true", help="preload tcmalloc for nanoGPT too")
    p.add_argument("--skip-nanogpt", action="store_true", help="ours only (no ratio)")
    p.add_argument("--cold-native", action="store_true",
                   help="build the native CPU attention kernel in the run too (an empty LM_PIPELINE_NATIVE_DIR)")
    p.add_argument("--no-exact-eval", action="store_true", help="bpb_ours from the in-run evaluation only")
    p.add_argument("--work-root", default=tempfile.gettempdir())
    p.add_argument("--keep", action="store_true", help="keep the work directory (configs, logs, stores)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per process")
    p.add_argument("--quiet-below", type=float, default=None, metavar="LOAD",
                   help="before each run, wait until the 1-minute load average is below LOAD (a shared machine)")
    p.add_argument("--quiet-wait-s", type=float, default=1800, help="longest wait for --quiet-below, per run")
    p.add_argument("--retry-above", type=float, default=None, metavar="CORES",
                   help="run a side again (up to --retries times) when other processes used more than CORES "
                        "cores during it; the discarded runs are listed in the RESULT")
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="ours only, 300 kB corpus, 24 steps: checks the script (< 60 s)")
    p.add_argument("--_prepare", dest="child_prepare", help=argparse.SUPPRESS)
    p.add_argument("--_nanoeval", dest="child_nanoeval", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_prepare:
        print("PREPARE " + json.dumps(prepare_child(json.loads(args.child_prepare))), flush=True)
        return
    if args.child_nanoeval:
        print("NANOEVAL " + json.dumps(nanogpt_eval_child(json.loads(args.child_nanoeval))), flush=True)
        return
    if args.smoke:
        args.skip_nanogpt, args.corpus_bytes, args.tokens, args.rounds = True, 300_000, 24 * 12 * 64, 1
    if not args.skip_nanogpt:
        if not args.nanogpt_dir or not (Path(args.nanogpt_dir) / "train.py").is_file():
            p.error("--nanogpt-dir must name a nanoGPT checkout (with train.py), or pass --skip-nanogpt / --smoke")
    variants = [parse_variant(v) for v in (args.ours or [DEFAULT_VARIANT])]
    if len({n for n, _ in variants}) != len(variants):
        p.error("--ours: variant names must differ")

    host = host_info()
    print(host_line(host))
    print(f"load average {loadavg():.2f} at start; corpus: built-in python_stdlib, {args.corpus_bytes:,} bytes, "
          f"{args.validation_fraction:.0%} held out; model {MODEL['layers']} layers, {MODEL['heads']} heads, "
          f"width {MODEL['width']}, context {MODEL['ctx']}; {args.tokens:,} training tokens", flush=True)
    Path(args.work_root).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="lm_quality_time_", dir=args.work_root))
    ours: dict[str, list[dict]] = {n: [] for n, _ in variants}
    nano: list[dict] = []
    discarded: list[dict] = []
    t_all = time.perf_counter()
    try:
        for r in range(args.rounds):
            order = ["nanogpt", *[n for n, _ in variants]] if r % 2 == 0 else [*[n for n, _ in variants], "nanogpt"]
            for side in order:
                if side == "nanogpt" and args.skip_nanogpt:
                    continue
                for attempt in range(args.retries + 1):
                    waited = wait_for_quiet(args.quiet_below, args.quiet_wait_s)
                    if waited >= 5:
                        print(f"  (waited {waited:.0f} s for the load average to fall below {args.quiet_below}: "
                              f"{loadavg():.2f})", flush=True)
                    res = run_nanogpt(args, work, f"{r}_{attempt}") if side == "nanogpt" else \
                        run_ours(side, dict(variants)[side], args, work, f"{r}_{attempt}")
                    _print_run(r, side, res)
                    taken = res["others_cores"] + res["steal_cores"]
                    if args.retry_above is None or taken <= args.retry_above or attempt == args.retries:
                        break
                    discarded.append({"side": side, "round": r, "wall_s": round(res["wall_s"], 2),
                                      "others_cores": round(res["others_cores"], 3), "steal_cores": round(res["steal_cores"], 3)})
                    print(f"    other processes and the hypervisor took {taken:.2f} cores (> {args.retry_above}): "
                          "run again", flush=True)
                (nano if side == "nanogpt" else ours[side]).append(res)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work dir kept: {work}")

    ng_wall, ng_bpb = _med(nano, "wall_s"), _med(nano, "bpb")
    print(f"\n{'side':<28} {'wall s':>7} {'bpb':>7} {'in-run':>7} {'steps':>6} {'batch':>5} {'tokens':>10} "
          f"{'text MB':>7} {'cpu share':>9} {'others':>6} {'wall/ng':>7}  target")
    if nano:
        print(f"{'nanoGPT (CPU recipe)':<28} {ng_wall:7.1f} {ng_bpb:7.4f} {_med(nano, 'own_val_bpb'):7.4f} "
              f"{nano[0]['steps']:6d} {12:5d} {nano[0]['tokens']:10,d} {nano[0]['tokens'] / 1e6:7.2f} "
              f"{_med(nano, 'cpu_share'):9.2f} {_med(nano, 'others_cores'):6.2f} {1.0:7.2f}")
    summary = {}
    for name, rows in ours.items():
        wall, bpb = _med(rows, "wall_s"), _med(rows, "bpb")
        ratio = wall / ng_wall if ng_wall else None
        same_tokens = abs(rows[0]["tokens"] - (nano[0]["tokens"] if nano else args.tokens)) <= 12 * MODEL["ctx"]
        met = bool(ratio is not None and ratio <= 0.5 and bpb < ng_bpb and same_tokens)
        seen = _med(rows, "train_bytes_seen")
        summary[name] = {
            "variant": rows[0]["variant"], "wall_s": round(wall, 2), "bpb": round(bpb, 4),
            "in_run_bpb": round(_med(rows, "in_run_bpb"), 4), "ratio": round(ratio, 4) if ratio else None,
            "target_met": met, "same_tokens": same_tokens, "steps": rows[0]["steps"], "batch": rows[0]["batch"], "tokens": rows[0]["tokens"],
            "train_bytes_seen": round(seen) if seen else None,
            "bytes_per_token": round(_med(rows, "train_bytes_per_token") or 0, 3),
            "phases_s": {k: round(v, 5 if k == "steady_step_s" else 3) if v is not None else None for k, v in _phase_medians(rows).items()},
            "cpu_s": round(_med(rows, "cpu_s"), 2), "steady_gflops": _round(_med(rows, "steady_gflops"), 1),
            "cpu_share": round(_med(rows, "cpu_share"), 3), "others_cores": round(_med(rows, "others_cores"), 3),
            "steal_cores": round(_med(rows, "steal_cores"), 3),
            "loads": [[round(r["load_before"], 2), round(r["load_after"], 2)] for r in rows],
            "walls_s": [round(r["wall_s"], 2) for r in rows], "eval_bytes": rows[0].get("eval_bytes"),
            "final_train_loss": round(_med(rows, "final_train_loss"), 4), "params": rows[0].get("params"),
        }
        s = summary[name]
        print(f"{'ours ' + name:<28} {wall:7.1f} {bpb:7.4f} {s['in_run_bpb']:7.4f} {s['steps']:6d} {s['batch']:5d} "
              f"{s['tokens']:10,d} {(seen or 0) / 1e6:7.2f} {s['cpu_share']:9.2f} {s['others_cores']:6.2f} "
              f"{ratio if ratio else float('nan'):7.2f}  {'MET' if met else 'not met'}"
              + ("" if same_tokens else " (fewer/more tokens than nanoGPT: not a like-for-like row)"))
    print("\nwhere our time went (median s): ")
    for name in ours:
        ph = summary[name]["phases_s"]
        print(f"  {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in ph.items() if v is not None and k != "steady_step_s")
              + (f"; steady step {1e3 * ph['steady_step_s']:.1f} ms = {summary[name]['steady_gflops']:.0f} GFLOP/s"
                 if ph.get("steady_step_s") and summary[name]["steady_gflops"] else ""))
    if nano:
        print(f"nanoGPT: prepare {_med([n['prepare'] for n in nano], 'wall_s'):.2f}, train.py "
              f"{_med([n['train'] for n in nano], 'wall_s'):.2f} ({nano[0]['steps']} iterations, "
              f"{_med(nano, 'iter_ms_median'):.1f} ms median = {_med(nano, 'steady_gflops') or 0:.0f} GFLOP/s, "
              f"9 evaluations of 2 x 20 batches); checkpoint of "
              f"iteration {nano[0]['ckpt_iter']}; {nano[0]['params']:,} parameters; held-out {nano[0]['eval_bytes']:,} bytes")
    print(f"load average {loadavg():.2f} at end; {time.perf_counter() - t_all:.0f} s in all")

    first = variants[0][0]
    result = {
        "ratio": summary[first]["ratio"], "bpb_ours": summary[first]["bpb"], "bpb_nanogpt": round(ng_bpb, 4) if nano else None,
        "wall_ours_s": summary[first]["wall_s"], "wall_nanogpt_s": round(ng_wall, 2) if nano else None,
        "target_met": summary[first]["target_met"], "variants": summary, "rounds": args.rounds, "smoke": args.smoke,
        "corpus_bytes": args.corpus_bytes, "tokens": args.tokens, "model": MODEL,
        "nanogpt": None if not nano else {
            "walls_s": [round(n["wall_s"], 2) for n in nano], "prepare_s": [round(n["prepare"]["wall_s"], 2) for n in nano],
            "train_s": [round(n["train"]["wall_s"], 2) for n in nano], "own_val_bpb": round(_med(nano, "own_val_bpb"), 4),
            "iter_ms_median": round(_med(nano, "iter_ms_median"), 2), "cpu_share": round(_med(nano, "cpu_share"), 3),
            "cpu_s": round(_med(nano, "cpu_s"), 2), "steady_gflops": _round(_med(nano, "steady_gflops"), 1),
            "others_cores": round(_med(nano, "others_cores"), 3), "steal_cores": round(_med(nano, "steal_cores"), 3),
            "steps": nano[0]["steps"], "tokens": nano[0]["tokens"],
            "train_bytes": nano[0]["train_bytes"], "val_bytes": nano[0]["val_bytes"], "eval_bytes": nano[0]["eval_bytes"],
            "params": nano[0]["params"], "ckpt_iter": nano[0]["ckpt_iter"], "tcmalloc": nano[0]["tcmalloc"],
            "loads": [[round(n["load_before"], 2), round(n["load_after"], 2)] for n in nano],
        },
        "best_met": [n for n, s in summary.items() if s["target_met"]], "discarded_runs": discarded,
        **host,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
