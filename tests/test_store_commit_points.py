"""Commit points of the store, atomic writes and checkpoints, checked against what they promise.

A half-written artifact is never a cache hit; a failed atomic write (file or directory) leaves
the old content; a checkpoint's marker records, and resuming verifies, every file of the step
dir; discovery breaks step ties by completion time; pruning never removes checkpoints newer than
the one just saved; a pointer to an incomplete artifact elsewhere is not followed.
"""

from __future__ import annotations

import hashlib
import os

import jax.numpy as jnp
import pytest

from lm_pipeline import faultpoints
from lm_pipeline.atomic import atomic_open, atomic_write_bytes, atomic_write_text, replace_dir
from lm_pipeline.faultpoints import FaultInjected
from lm_pipeline.steps.artifact import build, cached
from lm_pipeline.steps.result import Address
from lm_pipeline.store import ArtifactStore

# ------------------------------------------------------------------------------------ the store


def test_a_half_written_artifact_is_no_cache_hit_and_is_rebuilt(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    addr = Address("s", "f00d", {"k": 1}, {}, 1)
    calls = []

    def crashing(path):
        calls.append("crashing")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "part-0.bin"), "wb") as f:
            f.write(b"half of the payload")
        raise RuntimeError("writer died mid-write")

    def writer(path):
        calls.append("writer")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "part-0.bin"), "wb") as f:
            f.write(b"the whole payload")
        return {"n": 1}, {}

    with pytest.raises(RuntimeError, match="mid-write"):
        build(store, addr, crashing)
    assert os.path.exists(os.path.join(store.artifact("s", "f00d").path, "part-0.bin"))
    assert not os.path.exists(store.artifact("s", "f00d").manifest_path)
    assert not store.is_complete("s", "f00d")
    assert cached(store, addr) is None

    res = build(store, addr, writer)  # the partial directory is built again, not served
    assert not res.hit and calls == ["crashing", "writer"]
    assert res.manifest["summary"] == {"n": 1}
    again = build(store, addr, writer)
    assert again.hit and calls == ["crashing", "writer"]
    with open(os.path.join(again.path, "part-0.bin"), "rb") as f:
        assert f.read() == b"the whole payload"


def test_locate_never_follows_a_pointer_to_an_incomplete_artifact(tmp_path):
    root, elsewhere = str(tmp_path / "store"), str(tmp_path / "cache")
    kept_elsewhere = ArtifactStore(root, {"token_cache": elsewhere})
    art = kept_elsewhere.artifact("token_cache", "beef")
    os.makedirs(art.path)
    kept_elsewhere.commit(art, {})  # leaves a pointer at <root>/token_cache/beef/location.json
    plain = ArtifactStore(root)  # a reader that knows only the root
    home = plain.artifact("token_cache", "beef").path
    assert plain.locate("token_cache", "beef").path == art.path
    assert plain.is_complete("token_cache", "beef")

    os.unlink(art.manifest_path)  # the artifact elsewhere is no longer complete
    assert plain.locate("token_cache", "beef").path == home
    assert not plain.is_complete("token_cache", "beef")


# ------------------------------------------------------------------------------------ atomic writes


@pytest.fixture
def armed(monkeypatch):
    """Arm fault points (action raise) for this process; counts reset before and after."""
    def arm(spec: str) -> None:
        faultpoints.reset()
        monkeypatch.setenv(faultpoints.ENV, spec)
    yield arm
    monkeypatch.delenv(faultpoints.ENV, raising=False)
    faultpoints.reset()


def _siblings(path) -> list[str]:
    return sorted(os.listdir(os.path.dirname(path)))


def test_an_interrupted_atomic_write_keeps_the_old_content(tmp_path, armed):
    target = str(tmp_path / "d" / "manifest.json")
    atomic_write_text(target, "old")
    armed("test.atomic_mid:1:raise")
    with pytest.raises(FaultInjected):  # the new bytes are written, the target not yet replaced
        atomic_write_bytes(target, b"new content", fault="test.atomic_mid")
    with open(target) as f:
        assert f.read() == "old"
    assert _siblings(target) == ["manifest.json"]  # no temporary file left either

    with pytest.raises(RuntimeError), atomic_open(target, "w") as f:
        f.write("partial")
        raise RuntimeError("writer died")
    with open(target) as f:
        assert f.read() == "old"
    atomic_write_bytes(target, b"new")
    with open(target, "rb") as f:
        assert f.read() == b"new"
    assert _siblings(target) == ["manifest.json"]


