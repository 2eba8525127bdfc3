"""The Dagster metadata of a run whose store is a bucket: its plots and its size are read through
the object store (loopback S3 server), as on a local store."""

from __future__ import annotations

import base64
import json

import fsspec
import numpy as np
from helpers.s3 import s3_bucket, s3_server  # noqa: F401, F811  (pytest fixtures)


def _records(n: int) -> list[dict]:
    return [{"step": s, "train/loss": float(5.0 - 0.1 * s), "optim/learning_rate": 1e-3, "time": 100.0 + s,
             "train_tokens": 512 * s} for s in range(1, n + 1)]


def _decode_png(md_value) -> bytes:
    text = md_value.value
    assert text.startswith("![loss curve](data:image/png;base64,")
    return base64.b64decode(text.split("base64,", 1)[1].rstrip(")"))


def _size(path: str):
    from lm_pipeline.steps.display import common
    from lm_pipeline.steps.result import StageResult

    return common(StageResult("train_ckpt", "abc", path, True, {}, 0.0)).get("size_bytes")


def test_training_plots_and_size_of_a_run_on_a_bucket(s3_bucket, tmp_path):  # noqa: F811
    from assets.metadata import to_dagster
    from lm_pipeline.steps.shown import training_plots

    run = s3_bucket.url("store", "train_ckpt", "abc")
    local_run = tmp_path / "run"
    local_run.mkdir()
    body = "".join(json.dumps(r) + "\n" for r in _records(8))
    (local_run / "metrics.jsonl").write_text(body)
    s3 = fsspec.filesystem("s3")
    s3.pipe(f"{run}/metrics.jsonl", body.encode())

    on_bucket = {k: to_dagster(v) for k, v in training_plots(run).items()}
    on_disk = training_plots(str(local_run))
    assert set(on_bucket) == set(on_disk) and "loss_curve" in on_bucket
    png = _decode_png(on_bucket["loss_curve"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert s3.cat(f"{run}/plots/loss.png") == png  # written beside the run, on the bucket
    assert on_bucket["loss_curve_path"].value == f"{run}/plots/loss.png"

    sizes = {p: len(s3.cat(p)) for p in s3.find(run)}
    assert _size(run) == sum(sizes.values()) > len(body)
    assert _size(s3_bucket.url("missing")) in (0, None)
    assert np.isclose(_size(str(local_run)), sum(p.stat().st_size for p in local_run.rglob("*") if p.is_file()))
