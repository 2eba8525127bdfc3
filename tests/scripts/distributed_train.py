"""One process of a multi-process training run on loopback (jax.distributed, gloo CPU collectives).

usage: distributed_train.py COORDINATOR NUM_PROCESSES PROCESS_ID RUN_DIR
"""

import json
import sys

import numpy as np

from lm_pipeline.batch import ArrayDataset
from lm_pipeline.config import load_config
from lm_pipeline.train.run import train

coordinator, nproc, pid, run_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
cfg = load_config(None, {
    "model.type": "gpt2", "model.seq_len": 32, "model.hidden_dim": 32, "model.num_heads": 2, "model.num_layers": 2,
    "model.gradient_checkpointing": False, "trainer.train_batch_size": 8, "trainer.num_train_steps": 6,
    "trainer.log_every": 2, "trainer.progress": False, "trainer.id": "dist", "trainer.log_dir": f"{run_dir}/logs",
    "trainer.checkpointer.keep": [{"every": 3}], "trainer.steps_per_eval": 3,
    "trainer.distributed.coordinator_address": coordinator, "trainer.distributed.num_processes": nproc,
    "trainer.distributed.process_id": pid, "optimizer.learning_rate": 1e-3,
})
rng = np.random.default_rng(0)
tokens = np.tile(rng.integers(0, 64, 200), 10)
res = train(cfg, train_data=ArrayDataset(tokens, 32), vocab_size=64, eval_data={"val": ArrayDataset(tokens[:640], 32)},
            run_dir=run_dir)
import jax  # noqa: E402

print("RESULT " + json.dumps({"process": jax.process_index(), "processes": jax.process_count(),
                              "devices": jax.device_count(), "final_step": res.final_step,
                              "loss": res.metrics.get("train/loss"), "checkpoints": res.checkpoints}))
