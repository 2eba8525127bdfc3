"""bench/scaling.py's memory helper: per-device parameter + optimizer bytes halve from 1 to 2 FSDP
devices (simulated CPU devices, tiny model) and match the estimator."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys
sys.path.insert(0, {bench!r})
import scaling
print("MEMORY " + json.dumps(scaling.memory_per_device((1, 2), {{"layers": 1, "width": 64, "ctx": 32}})))
"""


def test_memory_per_device_halves_with_two_fsdp_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(bench=str(ROOT / "bench"))], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("MEMORY ")][-1]
    one, two = json.loads(line[len("MEMORY "):])
    for r in (one, two):
        assert r["params_bytes"] == r["est_params_bytes"] and r["opt_bytes"] == r["est_opt_bytes"]
    total1 = one["params_bytes"] + one["opt_bytes"]
    total2 = two["params_bytes"] + two["opt_bytes"]
    # Sharded leaves halve; the replicated ones (biases without an embed axis, counters) do not.
    assert total2 == (total1 - one["replicated_bytes"]) // 2 + two["replicated_bytes"]
