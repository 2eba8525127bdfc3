"""``lm-pipeline estimate`` against XLA's own memory plan of the real train step, on this backend.

For each model of a grid, with and without gradient checkpointing, this compiles (does not run)
the trainer's jitted step on one device and reads XLA's buffer assignment
(``train_step.lower(...).compile().memory_analysis()``: arguments + outputs - aliased + temp,
the step's peak), then prints it beside :func:`lm_pipeline.estimate.estimate` and the
estimate's parts (parameters + optimizer state, saved activations, the two backward phases).

Grids::

    small  (default; any backend, a few seconds per row on a CPU)
    gpu    GPT-2 124M and a 350M Llama at realistic micro-batches, plus smaller shapes of the
           same families (needs an accelerator's memory, minutes on one)

    python bench/estimate_check.py [--grid small|gpu] [--mp p=f32,c=bfloat16]

The last line is ``RESULT {json}`` with ``ratio`` = the estimate / XLA ratio farthest from 1,
and each row.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import host_info, host_line  # noqa: E402

GPT2 = {"model.type": "gpt2"}
LLAMA = {"model.type": "llama"}


def _m(base, d, t, b, v, layers, heads, mlp=None, kv=None):
    row = {**base, "model.hidden_dim": d, "model.seq_len": t, "trainer.train_batch_size": b, "vocab": v,
           "model.num_layers": layers, "model.num_heads": heads}
    if mlp:
        row["model.intermediate_dim"] = mlp
    if kv:
        row["model.num_kv_heads"] = kv
    return row


GRIDS = {
    "small": [
        _m(GPT2, 128, 128, 8, 2048, 2, 4), _m(LLAMA, 128, 128, 8, 2048, 2, 4, 384, 2),
        _m(GPT2, 256, 256, 8, 8192, 4, 8), _m(LLAMA, 256, 256, 8, 8192, 4, 8, 768, 4),
    ],
    "gpu": [
        _m(GPT2, 768, 1024, 32, 50257, 12, 12), _m(GPT2, 768, 1024, 8, 50257, 12, 12),
        _m(LLAMA, 1024, 2048, 8, 32000, 24, 16, 2816, 16), _m(LLAMA, 1024, 2048, 4, 32000, 24, 16, 2816, 16),
        _m(GPT2, 512, 512, 16, 16384, 6, 8), _m(LLAMA, 512, 1024, 8, 16384, 8, 8, 1408, 4),
    ],
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", choices=sorted(GRIDS), default="small")
    p.add_argument("--mp", default="p=f32,c=bfloat16", help="trainer.mp of every row")
    p.add_argument("--models", type=int, default=None, help="only the grid's first N models")
    args = p.parse_args(argv)
    import jax

    from lm_pipeline.config import load_config
    from lm_pipeline.estimate import compiled_step_bytes, estimate

    gib = 2.0**30
    rows = []
    dev = jax.devices()[0]
    host = host_info(gpu=dev.device_kind if dev.platform == "gpu" else None)
    print(host_line(host))
    print(f"backend {jax.default_backend()} ({dev.device_kind}), mp {args.mp}")
    print(f"{'model':<6} {'D/T/B/V/L':<22} {'remat':<6} {'XLA GiB':>8} {'est GiB':>8} {'est/XLA':>7}"
          f"  {'params+opt':>10} {'saved':>7} {'head bwd':>8} {'layer bwd':>9}")
    for spec in GRIDS[args.grid][: args.models]:
        spec = dict(spec)
        vocab = spec.pop("vocab")
        for remat in (False, True):
            cfg = load_config(None, {**spec, "model.gradient_checkpointing": remat, "trainer.mp": args.mp,
                                     "trainer.per_device_parallelism": -1})
            xla = compiled_step_bytes(cfg, vocab)
            e = estimate(cfg, num_devices=1, vocab_size=vocab, segments=False)
            a = e.activations_detail
            mc = cfg.model
            shape = f"{mc.hidden_dim}/{mc.seq_len}/{cfg.trainer.train_batch_size}/{vocab}/{mc.num_layers}"
            row = {"model": mc.type, "shape": shape, "remat": remat, "xla_bytes": xla, "estimate_bytes": e.total,
                   "ratio": e.total / xla, "params_opt": e.params + e.optimizer, "saved": a.saved,
                   "head_backward": a.head_backward, "layer_backward": a.layer_backward}
            rows.append(row)
            print(f"{mc.type:<6} {shape:<22} {str(remat):<6} {xla / gib:8.2f} {e.total / gib:8.2f} {row['ratio']:7.2f}"
                  f"  {row['params_opt'] / gib:10.2f} {a.saved / gib:7.2f} {a.head_backward / gib:8.2f}"
                  f" {a.layer_backward / gib:9.2f}", flush=True)
            jax.clear_caches()
    worst = max((r["ratio"] for r in rows), key=lambda x: max(x, 1 / x))
    print("RESULT " + json.dumps({"ratio": round(worst, 4), "backend": jax.default_backend(),
                                  "device": dev.device_kind, "grid": args.grid, "rows": rows, **host}))


if __name__ == "__main__":
    main()
