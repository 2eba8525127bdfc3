"""Fast guards for resume and checkpoint completeness (the slow and faults tiers repeat them
with real SIGKILLs through the CLI).

- A run interrupted after a checkpoint and started again ends with the parameters of a run
  that was never interrupted.
- The completion marker is written only once every array of the checkpoint is in place: at the
  moment the marker appears, the directory already holds exactly what a finished save holds,
  and a copy of it taken at that moment loads as the saved state.
"""

import hashlib
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers.resume import assert_resumed_to, crash_after_step

from lm_pipeline import atomic
from lm_pipeline.batch import ArrayDataset, epoch_permutation
from lm_pipeline.config import load_config
from lm_pipeline.train.checkpoint import (
    MARKER,
    Checkpointer,
    CheckpointerConfig,
    KeepPolicy,
    load,
)
from lm_pipeline.train.run import train

CFG = {
    "model.type": "gpt2", "model.seq_len": 16, "model.hidden_dim": 16, "model.num_heads": 2, "model.num_layers": 2,
    "model.gradient_checkpointing": False, "trainer.mp": "f32", "trainer.train_batch_size": 4,
    "trainer.num_train_steps": 9, "trainer.progress": False, "trainer.steps_per_eval": 1000,
    "trainer.checkpointer.keep": [{"every": 4}], "trainer.id": "resume",
    "optimizer.learning_rate": 1e-2, "optimizer.warmup": 0,
}


class _Recording(ArrayDataset):
    """Records the rows each read returns: what really reaches the train step."""

    def __init__(self):
        # 23 rows: batches of 4 cross an epoch boundary, so a batch-index slip shows.
        super().__init__(np.random.default_rng(0).integers(0, 50, 23 * 16), 16)
        self.reads: list[list[int]] = []

    def get_many(self, indices):
        self.reads.append([int(i) for i in indices])
        return super().get_many(indices)


def _expected_rows(seed: int, steps: range) -> list[list[int]]:
    """Rows of each step's batch: the epochs' permutations laid end to end, 4 rows a step."""
    order = np.concatenate([epoch_permutation(23, seed, e) for e in range(3)])
    return [order[4 * k : 4 * k + 4].tolist() for k in steps]


def test_interrupted_run_resumes_to_the_uninterrupted_parameters(tmp_path, monkeypatch):
    cfg = load_config(None, CFG)
    data = _Recording()
    clean = train(cfg, train_data=data, vocab_size=50, run_dir=str(tmp_path / "clean"))
    assert clean.final_step == 9 and clean.resumed_from is None
    assert data.reads[-9:] == _expected_rows(cfg.trainer.seed, range(9))

    run_dir = str(tmp_path / "cut")
    # a crash after step 6: step-4 is the last complete checkpoint
    cut = crash_after_step(monkeypatch, 6, lambda: train(cfg, train_data=_Recording(), vocab_size=50, run_dir=run_dir),
                           run_dir)
    assert cut.endswith("step-4")

    data = _Recording()
    resumed = train(cfg, train_data=data, vocab_size=50, run_dir=run_dir)
    assert resumed.resumed_from.endswith("step-4") and resumed.final_step == 9
    assert data.reads[-5:] == _expected_rows(cfg.trainer.seed, range(4, 9))
    assert_resumed_to(clean.state, resumed.state, run_dir, "step-4")


def _tree(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``root`` (the marker excluded)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*")) if p.is_file() and p.name != MARKER
    }


@pytest.mark.parametrize("async_save", [True, False])
def test_marker_is_written_after_every_array(tmp_path, monkeypatch, async_save):
    rng = np.random.default_rng(1)
    state = {"w": jax.numpy.asarray(rng.normal(size=(64, 32)), jax.numpy.float32),
             "b": jax.numpy.asarray(rng.normal(size=(32,)), jax.numpy.float32),
             "step": jax.numpy.asarray(3, jax.numpy.int32)}
    seen: list[tuple[dict[str, str], Path]] = []
    real_write_json = atomic.atomic_write_json

    def observed_write_json(path, obj, **kw):
        if Path(str(path)).name == MARKER:  # snapshot the dir as the marker is about to appear
            step_dir = Path(str(path)).parent
            snap = tmp_path / f"at-marker-{len(seen)}"
            shutil.copytree(step_dir, snap)
            real_write_json(str(snap / MARKER), obj, **kw)
            seen.append((_tree(step_dir), snap))
        return real_write_json(path, obj, **kw)

    monkeypatch.setattr(atomic, "atomic_write_json", observed_write_json)
    cfg = CheckpointerConfig(base_path=str(tmp_path / "ckpt"), keep=(KeepPolicy(every=1),))
    with Checkpointer(cfg, async_save=async_save) as ck:
        path = ck.save(3, state)
    final = _tree(Path(path))
    assert seen and any(f.startswith("state") for f in final), final
    for at_marker, snap in seen:
        assert at_marker == final, "files changed after the completion marker was written"
        restored = load(str(snap), jax.eval_shape(lambda: state))
        for k in state:
            np.testing.assert_array_equal(np.asarray(restored[k]), np.asarray(state[k]))
    assert len(seen) == 1, "the marker must be written once per save"
