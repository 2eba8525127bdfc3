"""Trackers: JSONL log and its resume truncation, TensorBoard event files, wandb offline, logging, redaction."""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import struct
import time

import numpy as np
import pytest

from lm_pipeline.schema import ConfigError, from_dict
from lm_pipeline.train.trackers import (
    JsonlTrackerConfig,
    NoopTrackerConfig,
    TensorboardConfig,
    TrackerConfig,
    WandbConfig,
    build_tracker,
    read_metrics,
    redact,
    setup_logging,
    wandb_run_id,
)

FAKE_TOKEN = "hf_FAKEtoken0123456789abcdef"


def run_steps(run_dir, steps, *, resume_step=None, configs=(), run_id="run-1"):
    tracker = build_tracker(configs, run_id=run_id, run_dir=str(run_dir), hparams={"lr": 0.1}, resume_step=resume_step)
    for s in steps:
        tracker.log({"train/loss": np.float32(10.0 / (s + 1)), "optim/learning_rate": 0.1}, step=s)
        if s % 3 == 0:
            tracker.log({"eval/validation/loss": 5.0 - s / 10}, step=s)
    return tracker


# --- config -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Holder:
    tracker: tuple[TrackerConfig, ...] = ()


def test_tracker_family_parses_and_is_not_semantic():
    h = from_dict(
        Holder,
        {"tracker": [{"type": "wandb", "project": "p", "tags": ["a"], "resume": "must", "mode": "offline"},
                     {"type": "tensorboard", "logdir": "tb"}, {"type": "jsonl"}, {"type": "noop"}, {"project": "q"}]},
    )
    w, tb, js, noop, default = h.tracker
    assert isinstance(w, WandbConfig) and w.tags == ("a",) and w.resume == "must" and w.mode == "offline"
    assert isinstance(tb, TensorboardConfig) and tb.logdir == "tb"
    assert isinstance(js, JsonlTrackerConfig) and isinstance(noop, NoopTrackerConfig)
    assert isinstance(default, WandbConfig) and default.project == "q" and default.resume == "allow"
    assert from_dict(Holder, {"tracker": [{"type": "wandb", "resume": True}]}).tracker[0].resume is True
    for cls in (WandbConfig, TensorboardConfig, JsonlTrackerConfig, NoopTrackerConfig):
        assert not any(f.metadata["semantic"] for f in dataclasses.fields(cls))
    with pytest.raises(ConfigError) as e:
        from_dict(Holder, {"tracker": [{"type": "wandb", "mode": "online-ish"}]})
    assert e.value.path == "tracker[0].mode"
    with pytest.raises(ConfigError) as e:
        from_dict(Holder, {"tracker": [{"type": "wandb", "id": "a/b"}]})
    assert e.value.path == "tracker[0].id"


def test_wandb_run_id_is_stable_and_valid():
    assert wandb_run_id("train-abc123") == "train-abc123"
    rid = wandb_run_id("train/llama:1b@2024")
    assert rid == wandb_run_id("train/llama:1b@2024") and rid != wandb_run_id("train/llama:1b@2025")
    assert all(c.isalnum() or c in "_.-" for c in rid)
    assert len(wandb_run_id("x" * 200)) <= 64


# --- JSONL ------------------------------------------------------------------------------------


def test_jsonl_log_is_written(tmp_path):
    t = run_steps(tmp_path, range(4))
    t.log_summary({"final/loss": 2.5})
    t.finish()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    assert recs[0] == {"step": 0, "train/loss": 10.0, "optim/learning_rate": 0.1}
    assert recs[1] == {"step": 0, "eval/validation/loss": 5.0}
    assert [r["step"] for r in recs] == [0, 0, 1, 2, 3, 3]
    assert all(isinstance(r["train/loss"], float) for r in recs if "train/loss" in r)
    assert json.loads((tmp_path / "summary.json").read_text()) == {"final/loss": 2.5}
    with pytest.raises(ValueError, match="reserved"):
        build_tracker((), run_id="r", run_dir=str(tmp_path / "x"), hparams={}, resume_step=None).log({"step": 1}, step=1)


