"""Log-likelihood throughput of lm-evaluation-harness tasks: our JAX model behind the harness
(:class:`lm_pipeline.eval.harness.HarnessLM`) vs the harness's own Hugging Face backend (``HFLM``).

One GPT-2 (default 4 layers x 256 wide, 4 heads, 256 positions, random weights at the usual init
scale) with a byte-level BPE trained on the task text is exported with
:func:`lm_pipeline.hf.export_hf`; both sides load that export. The tasks are local task files
shaped like HellaSwag, ARC (5-shot), LAMBADA and WikiText (rolling windows), ``--docs`` documents
each, run once per side through the harness (``simple_evaluate``) with the same batch size, float32
on the CPU. The time counted is the time inside the model's ``loglikelihood`` and
``loglikelihood_rolling`` calls (our first call includes compiling the bucket programs: a cold
run); examples are the requests answered. ``ratio`` = our examples/s / the HF backend's. Both
sides' per-request log-likelihoods are compared (largest relative difference). The last line is
``RESULT {json}``.

    python bench/harness_throughput.py [--docs 200] [--layers 4] [--width 256] [--batch-size 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the task files the tests write (helpers.harness_tasks)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import host_info, host_line, loadavg  # noqa: E402

TASKS = ["tiny_hellaswag", {"task": "tiny_arc", "num_fewshot": 5, "task_alias": "tiny_arc_5shot"}, "tiny_lambada",
         "tiny_wikitext"]


class Timed:
    """Counts the requests an LM answers and the seconds spent answering them."""

    def __init__(self, lm) -> None:
        self.seconds, self.requests, self.answers = 0.0, 0, []
        for name in ("loglikelihood", "loglikelihood_rolling"):
            setattr(lm, name, self._wrap(getattr(lm, name)))

    def _wrap(self, fn):
        def timed(requests, *args, **kwargs):
            t0 = time.perf_counter()
            out = fn(requests, *args, **kwargs)
            self.seconds += time.perf_counter() - t0
            self.requests += len(requests)
            self.answers += [(r.args, o[0] if isinstance(o, tuple) else o) for r, o in zip(requests, out, strict=True)]
            return out
        return timed


def _export(tmp: str, args: argparse.Namespace, texts: list[str]) -> str:
    import jax

    from lm_pipeline.data.config import TokenizerConfig
    from lm_pipeline.data.tokenizer import train_bpe
    from lm_pipeline.hf import export_hf
    from lm_pipeline.models import Gpt2Config

    tok = os.path.join(tmp, "tok")
    info = train_bpe(texts, TokenizerConfig(kind="bpe", vocab_size=args.vocab), tok, progress=False)
    cfg = Gpt2Config(seq_len=args.seq_len, hidden_dim=args.width, num_layers=args.layers, num_heads=args.heads)
    return export_hf(cfg.build(info.vocab_size, key=jax.random.PRNGKey(0)), os.path.join(tmp, "hf"), tokenizer_dir=tok)


def _run(lm, cfg, manager) -> tuple[Timed, float]:
    from lm_pipeline.eval.tasks import run_tasks

    timed = Timed(lm)
    t0 = time.perf_counter()
    run_tasks(lm, cfg, manager)
    return timed, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=200, help="documents per task")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import jax
    import lm_eval
    import torch
    from helpers.harness_tasks import write_tasks
    from lm_eval.models.huggingface import HFLM

    from lm_pipeline.eval.harness import load_harness_lm
    from lm_pipeline.eval.harness_config import EvalHarnessConfig
    from lm_pipeline.eval.tasks import task_manager
    from lm_pipeline.schema import from_dict

    with tempfile.TemporaryDirectory() as tmp:
        tasks = write_tasks(Path(tmp) / "tasks", n_docs=args.docs)
        texts = [p.read_text(encoding="utf-8") for p in sorted(Path(tasks).glob("*.jsonl"))]
        export = _export(tmp, args, texts)
        cfg = from_dict(EvalHarnessConfig, {"task_spec": TASKS, "include_path": [str(tasks)]})
        manager = task_manager(cfg)
        hf_lm = HFLM(pretrained=export, device="cpu", batch_size=args.batch_size, dtype="float32")
        hf, hf_wall = _run(hf_lm, cfg, manager)  # first: the task data is cached for both sides alike
        ours, ours_wall = _run(load_harness_lm(export, batch_size=args.batch_size), cfg, manager)
    assert ours.requests == hf.requests, (ours.requests, hf.requests)
    ref = dict((str(a), v) for a, v in hf.answers)
    rel = max(abs(v - ref[str(a)]) / max(abs(ref[str(a)]), 1e-9) for a, v in ours.answers)
    rate = {"ours": ours.requests / ours.seconds, "hf": hf.requests / hf.seconds}
    ratio = rate["ours"] / rate["hf"]
    host = host_info()
    print(host_line(host))
    print(f"GPT-2 {args.layers} layers x {args.width} wide, {args.heads} heads, {args.seq_len} positions, vocab "
          f"{args.vocab}; tasks {', '.join(t if isinstance(t, str) else t['task_alias'] for t in TASKS)}: {args.docs} "
          f"documents each, {ours.requests} requests; batch {args.batch_size}; float32; {os.cpu_count()} cores, "
          f"{platform.machine()}; 1-minute load average {loadavg():.2f}")
    print(f"jax {jax.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"lm_eval {lm_eval.__version__}")
    print(f"{'side':<28} {'model s':>8} {'run s':>8} {'examples/s':>11}")
    print(f"{'ours (JAX, cold: compiles)':<28} {ours.seconds:>8.2f} {ours_wall:>8.2f} {rate['ours']:>11.1f}")
    print(f"{'HF backend (HFLM, torch)':<28} {hf.seconds:>8.2f} {hf_wall:>8.2f} {rate['hf']:>11.1f}")
    print(f"ratio (ours / HF backend): {ratio:.2f}x; largest relative log-likelihood difference {rel:.2e}")
    result = {"model": f"gpt2-{args.layers}x{args.width}-s{args.seq_len}-v{args.vocab}", "docs_per_task": args.docs,
              "requests": ours.requests, "batch_size": args.batch_size, "ours_examples_per_s": round(rate["ours"], 2),
              "hf_examples_per_s": round(rate["hf"], 2), "ours_model_s": round(ours.seconds, 3),
              "hf_model_s": round(hf.seconds, 3), "ratio": round(ratio, 3), "max_rel_diff": float(f"{rel:.3e}"),
              "torch_threads": torch.get_num_threads(), "load_average_1m": round(loadavg(), 2), **host}
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
