"""One process of a two-process jax.distributed run that trains a toy sharded state for 6 steps,
checkpointing at steps 3 and 6 to an object store, resuming from the latest complete checkpoint
there (tests/test_object_store_multihost.py). Each process stands in for a host of its own: its
host name (HOSTNAME) and its checkpoint staging/cache dir ($LM_PIPELINE_CHECKPOINT_CACHE, set per
process by the test) are its own. Process 0 writes the final state to OUT (.npz).

Usage: PROCESS_ID NUM_PROCESSES COORDINATOR URL HOSTNAME OUT
"""

from __future__ import annotations

import socket
import sys

pid, nproc, coordinator, url, host, out = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                           sys.argv[5], sys.argv[6])
socket.gethostname = lambda: host  # noqa: E731 - a stand-in host name

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=coordinator, num_processes=nproc, process_id=pid)

from lm_pipeline.train.checkpoint import Checkpointer, CheckpointerConfig, verify  # noqa: E402

STEPS, SAVE_AT = 6, (3, 6)
mesh = Mesh(np.array(jax.devices()), ("d",))
shardings = {"w": NamedSharding(mesh, P("d")), "v": NamedSharding(mesh, P(None, "d")), "b": NamedSharding(mesh, P())}
init = {"w": np.arange(32, dtype=np.float32).reshape(4, 8) / 7, "v": np.linspace(-1, 1, 48, dtype=np.float32).reshape(6, 8),
        "b": np.full(3, 0.5, np.float32)}
abstract = {k: jax.ShapeDtypeStruct(init[k].shape, init[k].dtype, sharding=shardings[k]) for k in init}


@jax.jit
def update(state, step):
    s = step.astype(jnp.float32)
    return {"w": state["w"] * 0.9 + jnp.sin(state["w"] + s) * 0.1,
            "v": state["v"] - 0.05 * jnp.tanh(state["v"] * s),
            "b": state["b"] + 0.01 * s}


ckpt = Checkpointer(CheckpointerConfig(), base_path_override=url)
latest = ckpt.latest_checkpoint()
if latest is None:
    state, start = {k: jax.make_array_from_callback(v.shape, shardings[k], lambda i, v=v: v[i]) for k, v in init.items()}, 0
else:
    marker = ckpt.read_metadata(latest)
    problems = verify(latest, marker)  # downloads into this process's own cache and checks it
    assert problems == [], problems
    state, start = ckpt.load(latest, abstract), marker["step"]
    print(f"resumed_from {latest}", flush=True)
for step in range(start + 1, STEPS + 1):
    state = update(state, jnp.asarray(step))
    if step in SAVE_AT:
        ckpt.save(step, state)
ckpt.wait()
ckpt.close()
final = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in state.items()}
if pid == 0:
    np.savez(out, **final)
print("finished", flush=True)
jax.distributed.shutdown()