def test_resumed_log_equals_an_uninterrupted_one(tmp_path):
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    run_steps(full, range(10)).finish()
    # Crash after step 7 with a torn last line; the last checkpoint is at step 5.
    run_steps(crashed, range(8)).finish()
    with open(crashed / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "train/lo')
    run_steps(crashed, range(5, 10), resume_step=5).finish()
    assert (crashed / "metrics.jsonl").read_text() == (full / "metrics.jsonl").read_text()
    assert [r["step"] for r in read_metrics(str(crashed / "metrics.jsonl"))][-1] == 9


def test_fresh_start_replaces_an_old_log(tmp_path):
    t = run_steps(tmp_path, range(5))
    t.log_summary({"x": 1})
    t.finish()
    run_steps(tmp_path, range(2)).finish()
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [0, 0, 1]
    assert not (tmp_path / "summary.json").exists()


def test_extra_jsonl_tracker(tmp_path):
    extra = tmp_path / "elsewhere" / "m.jsonl"
    run_steps(tmp_path / "run", range(3), configs=(JsonlTrackerConfig(path=str(extra)),)).finish()
    assert extra.read_text() == (tmp_path / "run" / "metrics.jsonl").read_text()


def test_jsonl_log_on_an_object_store(tmp_path):
    import fsspec

    from lm_pipeline.train.trackers import JsonlTracker

    base = "memory://lm-pipeline-tests/run-remote"
    try:
        run_steps(base, range(6)).finish()
        run_steps(base, range(3, 8), resume_step=3).finish()
        run_steps(tmp_path, range(8)).finish()
        assert fsspec.open(f"{base}/metrics.jsonl", "r").open().read() == (tmp_path / "metrics.jsonl").read_text()
        # Lines reach the store while the run goes on, not only at the end.
        t = JsonlTracker(f"{base}/other.jsonl", resume_step=None, upload_interval_s=0.0)
        t.log({"train/loss": 1.0}, step=0)
        assert read_metrics(f"{base}/other.jsonl") == [{"step": 0, "train/loss": 1.0}]
        t.log_summary({"eval/loss": 2.0})
        t.finish()
        assert json.loads(fsspec.open(f"{base}/other.jsonl.summary.json", "r").open().read()) == {"eval/loss": 2.0}
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists("/lm-pipeline-tests"):
            fs.rm("/lm-pipeline-tests", recursive=True)


def test_composite_survives_a_failing_optional_tracker(tmp_path, caplog):
    from lm_pipeline.train.trackers import CompositeTracker, JsonlTracker, Tracker

    class Broken(Tracker):
        def log(self, metrics, step):
            raise ConnectionError("no network")

    jsonl = JsonlTracker(str(tmp_path / "m.jsonl"), resume_step=None)
    t = CompositeTracker([Broken(), jsonl], critical=[False, True])
    t.log({"train/loss": 1.0}, step=0)
    t.log({"train/loss": 0.5}, step=1)
    t.finish()
    assert [r["step"] for r in read_metrics(str(tmp_path / "m.jsonl"))] == [0, 1]
    assert "no network" in caplog.text
    with pytest.raises(ConnectionError):
        CompositeTracker([Broken()], critical=[True]).log({"x": 1.0}, step=0)


# --- TensorBoard ------------------------------------------------------------------------------


def read_event_files(logdir):
    """(tag, step, value) scalars and text tags from tfevents files (TFRecord framing + tensorboardX protos)."""
    from tensorboardX.proto import event_pb2

    scalars, texts = [], {}
    for path in sorted(glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"), recursive=True)):
        data = open(path, "rb").read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            payload = data[pos + 12 : pos + 12 + length]  # skip length + length crc
            pos += 12 + length + 4  # payload + payload crc
            ev = event_pb2.Event()
            ev.ParseFromString(payload)
            for v in ev.summary.value:
                if v.HasField("simple_value"):
                    scalars.append((v.tag, ev.step, v.simple_value))
                elif v.HasField("tensor"):
                    texts[v.tag] = b"".join(v.tensor.string_val).decode()
    return scalars, texts


def test_tensorboard_event_files_hold_the_scalars(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    tb = TensorboardConfig(logdir=str(tmp_path / "tb"))
    tracker = build_tracker(
        (tb,),
        run_id="run-1",
        run_dir=str(tmp_path / "run"),
        hparams={"optimizer": {"learning_rate": 0.1}, "HF_TOKEN": FAKE_TOKEN, "url": f"hf://x?t={FAKE_TOKEN}"},
        resume_step=None,
    )
    for s in range(3):
        tracker.log({"train/loss": 3.0 - s, "throughput/mfu": 0.5}, step=s)
    tracker.log_summary({"eval/loss": 1.25})
    tracker.finish()
    scalars, texts = read_event_files(str(tmp_path / "tb" / "run-1"))
    assert [(t, s, v) for t, s, v in scalars if t == "train/loss"] == [("train/loss", 0, 3.0), ("train/loss", 1, 2.0), ("train/loss", 2, 1.0)]
    assert ("throughput/mfu", 2, 0.5) in scalars and ("summary/eval/loss", 2, 1.25) in scalars
    hp = texts["hparams/text_summary"]
    assert "learning_rate" in hp and FAKE_TOKEN not in hp and "<redacted>" in hp
    for path in glob.glob(str(tmp_path / "**" / "*"), recursive=True):
        if os.path.isfile(path):
            assert FAKE_TOKEN.encode() not in open(path, "rb").read(), path


def test_tensorboard_resume_keeps_earlier_files(tmp_path):
    tb = (TensorboardConfig(),)
    run_steps(tmp_path, range(4), configs=tb).finish()
    run_steps(tmp_path, range(2, 5), configs=tb, resume_step=2).finish()
    logdir = tmp_path / "tensorboard" / "run-1"
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 2
    scalars, _ = read_event_files(str(logdir))
    steps = sorted(s for t, s, _ in scalars if t == "train/loss")
    assert steps == [0, 1, 2, 2, 3, 3, 4]  # TensorBoard hides the first run's steps >= 2 (purge_step)


# --- wandb ------------------------------------------------------------------------------------


def read_wandb_records(run_file):
    """Records of a .wandb transaction log (LevelDB-style log blocks of wandb Record protos)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(run_file, "rb").read()
    pos, block, buf, out = 7, 32768, b"", []  # 7-byte ":W&B" header
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            buf = chunk
        elif kind == 2:
            buf = chunk
            continue
        elif kind == 3:
            buf += chunk
            continue
        elif kind == 4:
            buf += chunk
        else:
            continue
        rec = pb.Record()
        rec.ParseFromString(buf)
        out.append(rec)
    return out


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    wdir = tmp_path / "wandb-dir"
    wdir.mkdir()
    monkeypatch.setenv("WANDB_DIR", str(wdir))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    yield wdir
    wandb.teardown()


def test_wandb_offline_run_writes_its_files(tmp_path, wandb_offline):
    cfg = WandbConfig(project="lm-pipeline-test", mode="offline", tags=("t1",), group="g", save_code=False)
    hparams = {"optimizer": {"learning_rate": 0.1}, "secrets": {"HF_TOKEN": FAKE_TOKEN}, "note": f"tok={FAKE_TOKEN}"}

    def records_for(offline_dir):
        # finish() returns when wandb's service has the records; on a loaded machine the service
        # may still be writing the file then, so read until the run record is there (bounded).
        (run_file,) = glob.glob(os.path.join(offline_dir, "run-*.wandb"))
        for _ in range(600):
            recs = read_wandb_records(run_file)
            kinds = {r.WhichOneof("record_type") for r in recs}
            if {"run", "history"} <= kinds:
                break
            time.sleep(0.1)
        return recs, open(run_file, "rb").read()

    t = build_tracker((cfg,), run_id="run/one", run_dir=str(tmp_path / "run"), hparams=hparams, resume_step=None)
    for s in range(3):
        t.log({"train/loss": 3.0 - s}, step=s)
    t.log_summary({"eval/loss": 0.5})
    t.finish()
    wid = wandb_run_id("run/one")
    (first,) = glob.glob(str(wandb_offline / "wandb" / f"offline-run-*-{wid}"))
    recs, raw = records_for(first)
    run = next(r.run for r in recs if r.WhichOneof("record_type") == "run")
    assert run.run_id == wid and run.project == "lm-pipeline-test" and run.run_group == "g" and list(run.tags) == ["t1"]
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["optimizer"] == {"learning_rate": 0.1} and config["note"] == "tok=<redacted>"
    assert not config.get("secrets")
    history = []
    for r in recs:
        if r.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            history.append((items["_step"], items["train/loss"]))
    assert history == [(0, 3.0), (1, 2.0), (2, 1.0)]
    assert FAKE_TOKEN.encode() not in raw
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0]) == {"step": 0, "train/loss": 3.0}

    # Resuming uses the same wandb run id.
    t = build_tracker((cfg,), run_id="run/one", run_dir=str(tmp_path / "run"), hparams=hparams, resume_step=2)
    t.log({"train/loss": 0.5}, step=3)
    t.finish()
    runs = glob.glob(str(wandb_offline / "wandb" / f"offline-run-*-{wid}"))
    assert len(runs) >= 1 and all(r.endswith(wid) for r in runs)


# --- logging and secrets ----------------------------------------------------------------------


def test_setup_logging_is_idempotent_and_masks_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-0123456789")
    root = logging.getLogger()
    before = list(root.handlers)
    level = root.level
    try:
        path = setup_logging(str(tmp_path / "logs"), "run-1")
        setup_logging(str(tmp_path / "logs"), "run-1")
        ours = [h for h in root.handlers if h not in before]
        assert sum(isinstance(h, logging.FileHandler) for h in ours) == 1
        assert sum(type(h) is logging.StreamHandler for h in ours) <= 1
        logging.getLogger("lm_pipeline.test").info("hello %s key=%s", "world", "wandb-secret-0123456789")
        for h in ours:
            h.flush()
        text = open(path).read()
        assert path == str(tmp_path / "logs" / "run-1.log")
        assert "hello world" in text and "wandb-secret-0123456789" not in text and "<redacted>" in text
        # Another run moves the file handler.
        path2 = setup_logging(str(tmp_path / "logs"), "run-2")
        files = [h for h in root.handlers if isinstance(h, logging.FileHandler) and h not in before]
        assert [h.baseFilename for h in files] == [path2]
    finally:
        for h in list(root.handlers):
            if h not in before:
                root.removeHandler(h)
                h.close()
        root.setLevel(level)


def test_setup_logging_on_an_object_store_uploads_the_log_and_continues_it():
    import uuid

    from lm_pipeline import fs

    root = logging.getLogger()
    before = list(root.handlers)
    level = root.level
    log_dir = f"memory://lmp-logs-{uuid.uuid4().hex[:8]}/logs"

    def close_ours() -> None:
        for h in list(root.handlers):
            if h not in before:
                root.removeHandler(h)
                h.close()

    try:
        for run in (1, 2):  # a resumed run continues the same file
            path = setup_logging(log_dir, "run-1")
            assert os.path.isfile(path) and setup_logging(log_dir, "run-1") == path  # a local file, one handler
            logging.getLogger("lm_pipeline.test").info("line of attempt %d", run)
            close_ours()  # logging.shutdown at exit: the last upload
        text = fs.read_text(f"{log_dir}/run-1.log")
        assert "line of attempt 1" in text and "line of attempt 2" in text
        assert text.index("line of attempt 1") < text.index("line of attempt 2")
    finally:
        close_ours()
        root.setLevel(level)
        fs.rmtree(log_dir)


def test_redact_removes_secret_keys_and_values(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-value-xyz")
    monkeypatch.setenv("AWS_REGION", "us-east-1x")
    hp = {
        "WANDB_API_KEY": "k" * 40,
        "HF_TOKEN": "hf_x",
        "env": {"AWS_ACCESS_KEY_ID": "AKIA...", "GOOGLE_APPLICATION_CREDENTIALS": "/k.json", "PATH": "/bin"},
        "data": {"urls": ["s3://b/x?sig=aws-secret-value-xyz", "s3://b/y"], "region": "us-east-1x"},
        "tokenizer": {"eos_token": "<|endoftext|>", "vocab_size": 10},
        "throughput/tokens_per_second": 5.0,
        "db_password": "pw",
    }
    out = redact(hp)
    assert out == {
        "env": {"PATH": "/bin"},
        "data": {"urls": ["s3://b/x?sig=<redacted>", "s3://b/y"], "region": "us-east-1x"},
        "tokenizer": {"eos_token": "<|endoftext|>", "vocab_size": 10},
        "throughput/tokens_per_second": 5.0,
    }
    assert hp["WANDB_API_KEY"] == "k" * 40  # the input is not modified


def test_flush_uploads_what_was_logged_and_the_checkpointer_calls_it_only_before_a_save(tmp_path):
    """On an object store the metrics log is uploaded when the trainer is about to checkpoint
    (``maybe_save(before_save=tracker.flush)``), not only every ``upload_interval_s``: a run
    resumed from that checkpoint finds every step logged before it."""
    import fsspec
    import jax.numpy as jnp

    from lm_pipeline.schema import from_dict
    from lm_pipeline.train.checkpoint import Checkpointer, CheckpointerConfig
    from lm_pipeline.train.trackers import CompositeTracker, JsonlTracker

    url = "memory://lm-pipeline-tests/flush/metrics.jsonl"
    try:
        tracker = CompositeTracker([JsonlTracker(url, resume_step=None, upload_interval_s=3600.0)])
        ck = Checkpointer(from_dict(CheckpointerConfig, {"base_path": str(tmp_path / "ck"), "save_interval": "1000h",
                                                          "keep": [{"every": 3}]}))
        uploaded_at_save = {}
        for step in range(1, 7):
            tracker.log({"train/loss": 1.0 / step}, step=step)
            flushed = []
            ck.maybe_save(step, {"s": jnp.asarray(step)},
                          before_save=lambda s=step, f=flushed: (tracker.flush(), f.append(s)))
            if flushed:
                uploaded_at_save[step] = [r["step"] for r in read_metrics(url)]
        ck.wait()
        assert uploaded_at_save == {3: [1, 2, 3], 6: [1, 2, 3, 4, 5, 6]}  # only at the saves, all steps before them
        tracker.finish()
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists("/lm-pipeline-tests/flush"):
            fs.rm("/lm-pipeline-tests/flush", recursive=True)
