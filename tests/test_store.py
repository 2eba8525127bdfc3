"""The content-addressed artifact store: addresses, manifests written last, locks for concurrent writers."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lm_pipeline.store import MANIFEST, ArtifactStore


def test_address_layout_and_validation(tmp_path):
    store = ArtifactStore(str(tmp_path) + "/")
    art = store.artifact("tokenizer", "abc123")
    assert art.path == f"{tmp_path}/tokenizer/abc123"
    assert art.manifest_path == f"{tmp_path}/tokenizer/abc123/{MANIFEST}"
    for bad in ("", "a/b", ".", ".."):
        with pytest.raises(ValueError):
            store.artifact("tokenizer", bad)
        with pytest.raises(ValueError):
            store.artifact(bad, "abc")


def test_manifest_marks_completion(tmp_path):
    store = ArtifactStore(str(tmp_path))
    art = store.artifact("raw_shards", "f00d")
    os.makedirs(art.path)
    (tmp_path / "raw_shards" / "f00d" / "data.bin").write_bytes(b"partial output")
    assert store.manifest("raw_shards", "f00d") is None  # output without a manifest is not done
    assert not store.is_complete("raw_shards", "f00d")
    assert store.complete("raw_shards") == []
    m = store.commit(art, {"summary": {"n": 1}})
    assert m["stage"] == "raw_shards" and m["fingerprint"] == "f00d" and m["created"]
    assert store.manifest("raw_shards", "f00d") == m
    assert [x["fingerprint"] for x in store.complete("raw_shards")] == ["f00d"]
    # no temporary files are left beside the manifest
    assert sorted(os.listdir(art.path)) == ["data.bin", MANIFEST]


def test_commit_drops_temporary_files_of_an_interrupted_earlier_writer(tmp_path):
    # A writer killed between writing a temporary file and renaming it leaves ".name.tmp-<hex>"
    # in the payload; the re-run that completes the address must not publish it.
    from lm_pipeline.atomic import temp_sibling

    store = ArtifactStore(str(tmp_path))
    art = store.artifact("eval_report", "beef")
    sub = os.path.join(art.path, "part")
    os.makedirs(sub)
    for d in (art.path, sub):
        with open(os.path.join(d, "keep.json"), "w") as f:
            f.write("{}")
    stale_file = temp_sibling(os.path.join(art.path, "eval_report.json"))
    stale_dir = temp_sibling(os.path.join(sub, "shard"))
    open(stale_file, "w").close()
    os.makedirs(stale_dir)
    # names that only look alike are the payload's own and stay
    lookalikes = [os.path.join(art.path, n) for n in (".hidden.tmp-notahex", "x.tmp-0123456789ab")]
    for p in lookalikes:
        open(p, "w").close()
    store.commit(art, {})
    left = sorted(os.path.relpath(os.path.join(r, n), art.path) for r, ds, fs in os.walk(art.path) for n in ds + fs)
    assert left == sorted([".hidden.tmp-notahex", "keep.json", MANIFEST, "part", "part/keep.json", "x.tmp-0123456789ab"])


def test_complete_lists_oldest_first_and_skips_hidden_and_partial(tmp_path):
    store = ArtifactStore(str(tmp_path))
    for fp in ("b", "a"):
        store.commit(store.artifact("s", fp), {})
        time.sleep(0.01)
    os.makedirs(tmp_path / "s" / "c")  # partial
    os.makedirs(tmp_path / "s" / ".parts-x")  # fan-out scratch space
    with store.lock(store.artifact("s", "d")):  # leaves a lock file .d.lock in the stage dir
        pass
    assert [m["fingerprint"] for m in store.complete("s")] == ["b", "a"]


def test_memory_root_roundtrip():
    store = ArtifactStore("memory://lmp-store-test")
    art = store.artifact("eval_report", "1234")
    assert store.manifest("eval_report", "1234") is None
    with store.lock(art):  # a no-op on object stores (the manifest PUT is atomic)
        store.commit(art, {"summary": {"ok": True}})
    assert store.manifest("eval_report", "1234")["summary"] == {"ok": True}


_WRITER = textwrap.dedent("""
    import json, sys, time
    from lm_pipeline.store import ArtifactStore
    root, tag, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
    store = ArtifactStore(root)
    art = store.artifact("tokenizer", "same")
    built = False
    if store.manifest("tokenizer", "same") is None:
        with store.lock(art):
            if store.manifest("tokenizer", "same") is None:
                import os
                os.makedirs(art.path, exist_ok=True)
                with open(art.path + "/payload.txt", "a") as f:
                    for i in range(5):
                        f.write(f"{tag} {i}\\n"); f.flush(); time.sleep(delay / 5)
                store.commit(art, {"writer": tag})
                built = True
    print(json.dumps({"tag": tag, "built": built}))
