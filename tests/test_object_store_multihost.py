"""Checkpoints of a multi-host run on an object store, without any shared filesystem.

Two processes of one jax.distributed run (gloo CPU collectives) stand in for two hosts: each has
its own host name and its own checkpoint staging/cache directory ($LM_PIPELINE_CHECKPOINT_CACHE),
and they share nothing but the coordinator and the bucket (moto's S3 server on loopback,
tests/helpers/s3.py). The script is tests/scripts/s3_multihost_process.py: a toy sharded state
trained 6 steps, checkpointed at steps 3 and 6, resumed from the latest complete checkpoint.
The references are independent of the checkpoint code: the final state the uninterrupted
two-process run holds in memory, and the objects as boto3 lists and reads them.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.s3 import REGION, s3_bucket, s3_server  # noqa: F401  (pytest fixtures)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "s3_multihost_process.py"


def _objects(bucket, prefix: str) -> dict[str, bytes]:
    """The bucket's objects under ``prefix`` and their bytes, read with boto3."""
    import boto3

    client = boto3.client("s3", endpoint_url=bucket.server.endpoint, region_name=REGION)
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket.name, Prefix=prefix):
        for item in page.get("Contents", []):
            out[item["Key"]] = client.get_object(Bucket=bucket.name, Key=item["Key"])["Body"].read()
    return out


