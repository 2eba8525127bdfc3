"""Non-finite loss or gradients (1-based train steps made NaN from the test side: the production
step run on NaN token embeddings, ``tests/helpers/nonfinite.py``): skipped with
``optimizer.skip_bad_steps: true``, a clear stop otherwise, and never a non-finite value in a saved
checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import artifact_dir, copy_store, final_params, run_stage

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


def _checkpoints(run: Path) -> dict[int, dict]:
    """Every complete checkpoint of the run: step -> its model arrays (all must be finite)."""
    out = {}
    for d in sorted(run.glob("step-*")):
        if (d / "checkpoint.json").exists():
            params = final_params(d)
            for k, v in params.items():
                if k != "__step__":
                    assert np.all(np.isfinite(v)), f"{d.name}: non-finite values in {k}"
            out[params["__step__"]] = params
    return out


@pytest.mark.reliability("non-finite loss / gradients")
def test_nonfinite_step_stops_the_run_clearly(experiment, tmp_path, note):
    store = copy_store(experiment.reference, tmp_path / "store", drop=("train_ckpt", "eval_report", "hf_export"))
    res = run_stage(experiment, store, "train_ckpt", cli=True, nonfinite_steps="3",
                    overrides=("--optimizer.skip_bad_steps", "false"))
    assert res.returncode not in (0, -9), res.output[-2000:]
    tail = res.output[-4000:]
    lines = [ln for ln in tail.splitlines() if "non-finite" in ln and ("error" in ln.lower())]
    assert lines and "step 3" in lines[-1] and "skip_bad_steps" in lines[-1], tail
    run = artifact_dir(store, "train_ckpt")
    saved = _checkpoints(run) if run else {}
    assert max(saved, default=0) < 3, f"a checkpoint after the bad step was saved: {sorted(saved)}"
    assert not (run and (run / "manifest.json").exists())
    note(f"NaN forced at step 3, skip_bad_steps false: exit {res.returncode}, {lines[-1].strip()[:150]!r}; "
         f"complete checkpoints: {sorted(saved)} (all finite), none after step 2")


@pytest.mark.reliability("non-finite loss / gradients")
def test_nonfinite_steps_are_skipped_when_configured(experiment, tmp_path, note):
    store = copy_store(experiment.reference, tmp_path / "store", drop=("train_ckpt", "eval_report", "hf_export"))
    res = run_stage(experiment, store, "train_ckpt", cli=True, nonfinite_steps="3,4",
                    overrides=("--optimizer.skip_bad_steps", "true"))
    assert res.returncode == 0, res.output[-3000:]
    run = artifact_dir(store, "train_ckpt")
    saved = _checkpoints(run)
    assert sorted(saved) == [2, 4, 6]
    for k in saved[2]:  # steps 3 and 4 were skipped: step-4's parameters are step-2's
        if k != "__step__":
            np.testing.assert_array_equal(saved[2][k], saved[4][k], err_msg=k)
    assert any(not np.array_equal(saved[4][k], saved[6][k]) for k in saved[4] if k != "__step__")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    counts = [r["optim/skipped_steps"] for r in rows if "optim/skipped_steps" in r]
    assert counts and max(counts) == 2, f"optim/skipped_steps should reach 2, got {counts}"
    note("NaN forced at steps 3-4, skip_bad_steps true: both skipped (step-4 parameters == step-2's), "
         "run finished at step 6, every checkpoint finite")
