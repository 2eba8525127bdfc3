"""One process of a two-process jax.distributed run that saves one sharded checkpoint through the
Checkpointer (tests/test_object_store.py). Usage: PROCESS_ID NUM_PROCESSES COORDINATOR URL [HOSTNAME].
A HOSTNAME stands in for the machine's name (to act as processes on different hosts); exit 3
when the Checkpointer refuses the run."""

from __future__ import annotations

import socket
import sys

pid, nproc, coordinator, url = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
if len(sys.argv) > 5:
    socket.gethostname = lambda: sys.argv[5]  # noqa: E731 - a stand-in host name

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=coordinator, num_processes=nproc, process_id=pid)

from lm_pipeline.train.checkpoint import Checkpointer, CheckpointerConfig  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("d",))
full = np.arange(32, dtype=np.float32).reshape(4, 8)
w = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("d")), lambda idx: full[idx])
b = jax.make_array_from_callback((3,), NamedSharding(mesh, P()), lambda idx: np.full(3, 7.0, np.float32)[idx])
try:
    ckpt = Checkpointer(CheckpointerConfig(), base_path_override=url)
except ValueError as e:
    print(f"refused: {e}", flush=True)
    sys.exit(3)
ckpt.save(1, {"w": w, "b": b})
ckpt.wait()
ckpt.close()
jax.distributed.shutdown()
