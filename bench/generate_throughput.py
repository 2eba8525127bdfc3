"""Generation throughput: our jitted KV-cache generation vs ``transformers`` ``generate``.

One GPT-2 (default 6 layers x 384 wide, 6 heads, vocabulary 8192, random weights at the usual
init scale) is exported with :func:`lm_pipeline.hf.export_hf`; both sides load that export
(ours through :func:`lm_pipeline.hf.load_hf_checkpoint`), so they run the same weights. Same
prompt (random ids), batch 1, greedy, a fixed number of new tokens (EOS disabled on both sides so
every run produces all of them), float32 on the CPU. Each side is warmed up once (JAX compiles
its program there), then timed ``--runs`` times end to end (ids in, ids out), the sides
interleaved; the medians give tokens/s. ``transformers`` runs with torch's default thread count
and with one thread (on a busy machine its multi-threaded runs can be far slower); ``ratio`` is
ours / the faster of the two, so it never flatters us. The last line is ``RESULT {json}``.

    python bench/generate_throughput.py [--layers 6] [--width 384] [--new-tokens 128] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import host_info, host_line  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import jax
    import numpy as np
    import torch
    import transformers

    from lm_pipeline.generate import generate
    from lm_pipeline.hf import export_hf, load_hf_checkpoint
    from lm_pipeline.models import Gpt2Config

    seq_len = max(256, args.prompt_len + args.new_tokens)
    cfg = Gpt2Config(seq_len=seq_len, hidden_dim=args.width, num_layers=args.layers, num_heads=args.heads)
    prompt = np.random.default_rng(args.seed).integers(0, args.vocab, (1, args.prompt_len), dtype=np.int64)

    with tempfile.TemporaryDirectory() as tmp:
        export_dir = export_hf(cfg.build(args.vocab, key=jax.random.PRNGKey(args.seed)), os.path.join(tmp, "gpt2"))
        _, ours = load_hf_checkpoint(export_dir)
        hf = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in hf.parameters())

    def run_ours():
        return generate(ours, prompt.astype(np.int32), args.new_tokens)[0, args.prompt_len:]

    hf_prompt = torch.tensor(prompt)
    gen_kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                      eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(hf_prompt))

    threads = torch.get_num_threads()

    def run_hf(n_threads: int = threads):
        torch.set_num_threads(n_threads)
        try:
            with torch.inference_mode():
                return hf.generate(hf_prompt, **gen_kwargs)[0, args.prompt_len:].numpy()
        finally:
            torch.set_num_threads(threads)

    t0 = time.perf_counter()
    ours_tokens = run_ours()
    first_call_s = time.perf_counter() - t0
    hf_tokens = run_hf()
    run_hf(1)
    assert len(ours_tokens) == len(hf_tokens) == args.new_tokens, (len(ours_tokens), len(hf_tokens))
    same = int(np.cumprod(ours_tokens == hf_tokens).sum())  # length of the common greedy prefix

    hf_n, hf_1 = f"transformers ({threads} threads)", "transformers (1 thread)"
    sides = {"ours (JAX)": run_ours, hf_n: run_hf, hf_1: lambda: run_hf(1)}
    if threads == 1:
        del sides[hf_1]
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.runs):  # interleaved, so drifts in machine load hit all sides alike
        for name, fn in sides.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)

    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: args.new_tokens / v for k, v in med.items()}
    best_hf = max((k for k in tps if k != "ours (JAX)"), key=tps.get)
    ratio = tps["ours (JAX)"] / tps[best_hf]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()}), {os.cpu_count()} cores, {platform.machine()}"

    dev = jax.devices()[0]
    host = host_info(gpu=dev.device_kind if dev.platform == "gpu" else None)
    print(host_line(host))
    print(f"GPT-2 {args.layers} layers x {args.width} wide, {args.heads} heads, vocab {args.vocab}: "
          f"{n_params / 1e6:.1f}M params, float32; batch 1, prompt {args.prompt_len}, {args.new_tokens} new "
          f"tokens, greedy; {args.runs} timed runs each; {device}")
    print(f"jax {jax.__version__}, torch {torch.__version__}, transformers {transformers.__version__}; "
          f"1-minute load average {load:.1f}")
    print(f"{'side':<26} {'median s':>9} {'min s':>8} {'max s':>8} {'tokens/s':>9}")
    for k, v in times.items():
        print(f"{k:<26} {med[k]:>9.4f} {min(v):>8.4f} {max(v):>8.4f} {tps[k]:>9.1f}")
    print(f"ratio (ours / {best_hf}): {ratio:.2f}x; greedy outputs agree on the first {same} of "
          f"{args.new_tokens} tokens; our first call (compile + run): {first_call_s:.2f}s")
    result = {
        "model": f"gpt2-{args.layers}x{args.width}-v{args.vocab}",
        "params": int(n_params),
        "batch": 1,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "runs": args.runs,
        "ours_tokens_per_s": round(tps["ours (JAX)"], 2),
        "transformers_tokens_per_s": round(tps[best_hf], 2),
        "transformers_threads": 1 if best_hf == hf_1 else threads,
        "transformers_tokens_per_s_by_threads": {str(1 if k == hf_1 else threads): round(v, 2)
                                                 for k, v in tps.items() if k != "ours (JAX)"},
        "ours_median_s": round(med["ours (JAX)"], 5),
        "transformers_median_s": round(med[best_hf], 5),
        "ratio": round(ratio, 3),
        "greedy_common_prefix": same,
        "ours_first_call_s": round(first_call_s, 3),
        "device": device,
        "load_average_1m": round(load, 2),
        **host,
    }
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
