"""Disk and storage faults on real filesystems: a size-limited tmpfs that fills up, and a tmpfs
remounted read-only (tests run as root, so a chmod'ed folder would not be read-only).

The full disk is hit where the writes really happen: TensorStore's zarr driver (token cache
arrays), Orbax's OCDBT writer (checkpoint arrays) and the store's manifest write. Each case
must fail with a message that names the problem and the place, leave every earlier complete
artifact byte-identical and readable, never mark the failed artifact complete, and succeed once
space is back.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import Experiment, artifact_dir, copy_store, files, run_stage

from lm_pipeline.config import load_config
from lm_pipeline.steps import Pipeline

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` (skips the test where mounting is not allowed)."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"not run: cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}); needs root or CAP_SYS_ADMIN")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path, leave: int) -> Path:
    """A ballast file that leaves about ``leave`` bytes free on ``path``'s filesystem."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    ballast = path / f"ballast-{uuid.uuid4().hex[:6]}"
    with open(ballast, "wb") as f:
        with contextlib.suppress(OSError):
            f.write(b"\0" * max(free - leave, 0))
    return ballast


def snapshot(store: Path, stages: tuple[str, ...]) -> dict[str, dict[str, bytes]]:
    return {s: files(artifact_dir(store, s)) for s in stages}


def _pipe(exp: Experiment, store: Path) -> Pipeline:
    return Pipeline(load_config(exp.config, ["--store.root", str(store)]), progress=False)


def _clear_error(out: str, *needles: str) -> str:
    """The run's error line (``error: ...``), which must name the problem and the place."""
    lines = [ln for ln in out.strip().splitlines() if ln.startswith("error:")]
    assert lines, f"no error line:\n{out[-2500:]}"
    last = lines[-1]
    for needle in needles:
        assert needle.lower() in last.lower(), f"unclear error (wanted {needle!r}):\n{out[-2500:]}"
    return last


UPSTREAM = {"token_cache": ("raw_shards", "tokenizer"), "train_ckpt": ("raw_shards", "tokenizer", "token_cache"),
            "tokenizer": ("raw_shards",)}


@pytest.mark.reliability("disk full (size-limited tmpfs)")
@pytest.mark.parametrize("stage,leave", [("token_cache", 40_000), ("train_ckpt", 60_000)],
                         ids=["token_cache-tensorstore", "train_ckpt-orbax"])
def test_disk_full_fails_clearly_and_keeps_good_artifacts(experiment, tmp_path, note, stage, leave):
    with tmpfs(tmp_path / "mnt", "8m") as mnt:
        store = copy_store(experiment.reference, mnt / "store",
                           drop=tuple(s for s in ("token_cache", "train_ckpt", "eval_report", "hf_export")
                                      if s not in UPSTREAM[stage]))
        before = snapshot(store, UPSTREAM[stage])
        ballast = fill(mnt, leave)
        res = run_stage(experiment, store, stage)
        assert res.returncode not in (0, -9), res.output[-2000:]
        last = _clear_error(res.output, "no space left on device", str(store))
        assert snapshot(store, UPSTREAM[stage]) == before  # earlier artifacts untouched ...
        pipe = _pipe(experiment, store)
        assert all(pipe.cached(s) is not None for s in UPSTREAM[stage])  # ... and still complete
        assert pipe.cached(stage) is None
        if stage == "train_ckpt":
            from lm_pipeline.train.checkpoint import latest_checkpoint

            run = artifact_dir(store, stage)
            assert run is None or latest_checkpoint(str(run)) is None or "step-" in latest_checkpoint(str(run))
        ballast.unlink()
        again = run_stage(experiment, store, stage)
        assert again.returncode == 0, again.output[-2000:]
        assert pipe.cached(stage) is not None
    last = last.replace(str(store), "<store>")
    note(f"{stage} on a full tmpfs: exit {res.returncode}, message: {last[:200]!r}; earlier artifacts "
         "byte-identical; after freeing space the same command completed")


@pytest.mark.reliability("disk full (size-limited tmpfs)")
def test_disk_full_inside_the_manifest_write(experiment, tmp_path, note):
    """The payload fits, the manifest does not: the artifact must stay incomplete."""
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        store = copy_store(experiment.reference, mnt / "store",
                           drop=("tokenizer", "token_cache", "train_ckpt", "eval_report", "hf_export"))
        before = snapshot(store, ("raw_shards",))
        trace = store.parent / "trace.txt"
        filled: list[Path] = []

        def at_manifest() -> bool:  # the child sleeps at tokenizer.before_manifest: fill the disk now
            if not filled and trace.exists() and "tokenizer.before_manifest" in trace.read_text():
                filled.append(fill(mnt, 0))
            return False

        res = run_stage(experiment, store, "tokenizer", fault="tokenizer.before_manifest:1:sleep=3",
                        kill_when=at_manifest, trace=trace)
        assert filled, "the child never reached tokenizer.before_manifest"
        assert res.returncode not in (0, -9), res.output[-2000:]
        last = _clear_error(res.output, "no space left on device", "manifest.json")
        art = artifact_dir(store, "tokenizer")
        assert art is not None and (art / "tokenizer.json").exists() and not (art / "manifest.json").exists()
        assert not list(art.glob(".manifest.json.tmp-*")), "a temporary manifest was left behind"
        assert _pipe(experiment, store).cached("tokenizer") is None
        assert snapshot(store, ("raw_shards",)) == before
        filled[0].unlink()
        assert run_stage(experiment, store, "tokenizer").returncode == 0
        assert files(artifact_dir(store, "tokenizer"), skip=("manifest.json",)) == files(
            artifact_dir(experiment.reference, "tokenizer"), skip=("manifest.json",))
    last = last.replace(str(store), "<store>")
    note(f"tokenizer payload written, disk filled before the manifest: exit {res.returncode}, "
         f"message: {last[:200]!r}; no manifest, no temp file; re-run byte-identical")


@pytest.mark.reliability("read-only store (tmpfs remounted ro)")
@pytest.mark.parametrize("stage", ["token_cache", "train_ckpt"])
def test_read_only_store_fails_clearly_and_serves_hits(experiment, tmp_path, note, stage):
    with tmpfs(tmp_path / "mnt", "16m") as mnt:
        store = copy_store(experiment.reference, mnt / "store",
                           drop=tuple(s for s in ("token_cache", "train_ckpt", "eval_report", "hf_export")
                                      if s not in UPSTREAM[stage]))
        before = snapshot(store, UPSTREAM[stage])
        r = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"not run: cannot remount the tmpfs read-only ({r.stderr.strip()})")
        with pytest.raises(OSError):  # really read-only, for root too
            (mnt / "probe").write_text("x")
        hit = run_stage(experiment, store, UPSTREAM[stage][-1])  # a complete artifact is still served
        assert hit.returncode == 0 and '"hit": true' in hit.output, hit.output[-2000:]
        res = run_stage(experiment, store, stage)
        assert res.returncode not in (0, -9), res.output[-2000:]
        last = _clear_error(res.output, "read-only file system", str(store))
        assert snapshot(store, UPSTREAM[stage]) == before
        subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
        again = run_stage(experiment, store, stage)
        assert again.returncode == 0, again.output[-2000:]
    last = last.replace(str(store), "<store>")
    note(f"{stage} on a read-only store: exit {res.returncode}, message: {last[:200]!r}; the upstream "
         "cache hit was still served; after remounting rw the same command completed")
