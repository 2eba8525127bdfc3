"""Checkpoints that heal: a damaged checkpoint (a file deleted, truncated or altered after it was
written) is moved aside, never deleted, with a one-line warning, and the run resumes from the
newest intact one -- ending with the parameters of a run that was never interrupted."""

import hashlib
import json
import logging
import os
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest

from lm_pipeline import faultpoints
from lm_pipeline.batch import ArrayDataset
from lm_pipeline.config import load_config
from lm_pipeline.faultpoints import FaultInjected
from lm_pipeline.train.checkpoint import MARKER, latest_checkpoint
from lm_pipeline.train.run import train

CFG = {
    "model.type": "gpt2", "model.seq_len": 16, "model.hidden_dim": 16, "model.num_heads": 2, "model.num_layers": 2,
    "model.gradient_checkpointing": False, "trainer.mp": "f32", "trainer.train_batch_size": 4,
    "trainer.num_train_steps": 9, "trainer.progress": False, "trainer.steps_per_eval": 1000,
    "trainer.checkpointer.keep": [{"every": 4}], "trainer.id": "heal",
    "optimizer.learning_rate": 1e-2, "optimizer.warmup": 0,
}


def _data() -> ArrayDataset:
    return ArrayDataset(np.random.default_rng(0).integers(0, 50, 23 * 16), 16)