def test_a_failed_directory_replacement_keeps_the_old_directory(tmp_path):
    target = tmp_path / "best"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), replace_dir(str(target)) as staging:
        with open(os.path.join(staging, "new.txt"), "w") as f:
            f.write("new")
        raise RuntimeError("copy failed")
    assert sorted(os.listdir(target)) == ["old.txt"] and (target / "old.txt").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["best"]

    with replace_dir(str(target)) as staging:
        with open(os.path.join(staging, "new.txt"), "w") as f:
            f.write("new")
    assert sorted(os.listdir(target)) == ["new.txt"]
    assert sorted(os.listdir(tmp_path)) == ["best"]


# ------------------------------------------------------------------------------------ checkpoints


def test_the_marker_records_and_verify_checks_every_file_of_a_checkpoint(tmp_path):
    from lm_pipeline.schema import from_dict
    from lm_pipeline.train.checkpoint import Checkpointer, CheckpointerConfig
    from lm_pipeline.train.checkpoint.integrity import verify
    from lm_pipeline.train.checkpoint.marker import MARKER, read_marker

    cfg = from_dict(CheckpointerConfig, {"base_path": str(tmp_path / "ckpt")})
    ck = Checkpointer(cfg, async_save=False)
    step = ck.save(3, {"w": jnp.arange(6, dtype=jnp.float32)},
                   extra_files={"config.yaml": "model: tiny\n", "tokenizer/vocab.txt": "a\nb\n"})
    ck.close()
    on_disk = {}
    for parent, _dirs, files in os.walk(step):
        for name in files:
            full = os.path.join(parent, name)
            rel = os.path.relpath(full, step).replace(os.sep, "/")
            if rel != MARKER:
                with open(full, "rb") as f:
                    on_disk[rel] = {"size": os.path.getsize(full), "sha256": hashlib.sha256(f.read()).hexdigest()}
    marker = read_marker(step)
    assert {"config.yaml", "tokenizer/vocab.txt"} <= set(on_disk)
    assert any(rel.startswith("state/") for rel in on_disk)
    assert marker["files"] == on_disk
    assert verify(step, marker) == []

    for rel in ("config.yaml", "tokenizer/vocab.txt"):  # altered, same size: only the hash tells
        full = os.path.join(step, *rel.split("/"))
        with open(full, "rb") as f:
            data = f.read()
        with open(full, "wb") as f:
            f.write(bytes([data[0] ^ 0xFF]) + data[1:])
        problems = verify(step, marker)
        assert any(rel in p for p in problems), problems
        with open(full, "wb") as f:
            f.write(data)
    assert verify(step, marker) == []


def _complete_step(base, sub: str, step: int, unix_time: float, kind: str = "temporary") -> str:
    from lm_pipeline.train.checkpoint.marker import step_dir_name, write_marker

    path = os.path.join(base, sub, step_dir_name(step))
    os.makedirs(os.path.join(path, "state"))
    with open(os.path.join(path, "state", "x"), "w") as f:
        f.write(f"{sub} {step}")
    write_marker(path, {"step": step, "kind": kind, "unix_time": unix_time})
    return path


@pytest.mark.parametrize("newer", ["a", "b"])
def test_a_step_found_twice_resolves_to_the_most_recently_completed(tmp_path, newer):
    from lm_pipeline.train.checkpoint import latest_checkpoint

    root = str(tmp_path / "runs")
    times = {"a": 100.0, "b": 200.0} if newer == "b" else {"a": 200.0, "b": 100.0}
    paths = {sub: _complete_step(root, sub, 5, t) for sub, t in times.items()}
    _complete_step(root, "c", 4, 999.0)  # a lower step, completed later
    os.makedirs(os.path.join(root, "d", "step-6", "state"))  # a higher step without its marker
    assert latest_checkpoint(root) == paths[newer]


def test_pruning_removes_only_what_is_older_than_the_new_checkpoint(tmp_path):
    from lm_pipeline.train.checkpoint.marker import read_marker
    from lm_pipeline.train.checkpoint.retention import prune

    base = str(tmp_path / "ckpt")
    _complete_step(base, "", 2, 1.0, "temporary")
    os.makedirs(os.path.join(base, "step-3", "state"))  # incomplete, older
    _complete_step(base, "", 4, 2.0, "permanent")
    new = _complete_step(base, "", 5, 3.0, "permanent")
    _complete_step(base, "", 7, 4.0, "temporary")  # newer than the new one (e.g. a run resumed earlier)
    os.makedirs(os.path.join(base, "step-8", "state"))  # incomplete, newer: maybe still being written
    prune(base, 5, new, None)
    assert sorted(os.listdir(base)) == ["step-4", "step-5", "step-7", "step-8"]
    assert read_marker(os.path.join(base, "step-7"))["kind"] == "temporary"
    assert read_marker(new)["step"] == 5