def _start(url: str, tmp_path: Path, tag: str, env1: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Two processes, 'host-0' and 'host-1', each with its own checkpoint cache/staging dir."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i in range(2):
        env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
               "LM_PIPELINE_CHECKPOINT_CACHE": str(tmp_path / f"{tag}-host-{i}")}
        if i == 1:
            env.update(env1 or {})
        procs.append(subprocess.Popen(
            [sys.executable, str(SCRIPT), str(i), "2", f"127.0.0.1:{port}", url, f"host-{i}",
             str(tmp_path / f"{tag}-final.npz")],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def _finish(procs: list[subprocess.Popen]) -> list[str]:
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[-2500:] for o in outs]
    return outs


def _final(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.slow
def test_two_hosts_checkpoint_on_the_bucket_without_a_shared_directory(s3_bucket, tmp_path, monkeypatch):  # noqa: F811
    import jax

    from lm_pipeline.train.checkpoint import latest_checkpoint, load, read_metadata, verify

    # An uninterrupted run: both checkpoints complete, each with both processes' parts.
    url = s3_bucket.url("runs", "a")
    outs = _finish(_start(url, tmp_path, "a"))
    assert all("finished" in o and "resumed_from" not in o for o in outs)
    reference = _final(tmp_path / "a-final.npz")
    objects = _objects(s3_bucket, "runs/a/")
    for step in (3, 6):
        marker = json.loads(objects[f"runs/a/step-{step}/checkpoint.json"])
        files = marker["files"]
        # Process 1's shards of the sharded arrays and its array metadata (only it wrote them)...
        assert {"state/w/c/1/0", "state/v/c/0/1", "state/array_metadatas/process_1"} <= set(files), sorted(files)
        assert {"state/w/c/0/0", "state/v/c/0/0", "state/array_metadatas/process_0", "state/_METADATA"} <= set(files)
        # ... and the record is what the bucket holds: every object but the marker, sizes and hashes.
        stored = {k.removeprefix(f"runs/a/step-{step}/"): v for k, v in objects.items()
                  if k.startswith(f"runs/a/step-{step}/") and not k.endswith("/checkpoint.json")}
        assert set(stored) == set(files)
        assert all(files[k] == {"size": len(v), "sha256": hashlib.sha256(v).hexdigest()} for k, v in stored.items())
        assert marker["num_processes"] == 2 and marker["state"]["format"] == "orbax-pytree-zarr3"
    # No host saw the other's staging dir: each process's cache holds only its own.
    for i in range(2):
        staged = [p for p in (tmp_path / f"a-host-{i}").rglob("*") if p.name.endswith(f"-p{1 - i}")]
        assert not staged, staged

    # A fresh one-process restore (its own empty cache) gives the run's final state bit for bit.
    monkeypatch.setenv("LM_PIPELINE_CHECKPOINT_CACHE", str(tmp_path / "fresh-cache"))
    path = latest_checkpoint(url)
    assert path == f"{url}/step-6" and verify(path, read_metadata(path)) == []
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    got = load(path, {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=dev) for k, v in reference.items()})
    diffs = {k: float(np.max(np.abs(np.asarray(got[k]) - reference[k]))) for k in reference}
    print("restore vs the two-process run's final state, max |diff|:", diffs)
    assert all(np.array_equal(np.asarray(got[k]), reference[k]) for k in reference), diffs

    # Process 1 killed half-way through uploading step-6: process 0 (alive, its own part
    # uploaded) never writes step-6's marker.
    url_b = s3_bucket.url("runs", "b")
    procs = _start(url_b, tmp_path, "b", env1={"LM_PIPELINE_FAULTPOINT": "checkpoint.upload_partial:2",
                                              "LM_PIPELINE_FAULTPOINT_TRACE": str(tmp_path / "trace-1")})
    try:
        procs[1].wait(timeout=240)
        assert procs[1].returncode == -signal.SIGKILL, procs[1].communicate()[0][-2500:]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and procs[0].poll() is None:
            assert "runs/b/step-6/checkpoint.json" not in _objects(s3_bucket, "runs/b/step-6/")
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert (tmp_path / "trace-1").read_text().split().count("checkpoint.upload_partial") == 2
    keys = set(_objects(s3_bucket, "runs/b/"))
    assert "runs/b/step-3/checkpoint.json" in keys and "runs/b/step-6/checkpoint.json" not in keys
    assert "runs/b/step-6/state/w/c/0/0" in keys, sorted(keys)  # process 0's part is there
    # Process 1 uploads array_metadatas/process_1, v/c/0/1, w/c/1/0 in that order: killed after two.
    assert "runs/b/step-6/state/v/c/0/1" in keys and "runs/b/step-6/state/w/c/1/0" not in keys, sorted(keys)
    assert latest_checkpoint(url_b) == f"{url_b}/step-3"

    # Resuming (two fresh hosts, empty caches) continues from step-3 to the uninterrupted state.
    outs = _finish(_start(url_b, tmp_path, "b2"))
    assert all(f"resumed_from {url_b}/step-3" in o for o in outs), [o[-1500:] for o in outs]
    resumed = _final(tmp_path / "b2-final.npz")
    diffs = {k: float(np.max(np.abs(resumed[k] - reference[k]))) for k in reference}
    print("resumed vs uninterrupted final state, max |diff|:", diffs)
    assert all(np.array_equal(resumed[k], reference[k]) for k in reference), diffs
    assert latest_checkpoint(url_b) == f"{url_b}/step-6"


def test_a_process_other_than_0_uploads_only_its_own_parts(tmp_path):
    """Process 1's staging dir holds its chunks and array metadata (its part) and its own copies
    of the checkpoint's metadata (process 0's are the ones kept); a file of another kind is an
    error, never silently left out of the upload."""
    from lm_pipeline.train.checkpoint.remote import upload_state

    staged = tmp_path / "staging" / "state"
    files = {"_METADATA": b"m", "_CHECKPOINT_METADATA": b"c", "_sharding": b"s", "commit_success.txt": b"ok",
             "w/zarr.json": b"{}", "w/c/1/0": b"chunk-w", "v/c/0/1": b"chunk-v",
             "array_metadatas/process_1": b"am1"}
    for rel, data in files.items():
        (staged / rel).parent.mkdir(parents=True, exist_ok=True)
        (staged / rel).write_bytes(data)
    got = upload_state(str(tmp_path / "staging"), "state", str(tmp_path / "store" / "state"), process_index=1)
    mine = {"w/c/1/0", "v/c/0/1", "array_metadatas/process_1"}
    assert got == {f"state/{rel}": {"size": len(files[rel]), "sha256": hashlib.sha256(files[rel]).hexdigest()}
                   for rel in mine}
    assert {p.relative_to(tmp_path / "store" / "state").as_posix()
            for p in (tmp_path / "store").rglob("*") if p.is_file()} == mine
    # Process 0 uploads everything it wrote.
    got0 = upload_state(str(tmp_path / "staging"), "state", str(tmp_path / "store0" / "state"), process_index=0)
    assert set(got0) == {f"state/{rel}" for rel in files}

    (staged / "ocdbt.process_1").mkdir()
    (staged / "ocdbt.process_1" / "manifest.ocdbt").write_bytes(b"x")
    with pytest.raises(RuntimeError, match="process 1 wrote ocdbt.process_1/manifest.ocdbt"):
        upload_state(str(tmp_path / "staging"), "state", str(tmp_path / "store1" / "state"), process_index=1)