def _params(state) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array))]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The uninterrupted run: the parameters every healed run must end with."""
    res = train(load_config(None, CFG), train_data=_data(), vocab_size=50,
                run_dir=str(tmp_path_factory.mktemp("clean") / "run"))
    assert res.final_step == 9 and res.resumed_from is None
    return _params(res.state)


def _cut(run_dir: Path, monkeypatch, after: int) -> None:
    """A run that crashes after step ``after`` (its checkpoints up to then are complete)."""
    faultpoints.reset()  # passes are counted per process: count this run's steps only
    monkeypatch.setenv("LM_PIPELINE_FAULTPOINT", f"train.after_step:{after}:raise")
    with pytest.raises(FaultInjected):
        train(load_config(None, CFG), train_data=_data(), vocab_size=50, run_dir=str(run_dir))
    monkeypatch.delenv("LM_PIPELINE_FAULTPOINT")
    faultpoints.reset()  # leave no counts behind for the next test that arms the point


def _largest_state_file(step_dir: Path) -> Path:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def _damage(step_dir: Path, how: str) -> None:
    victim = _largest_state_file(step_dir)
    data = victim.read_bytes()
    if how == "deleted":
        victim.unlink()
    elif how == "truncated":
        victim.write_bytes(data[: len(data) // 2])
    elif how == "flipped":
        i = len(data) // 2
        victim.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
    elif how == "deleted, no record":  # a checkpoint written before files were recorded
        marker = json.loads((step_dir / MARKER).read_text())
        marker.pop("files")
        (step_dir / MARKER).write_text(json.dumps(marker))
        victim.unlink()
    else:
        raise AssertionError(how)


@pytest.mark.slow  # a real training run with checkpoints: ~20 s
def test_the_marker_records_every_file_with_its_size_and_hash(tmp_path, monkeypatch):
    _cut(tmp_path / "run", monkeypatch, after=6)
    step = tmp_path / "run" / "step-4"
    files = json.loads((step / MARKER).read_text())["files"]
    on_disk = {str(p.relative_to(step)): p for p in step.rglob("*") if p.is_file() and p.name != MARKER}
    assert set(files) == set(on_disk) and any(k.startswith("state/") for k in files)
    for rel, p in on_disk.items():
        assert files[rel] == {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}


@pytest.mark.parametrize("how", ["deleted", "truncated", "flipped", "deleted, no record"])
def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_run_resumes_from_the_one_before(
        tmp_path, monkeypatch, caplog, clean, how):
    run_dir = tmp_path / "run"
    _cut(run_dir, monkeypatch, after=9)  # step-4 and step-8 complete; the crash came before step-9's save
    assert latest_checkpoint(str(run_dir)).endswith("step-8")
    _damage(run_dir / "step-8", how)
    with caplog.at_level(logging.WARNING, logger="lm_pipeline.train.run"):
        res = train(load_config(None, CFG), train_data=_data(), vocab_size=50, run_dir=str(run_dir))
    assert res.resumed_from.endswith("step-4") and res.final_step == 9
    for x, y in zip(clean, _params(res.state), strict=True):
        np.testing.assert_array_equal(x, y)
    moved = list((run_dir / ".damaged").glob("step-8-*"))
    assert len(moved) == 1 and (moved[0] / MARKER).is_file()  # kept, whole, for inspection
    warnings = [r.getMessage() for r in caplog.records if " is damaged: " in r.getMessage()]
    assert len(warnings) == 1 and "step-8" in warnings[0] and "moved it aside" in warnings[0]
    assert "\n" not in warnings[0]
    assert latest_checkpoint(str(run_dir)).endswith("step-9")


def test_a_damaged_only_checkpoint_is_moved_aside_and_the_run_starts_afresh(tmp_path, monkeypatch, clean):
    run_dir = tmp_path / "run"
    _cut(run_dir, monkeypatch, after=6)  # step-4 only
    _damage(run_dir / "step-4", "flipped")
    res = train(load_config(None, CFG), train_data=_data(), vocab_size=50, run_dir=str(run_dir))
    assert res.resumed_from is None and res.final_step == 9
    for x, y in zip(clean, _params(res.state), strict=True):
        np.testing.assert_array_equal(x, y)
    assert len(list((run_dir / ".damaged").glob("step-4-*"))) == 1


def test_a_checkpoint_that_does_not_fit_the_model_is_an_error_not_damage(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    _cut(run_dir, monkeypatch, after=6)
    other = {**CFG, "model.hidden_dim": 32}
    with pytest.raises(Exception) as err:
        train(load_config(None, other), train_data=_data(), vocab_size=50, run_dir=str(run_dir))
    assert "damaged" not in str(err.value)
    assert (run_dir / "step-4" / MARKER).is_file() and not (run_dir / ".damaged").exists()


def test_a_damaged_checkpoint_the_user_named_is_an_error_naming_it(tmp_path, monkeypatch):
    from lm_pipeline.schema import ConfigError

    run_dir = tmp_path / "run"
    _cut(run_dir, monkeypatch, after=6)
    _damage(run_dir / "step-4", "truncated")
    cfg = load_config(None, {**CFG, "trainer.load_checkpoint_path": str(run_dir / "step-4")})
    with pytest.raises(ConfigError, match=r"step-4 is damaged: state/.* bytes"):
        train(cfg, train_data=_data(), vocab_size=50, run_dir=str(tmp_path / "other"))
    assert (run_dir / "step-4" / MARKER).is_file()  # the user's checkpoint is left where it is


@pytest.mark.parametrize("where", ["local", "memory"])
def test_integrity_on_a_local_dir_and_on_an_object_store(tmp_path, monkeypatch, where):
    """file_digests, verify and move_aside on hand-made step dirs: the same record and findings
    on both; a damaged download is dropped (the next look downloads again), a local dir never is."""
    import uuid

    from lm_pipeline import fs
    from lm_pipeline.train.checkpoint.integrity import file_digests, move_aside, verify
    from lm_pipeline.train.checkpoint.remote import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    root = str(tmp_path / "run") if where == "local" else f"memory://lmp-heal-{uuid.uuid4().hex[:8]}/run"
    step = fs.join(root, "step-4")
    files = {"state/a": b"a" * 10, "state/sub/b": b"b" * 3, "tokenizer/t.json": b"{}"}
    for rel, data in files.items():
        fs.put(_local_file(tmp_path, data), fs.join(step, *rel.split("/")))
    record = file_digests(step)
    assert record == {rel: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for rel, d in files.items()}
    marker = {"step": 4, "kind": "temporary", "files": record, "unix_time": 1}
    fs.put(_local_file(tmp_path, json.dumps(marker).encode()), fs.join(step, MARKER))
    assert file_digests(step) == record  # the marker is never recorded
    assert verify(step, marker) == []
    downloads = sorted(os.listdir(tmp_path / "cache")) if (tmp_path / "cache").exists() else []
    assert (downloads == []) == (where == "local")  # a local dir is checked in place
    fs.put(_local_file(tmp_path, b"b" * 2), fs.join(step, "state", "sub", "b"))  # truncated after the save
    problems = verify(step, marker)
    if where == "memory":  # the intact copy made before is what was checked: still intact
        assert problems == []
        from lm_pipeline.train.checkpoint.remote import forget_copy

        forget_copy(step, marker)
        problems = verify(step, marker)
    assert problems == ["state/sub/b has 2 bytes, 3 were written"]
    assert fs.exists(fs.join(step, MARKER))  # verify only reports
    if where == "memory":
        assert os.listdir(tmp_path / "cache") == []  # the damaged download is dropped
    moved = move_aside(step)
    assert fs.parent(moved) == fs.join(root, ".damaged") and fs.basename(moved).startswith("step-4-")
    assert not fs.exists(step) and fs.exists(fs.join(moved, MARKER))
    assert fs.read_bytes(fs.join(moved, "state", "a")) == b"a" * 10
    fs.rmtree(root)


def _local_file(tmp_path: Path, data: bytes) -> str:
    import uuid

    path = tmp_path / f"src-{uuid.uuid4().hex[:8]}"
    path.write_bytes(data)
    return str(path)
