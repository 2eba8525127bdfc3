"""Object stores for every path: the pipeline on ``s3://`` (moto's S3 server on loopback).

The references are independent of the code under test on the bucket: the same stages on a local
store (fingerprints, token-cache arrays, evaluation numbers), ``transformers`` loading the export,
and what the bucket holds as listed by boto3. Credentials reach the code only through the standard
AWS environment (tests/helpers/s3.py), and the secret key must appear in no object and no log.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import pipeline as pt
from helpers.s3 import REGION, s3_bucket, s3_server  # noqa: F401  (pytest fixtures)

from lm_pipeline import fs
from lm_pipeline.config import load_config
from lm_pipeline.schema import ConfigError
from lm_pipeline.steps import Pipeline

REPO = Path(__file__).resolve().parents[1]


def _objects(bucket) -> dict[str, bytes]:
    """Every object of the bucket and its bytes, read with boto3 (not through the code under test)."""
    import boto3

    client = boto3.client("s3", endpoint_url=bucket.server.endpoint, region_name=REGION)
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket.name):
        for item in page.get("Contents", []):
            out[item["Key"]] = client.get_object(Bucket=bucket.name, Key=item["Key"])["Body"].read()
    return out


def _pipe(tmp: Path, root: str, **sections) -> Pipeline:
    path = pt.write_config(tmp, name=f"cfg-{abs(hash(root)) % 10**8}.yaml", store={"root": root}, **sections)
    return Pipeline(load_config(path), progress=False)


def _no_local_scheme_dirs(*dirs: Path) -> None:
    for d in dirs:
        assert not list(d.rglob("s3:")), f"a local directory named 's3:' was created under {d}"


# --------------------------------------------------------------------------------------------
# URL problems: one line naming the field and the URL, before any compute
# --------------------------------------------------------------------------------------------


def test_url_problems_fail_in_preflight_in_one_line(s3_bucket, tmp_path, monkeypatch):  # noqa: F811 (fixtures)
    monkeypatch.chdir(tmp_path)
    cases = [
        ({"store": {"root": "s3://no-such-bucket-x1/store"}}, "store.root", "s3://no-such-bucket-x1/store",
         "does not exist"),
        ({"store": {"root": "nosuchscheme://b/store"}}, "store.root", "nosuchscheme://b/store", "unknown URL scheme"),
        ({"export": {"hf_save_path": "s3://no-such-bucket-x2/hf", "hf_save_steps": 3}}, "export.hf_save_path",
         "s3://no-such-bucket-x2/hf", "does not exist"),
        ({"trainer": {"checkpointer": {"base_path": "s3://no-such-bucket-x3/runs"}}},
         "trainer.checkpointer.base_path", "s3://no-such-bucket-x3/runs", "does not exist"),
    ]
    for sections, field, url, what in cases:
        pipe = Pipeline(load_config(pt.write_config(tmp_path, **sections)), progress=False)
        with pytest.raises(ConfigError) as e:
            pipe.preflight()
        text = str(e.value)
        assert "\n" not in text and field in text and url in text and what in text, text
    # Nothing was built: no stage's output anywhere.
    assert not (tmp_path / "store").exists()
    _no_local_scheme_dirs(tmp_path)

    ok = Pipeline(load_config(pt.write_config(tmp_path, store={"root": s3_bucket.url("store")})), progress=False)
    ok.preflight()  # the fixture's bucket and credentials: no problem

    # Credentials the server refuses (moto checks them when its auth is on) ...
    import moto.settings

    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    fs_cache_clear()
    with pytest.raises(ConfigError) as e:
        ok.preflight()
    text = str(e.value)
    assert "\n" not in text and "store.root" in text and s3_bucket.url("store") in text and "refused" in text, text
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", float("inf"))
    # ... and none at all (no variables, no files, no instance metadata).
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    fs_cache_clear()
    with pytest.raises(ConfigError) as e:
        ok.preflight()
    text = str(e.value)
    assert "\n" not in text and "store.root" in text and "credentials" in text, text
    fs_cache_clear()


def fs_cache_clear() -> None:
    from helpers.s3 import clear_fsspec_cache

    clear_fsspec_cache()


def test_cli_prints_a_url_problem_in_one_line_and_exits_2(s3_bucket, tmp_path):  # noqa: F811 (fixtures)
    cfg = pt.write_config(tmp_path, store={"root": "s3://no-such-bucket-cli/store"})
    r = subprocess.run([sys.executable, "-m", "lm_pipeline.cli", "cache", "--config_path", str(cfg)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "store.root" in errors[0] and "no-such-bucket-cli" in errors[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "s3:").exists()


def test_data_cache_dir_holds_the_token_cache_and_the_store_points_to_it(s3_bucket, tmp_path, monkeypatch):  # noqa: F811
    """``data.cache_dir`` (here a bucket prefix, the store local): the cache's arrays are written
    there, equal to those of a store without cache_dir; the store keeps only a pointer, which a
    pipeline without cache_dir and the lineage reader follow (a hit, no second build)."""
    from lm_pipeline.data.cache import open_cache
    from lm_pipeline.steps import lineage as lin

    monkeypatch.chdir(tmp_path)
    shared = s3_bucket.url("caches")
    with pytest.raises(ConfigError, match=r"data\.cache_dir"):
        load_config(pt.write_config(tmp_path, data={"cache_dir": "  "}))
    moved = _pipe(tmp_path, str(tmp_path / "store"), data={"cache_dir": shared})
    res = moved.token_cache()
    fp = res.fingerprint
    assert not res.hit and res.path == f"{shared}/{fp}"
    objects = _objects(s3_bucket)
    assert f"caches/{fp}/manifest.json" in objects and any(k.startswith(f"caches/{fp}/train/") for k in objects)
    pointer = tmp_path / "store" / "token_cache" / fp
    assert sorted(p.name for p in pointer.iterdir()) == ["location.json"]
    assert json.loads((pointer / "location.json").read_text()) == {"path": f"{shared}/{fp}"}
    # The reference: the same stages in another store, cache in the store (no cache_dir).
    ref = _pipe(tmp_path, str(tmp_path / "ref-store")).token_cache()
    assert ref.fingerprint == fp and ref.path == str(tmp_path / "ref-store" / "token_cache" / fp)
    for split in ("train", "validation"):
        a, b = open_cache(f"{ref.path}/{split}"), open_cache(f"{res.path}/{split}")
        for name in ("tokens", "doc_offsets"):
            x, y = (np.asarray(c.array(name).read().result()) for c in (a, b))
            assert x.size > 0 and np.array_equal(x, y), (split, name)
    # The same store without cache_dir: a hit through the pointer, nothing written to the bucket.
    plain = _pipe(tmp_path, str(tmp_path / "store"))
    again = plain.token_cache()
    assert again.hit and again.path == f"{shared}/{fp}"
    assert _objects(s3_bucket) == objects
    steps = {s["stage"]: s for s in lin.lineage(str(tmp_path / "store"), "token_cache", fp)}
    assert steps["token_cache"]["status"] == "complete" and steps["token_cache"]["path"] == f"{shared}/{fp}"
    assert steps["tokenizer"]["status"] == steps["raw_shards"]["status"] == "complete"
    # Another experiment's store sharing the cache_dir: a hit there, and its store gets the pointer.
    other = _pipe(tmp_path, str(tmp_path / "other-store"), data={"cache_dir": shared})
    hit = other.token_cache()
    assert hit.hit and hit.path == f"{shared}/{fp}" and _objects(s3_bucket) == objects
    assert json.loads((tmp_path / "other-store" / "token_cache" / fp / "location.json").read_text())["path"] == hit.path
    # cache_dir turned on where the cache was built in the store: that cache, not a second build.
    late = _pipe(tmp_path, str(tmp_path / "ref-store"), data={"cache_dir": s3_bucket.url("late")})
    found = late.token_cache()
    assert found.hit and found.path == ref.path
    assert not any(k.startswith("late/") for k in _objects(s3_bucket))
    # A relative cache_dir is recorded as an absolute path (the pointer is read from anywhere).
    rel = _pipe(tmp_path, str(tmp_path / "rel-store"), data={"cache_dir": "caches"})
    built = rel.token_cache()
    assert built.path == str(tmp_path / "caches" / fp)
    assert json.loads((tmp_path / "rel-store" / "token_cache" / fp / "location.json").read_text())["path"] == built.path
    # A cache_dir on a bucket that does not exist fails the preflight in one line naming the field.
    missing = _pipe(tmp_path, str(tmp_path / "store"), data={"cache_dir": "s3://no-such-bucket-cache/c"})
    with pytest.raises(ConfigError, match=r"data\.cache_dir.*no-such-bucket-cache") as err:
        missing.preflight()
    assert "\n" not in str(err.value)
    _no_local_scheme_dirs(tmp_path)


def test_tensorstore_spec_takes_the_endpoint_from_the_standard_variables(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:2")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    spec = fs.kvstore_spec("s3://bkt/a/b")
    assert spec == {"driver": "s3", "bucket": "bkt", "path": "a/b/", "endpoint": "http://127.0.0.1:1",
                    "aws_region": "eu-west-3"}
    assert not any("SECRET" in str(v) or "testing" in str(v) for v in spec.values())  # no credentials in specs
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    assert fs.kvstore_spec("s3://bkt/a")["endpoint"] == "http://127.0.0.1:2"


def test_what_another_process_writes_after_a_listing_is_seen(s3_bucket):  # noqa: F811 (fixtures)
    """fsspec caches listings; a manifest or checkpoint marker written by another process after
    this one listed the directory must still be read (else a finished stage would be rebuilt)."""
    import boto3

    from lm_pipeline.store import ArtifactStore

    store = ArtifactStore(s3_bucket.url("store"))
    art = store.artifact("tokenizer", "f00")
    assert store.manifest("tokenizer", "f00") is None and fs.listdir(s3_bucket.url("store", "tokenizer")) == []
    client = boto3.client("s3", endpoint_url=s3_bucket.server.endpoint, region_name=REGION)
    body = json.dumps({"stage": "tokenizer", "fingerprint": "f00"}).encode()
    client.put_object(Bucket=s3_bucket.name, Key="store/tokenizer/f00/manifest.json", Body=body)
    assert fs.exists(art.manifest_path) and store.manifest("tokenizer", "f00")["fingerprint"] == "f00"


def test_hf_export_to_a_url_is_the_local_export_published_with_config_json_last(s3_bucket, tmp_path,  # noqa: F811
                                                                                  monkeypatch):
    import equinox as eqx
    import jax

    from lm_pipeline.hf import export_hf
    from lm_pipeline.hf.load import _resolve_source
    from lm_pipeline.models import Gpt2Config
    from lm_pipeline.models.layers import named_params, replace_params

    cfg = Gpt2Config(seq_len=16, hidden_dim=16, num_layers=1, num_heads=2)
    skeleton = eqx.filter_eval_shape(cfg.build, 64, key=jax.random.PRNGKey(0))  # no compile: numpy weights
    rng = np.random.default_rng(0)
    model = replace_params(skeleton, {n: rng.standard_normal(leaf.shape, np.float32)
                                      for n, leaf in named_params(skeleton).items()})
    local = Path(export_hf(model, tmp_path / "local", max_shard_size="8KB"))  # sharded: several files
    uploaded: list[str] = []
    real_put = fs.put
    monkeypatch.setattr(fs.trees, "put", lambda src, dst: (uploaded.append(fs.basename(dst)), real_put(src, dst)))
    url = s3_bucket.url("hf", "step-1")
    assert export_hf(model, url, max_shard_size="8KB") == url
    names = sorted(p.name for p in local.iterdir())
    assert len(names) > 3 and sorted(uploaded) == names and uploaded[-1] == "config.json", uploaded
    objects = _objects(s3_bucket)
    assert {n: objects[f"hf/step-1/{n}"] for n in names} == {n: (local / n).read_bytes() for n in names}
    # Reading it back (e.g. trainer.initialize_from an export on a bucket) gives the same files.
    back = Path(_resolve_source(url, None, str(tmp_path / "dl"), None))
    assert {n: (back / n).read_bytes() for n in names} == {n: (local / n).read_bytes() for n in names}
    # An export without config.json (an interrupted upload) is never read as one.
    fs.remove(fs.join(url, "config.json"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        _resolve_source(url, None, str(tmp_path / "dl2"), None)


# --------------------------------------------------------------------------------------------
# The token cache on the bucket equals the local one (default tier: no training)
# --------------------------------------------------------------------------------------------


def test_token_cache_on_s3_equals_the_local_one(s3_bucket, tmp_path, monkeypatch):  # noqa: F811 (fixtures)
    from lm_pipeline.data.cache import open_cache

    monkeypatch.chdir(tmp_path)
    local = _pipe(tmp_path, str(tmp_path / "store"))
    remote = _pipe(tmp_path, s3_bucket.url("store"))
    remote.preflight()
    r_local, r_remote = local.token_cache(), remote.token_cache()
    assert not r_remote.hit and r_remote.path.startswith(s3_bucket.url("store"))
    for stage in ("raw_shards", "tokenizer", "token_cache"):
        assert local.address(stage).fingerprint == remote.address(stage).fingerprint, stage
    tok_local = Path(local.tokenizer().path)
    objects = _objects(s3_bucket)
    tok_key = remote.tokenizer().path.removeprefix(f"s3://{s3_bucket.name}/")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert objects[f"{tok_key}/{name}"] == (tok_local / name).read_bytes(), name
    for split in ("train", "validation"):
        a, b = open_cache(f"{r_local.path}/{split}"), open_cache(f"{r_remote.path}/{split}")
        for name in ("tokens", "doc_offsets", "doc_bytes"):
            x, y = (np.asarray(c.array(name).read().result()) for c in (a, b))
            assert x.size > 0 and x.shape == y.shape and np.array_equal(x, y), (split, name)
    # A second pipeline over the bucket: every stage a cache hit, no object written.
    before = {k: v for k, v in objects.items()}
    again = _pipe(tmp_path, s3_bucket.url("store"))
    assert again.token_cache().hit and again.cached("tokenizer") is not None
    assert _objects(s3_bucket) == before
    _no_local_scheme_dirs(tmp_path)


@pytest.mark.slow
def test_builtin_corpus_materialized_on_the_bucket(s3_bucket, tmp_path, monkeypatch):  # noqa: F811 (fixtures)
    monkeypatch.chdir(tmp_path)
    data = {"train_urls": [], "validation_urls": [], "builtin": "python_stdlib", "builtin_max_bytes": 60_000}
    local = _pipe(tmp_path, str(tmp_path / "store"), data=data)
    remote = _pipe(tmp_path, s3_bucket.url("store"), data=data)
    a, b = local.raw_shards(), remote.raw_shards()
    assert a.fingerprint == b.fingerprint and a.summary["valid"] == b.summary["valid"] > 0
    objects = _objects(s3_bucket)
    built = sorted(k for k in objects if k.startswith("store/builtin/python_stdlib/"))
    assert built and any(k.endswith("/manifest.json") for k in built)
    for shard in remote.shards()["train"]:
        assert shard.url.startswith(s3_bucket.url("store", "builtin")), shard.url
    _no_local_scheme_dirs(tmp_path)


# --------------------------------------------------------------------------------------------
# The whole pipeline on the bucket (slow)
# --------------------------------------------------------------------------------------------

STAGES = ("raw_shards", "tokenizer", "token_cache", "train_ckpt", "eval_report", "hf_export")


def _model_arrays(ckpt: str) -> dict[str, np.ndarray]:
    import jax

    from lm_pipeline.eval.loading import load_model_from_checkpoint

    model = load_model_from_checkpoint(ckpt).model
    leaves = jax.tree_util.tree_leaves_with_path(model)
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves if hasattr(v, "shape")}


def _eval_numbers(res) -> dict[str, tuple]:
    return {r["dataset"]: (r.get("loss"), r.get("bpb"), r.get("tokens")) for r in res.manifest["rows"]}


@pytest.mark.slow
def test_whole_pipeline_on_s3_builds_hits_and_exports(s3_bucket, s3_server, tmp_path, monkeypatch, caplog):  # noqa: F811 (fixtures)
    import boto3
    import torch
    import transformers

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LM_PIPELINE_CHECKPOINT_CACHE", str(tmp_path / "checkpoint-copies"))
    caplog.set_level(logging.INFO)
    root = s3_bucket.url("store")
    # Exports during training go to the bucket too (export.hf_save_path; not part of any address).
    remote = _pipe(tmp_path, root, export={"hf_save_path": s3_bucket.url("hf"), "hf_save_steps": 3})
    remote.preflight()
    built = {s: remote.build(s) for s in STAGES}
    assert not any(r.hit for r in built.values()), {s: r.hit for s, r in built.items()}
    assert all(r.path.startswith(root + "/") for r in built.values())
    run_dir = built["train_ckpt"].manifest["run_dir"]
    assert run_dir.startswith(root + "/train_ckpt/")

    # The same experiment on a local store: the same addresses, eval numbers and final weights.
    local = _pipe(tmp_path, str(tmp_path / "store"))
    ref = {s: local.build(s) for s in STAGES}
    assert {s: r.fingerprint for s, r in built.items()} == {s: r.fingerprint for s, r in ref.items()}
    assert _eval_numbers(built["eval_report"]) == _eval_numbers(ref["eval_report"])
    ours = _model_arrays(built["eval_report"].manifest["checkpoint"])
    theirs = _model_arrays(ref["eval_report"].manifest["checkpoint"])
    assert ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k]) for k in ours)

    # What the bucket holds, listed by boto3: every stage's manifest, checkpoints with markers.
    objects = _objects(s3_bucket)
    for r in built.values():
        key = r.path.removeprefix(f"s3://{s3_bucket.name}/")
        assert json.loads(objects[f"{key}/manifest.json"])["fingerprint"] == r.fingerprint
    run_key = run_dir.removeprefix(f"s3://{s3_bucket.name}/")
    assert {f"{run_key}/step-3/checkpoint.json", f"{run_key}/step-6/checkpoint.json"} <= set(objects)
    hf = f"hf/{built['train_ckpt'].manifest['run_id']}"  # <hf_save_path>/<run id>/step-<N>
    assert {f"{hf}/step-3/config.json", f"{hf}/step-6/config.json", f"{hf}/step-6/model.safetensors"} <= set(objects)
    assert objects[f"{hf}/step-6/model.safetensors"] == objects[
        built["hf_export"].path.removeprefix(f"s3://{s3_bucket.name}/") + "/model.safetensors"]

    # A second run over the bucket: every stage a cache hit, and not one object written.
    again = _pipe(tmp_path, root)
    hits = {s: again.build(s) for s in STAGES}
    assert all(r.hit for r in hits.values()), {s: r.hit for s, r in hits.items()}
    assert _objects(s3_bucket) == objects

    # The export on the bucket, downloaded, loads in transformers with our model's logits.
    export_key = built["hf_export"].path.removeprefix(f"s3://{s3_bucket.name}/")
    client = boto3.client("s3", endpoint_url=s3_server.endpoint, region_name=REGION)
    dl = tmp_path / "export-download"
    for key, data in objects.items():
        if key.startswith(export_key + "/") and not key.endswith("/manifest.json"):
            (dl / key[len(export_key) + 1:]).parent.mkdir(parents=True, exist_ok=True)
            (dl / key[len(export_key) + 1:]).write_bytes(data)
    assert (dl / "config.json").is_file() and (dl / "model.safetensors").is_file(), sorted(os.listdir(dl))
    del client
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(dl), dtype=torch.float32).eval()
    vocab = json.loads((dl / "config.json").read_text())["vocab_size"]
    x = np.random.default_rng(0).integers(0, vocab, (2, 12), dtype=np.int64)
    with torch.no_grad():
        hf_logits = hf(torch.tensor(x)).logits.numpy()
    from lm_pipeline.eval.loading import load_model_from_checkpoint

    model = load_model_from_checkpoint(built["hf_export"].manifest["checkpoint"]).model
    our_logits = np.asarray(model(x.astype(np.int32)))[..., :vocab]
    assert our_logits.shape == hf_logits.shape
    assert np.abs(our_logits - hf_logits).max() <= 1e-4 * np.abs(hf_logits).max()

    # Credentials appear in no object and no log; nothing local is named after the scheme.
    secret = os.environ["AWS_SECRET_ACCESS_KEY"].encode()
    assert secret and not [k for k, v in objects.items() if secret in v or secret in k.encode()]
    logs = caplog.text + "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").rglob("*") if p.is_file())
    assert secret.decode() not in logs
    _no_local_scheme_dirs(tmp_path)


@pytest.mark.slow
def test_checkpoint_upload_killed_on_the_bucket_is_never_complete(s3_bucket, tmp_path, monkeypatch):  # noqa: F811 (fixtures)
    """SIGKILL half-way through uploading step-6's arrays: step-6 has objects but no marker, is
    never found, and the run resumes from step-3 to the weights of an uninterrupted run."""
    from lm_pipeline.train.checkpoint import latest_checkpoint

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LM_PIPELINE_CHECKPOINT_CACHE", str(tmp_path / "checkpoint-copies"))
    root = s3_bucket.url("killed")
    cfg = pt.write_config(tmp_path, name="killed.yaml", store={"root": root})
    env = pt.subprocess_env(tmp_path, cfg)
    env.update({"LM_PIPELINE_CHECKPOINT_CACHE": str(tmp_path / "checkpoint-copies"),
                "LM_PIPELINE_FAULTPOINT_TRACE": str(tmp_path / "trace")})
    cmd = [sys.executable, "-m", "lm_pipeline.cli", "train", "--config_path", str(cfg)]
    killed = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env={**env, "LM_PIPELINE_FAULTPOINT": "checkpoint.upload_partial:2"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (tmp_path / "trace").read_text().split().count("checkpoint.upload_partial") == 2

    pipe = _pipe(tmp_path, root)
    run_dir = pipe.run_dir()
    keys = set(_objects(s3_bucket))
    run_key = run_dir.removeprefix(f"s3://{s3_bucket.name}/")
    step6 = [k for k in keys if k.startswith(f"{run_key}/step-6/state/")]
    assert step6, "the kill landed before any of step-6's arrays were uploaded"
    assert f"{run_key}/step-6/checkpoint.json" not in keys and f"{run_key}/step-3/checkpoint.json" in keys
    assert latest_checkpoint(run_dir) == f"{run_dir}/step-3"
    assert pipe.cached("train_ckpt") is None

    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    res = pipe.cached("train_ckpt")
    assert res is not None and res.manifest["resumed_from"] == f"{run_dir}/step-3"
    assert latest_checkpoint(run_dir) == f"{run_dir}/step-6"
    # The same weights as the same experiment trained without interruption on a local store.
    ref = _pipe(tmp_path, str(tmp_path / "store")).train_ckpt()
    ours, theirs = _model_arrays(f"{run_dir}/step-6"), _model_arrays(ref.manifest["final_checkpoint"])
    assert ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k]) for k in ours)


def _two_processes(url: str, tmp_path: Path, hosts: tuple[str, ...] = ()) -> list[subprocess.CompletedProcess]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).parent / "scripts" / "s3_checkpoint_process.py"
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
           "LM_PIPELINE_CHECKPOINT_CACHE": str(tmp_path / "copies")}
    procs = [subprocess.Popen([sys.executable, str(script), str(i), "2", f"127.0.0.1:{port}", url, *hosts[i:i + 1]],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, ""))
    return out


@pytest.mark.slow
def test_two_processes_on_one_host_checkpoint_on_the_bucket(s3_bucket, tmp_path):  # noqa: F811 (fixtures)
    import jax

    from lm_pipeline.train.checkpoint import latest_checkpoint, load, read_metadata, verify

    url = s3_bucket.url("runs", "r")
    runs = _two_processes(url, tmp_path)
    assert [r.returncode for r in runs] == [0, 0], [r.stdout[-1500:] for r in runs]
    keys = set(_objects(s3_bucket))
    assert "runs/r/step-1/checkpoint.json" in keys
    # Each process staged in its own dir and uploaded its own shard of w (zarr3 chunks, no OCDBT).
    assert {"runs/r/step-1/state/w/c/0/0", "runs/r/step-1/state/w/c/1/0"} <= keys, sorted(keys)
    path = latest_checkpoint(url)
    assert path == f"{url}/step-1" and verify(path, read_metadata(path)) == []
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    got = load(path, {"w": jax.ShapeDtypeStruct((4, 8), np.float32, sharding=dev),
                      "b": jax.ShapeDtypeStruct((3,), np.float32, sharding=dev)})
    assert np.array_equal(np.asarray(got["w"]), np.arange(32, dtype=np.float32).reshape(4, 8))
    assert np.array_equal(np.asarray(got["b"]), np.full(3, 7.0, np.float32))
    _no_local_scheme_dirs(tmp_path)
    # Processes on different hosts (each its own staging dir): tests/test_object_store_multihost.py.


@pytest.mark.slow
def test_a_bucket_run_killed_after_a_checkpoint_keeps_every_metrics_step_once_and_its_plots(s3_bucket, tmp_path,  # noqa: F811
                                                                                            monkeypatch):
    """SIGKILL right after step-3's checkpoint is complete (the 60 s metrics upload not yet due):
    the metrics log was uploaded before that checkpoint, so the run resumed from step-3 has every
    logged step exactly once; the loss plots are written to the bucket at the end."""
    monkeypatch.chdir(tmp_path)
    root = s3_bucket.url("metrics")
    cfg = pt.write_config(tmp_path, name="metrics.yaml", store={"root": root})
    env = pt.subprocess_env(tmp_path, cfg)
    env.update({"LM_PIPELINE_CHECKPOINT_CACHE": str(tmp_path / "checkpoint-copies")})
    cmd = [sys.executable, "-m", "lm_pipeline.cli", "train", "--config_path", str(cfg)]
    killed = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env={**env, "LM_PIPELINE_FAULTPOINT": "checkpoint.after_marker:1"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    markers = [k for k in _objects(s3_bucket) if k.startswith("metrics/train_ckpt/") and k.endswith("/checkpoint.json")]
    assert [k.rsplit("/", 2)[1] for k in markers] == ["step-3"], markers  # killed right after step-3 landed
    run_key = markers[0].rsplit("/", 2)[0]

    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    objects = _objects(s3_bucket)
    records = [json.loads(line) for line in objects[f"{run_key}/metrics.jsonl"].decode().splitlines() if line.strip()]
    train_steps = [r["step"] for r in records if "train/loss" in r]
    eval_steps = [r["step"] for r in records if "eval/loss" in r]
    assert train_steps == [2, 4, 6] and eval_steps == [3, 6], records  # log_every 2, steps_per_eval 3
    for name in ("loss.png", "learning_rate.png"):
        assert objects[f"{run_key}/plots/{name}"].startswith(b"\x89PNG"), name
