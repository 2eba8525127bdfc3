"""bench/gpu_mfu.py and bench/estimate_check.py run end to end (tiny shapes on CPU) and end with their RESULT line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_mfu_smoke_reports_both_shapes():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_mfu.py"), "--smoke"], capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    res = json.loads(last[len("RESULT "):])
    assert res["smoke"] is True and {s["shape"] for s in res["shapes"]} == {"gpt2_124m", "llama_350m"}
    for s in res["shapes"]:
        assert s["tokens_per_s"] > 0 and 0 < s["mfu"] and s["micro_batch"] >= 1
        assert abs(s["achieved_flops"] - s["flops_per_token"] * s["tokens_per_s"]) < 1e-6 * s["achieved_flops"]
    assert res["ratio"] == round(min(s["mfu"] for s in res["shapes"]), 4)


@pytest.mark.slow
def test_estimate_check_compares_the_estimate_with_xlas_plan():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "estimate_check.py"), "--models", "1"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1][len("RESULT "):])
    assert [r["remat"] for r in res["rows"]] == [False, True]
    for r in res["rows"]:
        assert r["xla_bytes"] > 0 and r["ratio"] == r["estimate_bytes"] / r["xla_bytes"]
        assert 0.7 < r["ratio"] < 1.3  # the estimator's calibration, on this backend
    assert res["ratio"] == round(max((r["ratio"] for r in res["rows"]), key=lambda x: max(x, 1 / x)), 4)
