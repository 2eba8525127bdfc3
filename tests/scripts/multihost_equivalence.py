"""One process of a small f32 training run, recording what each step was fed (for tests/test_multihost.py).

usage: multihost_equivalence.py OUT_DIR NUM_PROCESSES PROCESS_ID [COORDINATOR]

With ``$MULTIHOST_MIXTURE=1`` the training rows are a data mixture of two components (the first
12 and the last 8 rows, weighed 3 : 1, then 1 : 1 from step 2; tests/test_mixture_multihost.py).

With NUM_PROCESSES 1 it is an ordinary one-process run (one CPU device); with more, one process
of a jax.distributed run on loopback. Writes ``OUT_DIR/process-<id>.json``: the per-step training
losses, the eval losses, and the rows of every train and eval batch that reached this process's
device, with their offset in the global batch. Process 0 also writes the final parameters,
gathered across processes, to ``OUT_DIR/params.npz``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from lm_pipeline.batch import ArrayDataset

SEQ_LEN, VOCAB, BATCH, STEPS = 32, 64, 8, 5
TRAIN_ROWS = 20  # 5 steps x 8 rows = 2 epochs: the batch of step 2 spans the epoch boundary
EVAL_ROWS = 16  # two eval batches of 8

CONFIG = {
    "model.type": "llama", "model.seq_len": SEQ_LEN, "model.hidden_dim": 32, "model.num_heads": 4,
    "model.num_kv_heads": 2, "model.intermediate_dim": 64, "model.num_layers": 2,
    "model.gradient_checkpointing": False, "trainer.mp": "f32", "trainer.train_batch_size": BATCH,
    "trainer.num_train_steps": STEPS, "trainer.log_every": 1, "trainer.steps_per_eval": 2, "trainer.seed": 3,
    "trainer.progress": False, "trainer.id": "mh", "optimizer.learning_rate": 1e-2, "optimizer.warmup": 1,
}


def make_rows(n: int, seed: int) -> np.ndarray:
    """``n`` distinct random rows whose alphabets differ (2 to 64 symbols), so rows differ in loss
    and a process that trains on the wrong rows gets a visibly different loss and gradient."""
    rng = np.random.default_rng(seed)
    rows = np.stack([rng.integers(0, 2 ** (1 + r % 6), SEQ_LEN) for r in range(n)]).astype(np.int32)
    assert len({r.tobytes() for r in rows}) == n
    return rows


#: The mixture of ``$MULTIHOST_MIXTURE=1``: its config and where each component's rows start.
MIXTURE = {"data.configs": {"a": {"train_urls": ["a.jsonl"]}, "b": {"train_urls": ["b.jsonl"]}},
           "data.train_weights": [[0, {"a": 3, "b": 1}], [2, {"a": 1, "b": 1}]], "data.mixture_block_size": 4}
MIXTURE_SPLIT = 12


def mixed(train: ArrayDataset) -> dict[str, ArrayDataset]:
    """The training rows as the mixture's two components."""
    return {"a": ArrayDataset(train.rows[:MIXTURE_SPLIT].ravel(), SEQ_LEN),
            "b": ArrayDataset(train.rows[MIXTURE_SPLIT:].ravel(), SEQ_LEN)}


def datasets() -> tuple[ArrayDataset, ArrayDataset]:
    """(train, eval): the same in every process and in the test."""
    return ArrayDataset(make_rows(TRAIN_ROWS, 0).ravel(), SEQ_LEN), ArrayDataset(make_rows(EVAL_ROWS, 1).ravel(), SEQ_LEN)


def main(out_dir: str, nproc: int, pid: int, coordinator: str | None) -> None:
    import jax
    from jax.experimental import multihost_utils

    from lm_pipeline import plots
    from lm_pipeline.config import load_config
    from lm_pipeline.train import run
    from lm_pipeline.train.trainer import Hook

    mixture = os.environ.get("MULTIHOST_MIXTURE") == "1"
    overrides = dict(CONFIG, **{"trainer.log_dir": f"{out_dir}/logs"}, **(MIXTURE if mixture else {}))
    if nproc > 1:
        overrides.update({"trainer.distributed.coordinator_address": coordinator,
                          "trainer.distributed.num_processes": nproc, "trainer.distributed.process_id": pid})
    cfg = load_config(None, overrides)

    fed: dict[str, list] = {"train": [], "eval": []}

    def local_rows(toks: jax.Array) -> list[dict]:
        # The rows on this process's devices as the jitted step receives them, and where they sit
        # in the global batch: the data itself, not what the batch source says it should be.
        return [{"offset": s.index[0].start or 0, "tokens": np.asarray(s.data).tolist()} for s in toks.addressable_shards]

    def recording(fn, kind):
        def step(state, toks, seg):
            fed[kind].append(local_rows(toks))
            return fn(state, toks, seg)
        return step

    build = run.build_step_functions

    def build_recording(*args, **kwargs):
        fns = build(*args, **kwargs)
        fns.train_step = recording(fns.train_step, "train")
        fns.eval_step = recording(fns.eval_step, "eval")
        return fns

    run.build_step_functions = build_recording  # run.train looks the name up in its own module
    from lm_pipeline.train import trackers

    log_writers: list[str] = []  # the metrics logs this process opened for writing

    class RecordingJsonl(trackers.JsonlTracker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            log_writers.append(type(self).__name__)

    trackers.JsonlTracker = RecordingJsonl
    plots.write_training_plots = lambda *a, **k: None  # not under test; importing matplotlib costs seconds
    losses: dict[int, float] = {}
    hook = Hook(lambda info: losses.__setitem__(info.step, info.metrics["train/loss"]), every=1)
    train_data, eval_data = datasets()
    res = run.train(cfg, train_data=mixed(train_data) if mixture else train_data, vocab_size=VOCAB, eval_data={"val": eval_data},
                    run_dir=f"{out_dir}/run", hooks=[hook])

    leaves = jax.tree.leaves(res.state.model)
    # A collective: every process takes part; the gathered arrays are the same in each.
    params = multihost_utils.process_allgather(leaves, tiled=True) if nproc > 1 else [np.asarray(x) for x in leaves]
    if pid == 0:
        np.savez(f"{out_dir}/params.npz", *params)
    record = {
        "process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
        "final_step": res.final_step, "losses": [losses[k] for k in sorted(losses)], "loss_steps": sorted(losses),
        "eval": [{"step": e["step"], "loss": e["eval/val/loss"]} for e in res.eval_history], "fed": fed,
        "log_writers": log_writers,
    }
    with open(f"{out_dir}/process-{pid}.json", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
