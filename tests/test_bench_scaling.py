"""bench/scaling.py's memory helper: per-device parameter + optimizer bytes halve from 1 to 2 FSDP
devices (simulated CPU devices, tiny model) and match the estimator."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json
import scaling
print("MEMORY " + json.dumps(scaling.memory_per_device((1, 2), {"layers": 1, "width": 64, "ctx": 32})))
"""


def test_memory_per_device_halves_with_two_fsdp_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT / "bench"))
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True,
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


@pytest.mark.slow  # builds and loads three small corpora in child processes (about 20 s)
def test_scaling_large_smoke(tmp_path):
    """bench/scaling_large.py --smoke: a corpus of 1/2/4 MB of JSONL/zstd shards; every size's cache is
    built in a child process whose memory is recorded, read back by the loader, and removed with the corpus."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "scaling_large.py"), "--smoke", "--work-root",
                          str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    res = json.loads(last[len("RESULT "):])
    rows = res["rows"]
    assert [round(r["mb"]) for r in rows] == [1, 2, 4]  # monotone sizes, each a prefix of the shard list
    for a, b in zip(rows, rows[1:], strict=False):
        assert b["shards"] == 2 * a["shards"] and b["tokens"] > 1.8 * a["tokens"] and b["docs"] > a["docs"]
    for r in rows:
        # the cache holds exactly the generated text; tokens of a byte-level BPE: fewer than bytes
        assert abs(r["text_bytes"] / 1e6 - r["mb"]) < 1e-3 and 0 < r["tokens"] < r["text_bytes"]
        # memory measured in the child that built (it imported the cache code: tens of MB), not here
        assert 20 < r["rss_start_mb"] < r["builder_peak_mb"] and r["tree_peak_mb"] > 0
        assert r["build_s"] > 0 and r["cpu_s"] > 0 and r["cache_bytes"] >= 4 * r["tokens"]
        for packing in ("concat", "greedy"):
            ld = r["loader"][packing]
            assert ld["batches"] == 20 and 0 < ld["batch_ms_median"] <= ld["batch_ms_p95"]
            assert 0 < ld["rss_import_mb"] <= ld["peak_mb"] and ld["rows"] > 0
        assert r["loader"]["concat"]["rows"] == r["tokens"] // res["seq_len"]
    assert res["step"]["step_ms_median"] > 0 and res["allocator"] in ("tcmalloc", "glibc")
    assert res["ratio"] == round(rows[-1]["builder_peak_mb"] / rows[0]["builder_peak_mb"], 4)
    assert res["fit"]["slope"] > 0 and res["cpu_fit"]["r2"] > 0
    assert list(tmp_path.iterdir()) == []  # corpus and caches removed