""")


def test_two_concurrent_writers_leave_one_intact_artifact(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), tag, "1.0"], stdout=subprocess.PIPE,
                              text=True) for tag in ("A", "B")]
    outs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(o["built"] for o in outs) == [False, True]  # one built, the other waited and hit
    winner = next(o["tag"] for o in outs if o["built"])
    store = ArtifactStore(str(tmp_path))
    assert store.manifest("tokenizer", "same")["writer"] == winner
    lines = (tmp_path / "tokenizer" / "same" / "payload.txt").read_text().splitlines()
    assert lines == [f"{winner} {i}" for i in range(5)]  # never interleaved


def _hold_lock(root: str, ready) -> None:
    store = ArtifactStore(root)
    with store.lock(store.artifact("train_ckpt", "held")):
        ready.set()
        time.sleep(600)


def test_lock_of_a_killed_writer_is_released(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_hold_lock, args=(str(tmp_path), ready))
    p.start()
    try:
        assert ready.wait(60)
        store = ArtifactStore(str(tmp_path))
        art = store.artifact("train_ckpt", "held")
        with pytest.raises(TimeoutError):
            with store.lock(art, timeout=0.3):
                pass
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        t0 = time.monotonic()
        with store.lock(art, timeout=10):  # the kernel dropped the dead process's flock
            pass
        assert time.monotonic() - t0 < 5
    finally:
        if p.is_alive():
            p.kill()


def test_a_foreign_or_corrupt_manifest_is_not_completion(tmp_path, caplog):
    """A manifest.json copied in with a payload (e.g. a tokenizer dir inside an export) or a torn
    one never makes a partial artifact look complete."""
    store = ArtifactStore(str(tmp_path))
    other = store.commit(store.artifact("tokenizer", "aaaa"), {"summary": {}})
    art = store.artifact("hf_export", "bbbb")
    os.makedirs(art.path)
    with open(art.manifest_path, "w") as f:
        json.dump(other, f)
    with caplog.at_level("WARNING", logger="lm_pipeline.store"):
        assert store.manifest("hf_export", "bbbb") is None
    assert "manifest of ('tokenizer', 'aaaa')" in caplog.text
    with open(art.manifest_path, "w") as f:
        f.write('{"stage": "hf_ex')
    assert store.manifest("hf_export", "bbbb") is None
    store.commit(art, {})
    assert store.is_complete("hf_export", "bbbb")
    assert not [n for n in os.listdir(art.path) if n.startswith(".")]  # no temporary files left


def test_storage_errors_name_the_problem_and_the_place():
    import errno

    from lm_pipeline.store import storage_error

    full = OSError(errno.ENOSPC, "No space left on device", "/s/x/ledger.json")
    err = storage_error(full, "token_cache ab12", "/s/token_cache/ab12")
    assert "no space left on device at /s/token_cache/ab12 (writing /s/x/ledger.json)" in str(err)
    try:  # as TensorStore/Orbax report it: text only, wrapped by the checkpointer's thread
        try:
            raise ValueError("Error writing local file \"/s/c/0\": [OS error 30: Read-only file system]")
        except ValueError as inner:
            raise RuntimeError("checkpoint save of step 2 failed") from inner
    except RuntimeError as outer:
        assert "read-only file system at /r" in str(storage_error(outer, "train_ckpt ff", "/r"))
    assert storage_error(ValueError("shape mismatch"), "x", "/r") is None
