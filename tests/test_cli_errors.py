"""Every user-caused error of the command line ends in one line naming the thing and the fix,
exit code 2, no traceback (``--debug`` shows it): bad config, bad data under ``fail``, a ``.gz``
that is not gzip, generation arguments out of range, a checkpoint path that holds none, training
data with no text, a tokenizer or Hugging Face model directory that is missing, a file, or
corrupt, a checkpoint to resume from that does not exist; and, offline, a hub id or a bucket
within seconds.

The offline cases never reach the network, with or without one: the hub's endpoint is a name that
cannot resolve (``.invalid``, RFC 6761) and the Hugging Face cache an empty directory, or
``HF_HUB_OFFLINE=1``; the GCS endpoint an emulator address that cannot resolve."""

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import pipeline as pt
from helpers.s3 import s3_bucket, s3_server  # noqa: F401  (pytest fixtures)


def _config(tmp: Path, name: str, **data) -> str:
    cfg = pt.tiny_config(tmp)
    cfg["data"].update(data)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _cases(tmp: Path) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    """name -> (arguments, substrings the one error line must hold)."""
    bad = tmp / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + '{"text": 3}\n')
    plain = tmp / "plain.jsonl.gz"
    plain.write_text(json.dumps({"text": "not compressed at all"}) + "\n")
    cut = tmp / "cut.jsonl.gz"
    whole = gzip.compress(("\n".join(json.dumps({"text": f"doc {i} " * 30}) for i in range(200)) + "\n").encode())
    cut.write_bytes(whole[: len(whole) // 2])
    empty = tmp / "empty.jsonl"
    empty.write_text("")
    notok = tmp / "notok"
    notok.mkdir()
    (notok / "readme.txt").write_text("not a tokenizer")
    notjson = tmp / "notjson"  # a tokenizer.json cut short: no JSON
    notjson.mkdir()
    (notjson / "tokenizer.json").write_text('{"version": "1.0", "model": {broken')
    (notjson / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    nomodel = tmp / "nomodel"  # valid JSON, but no tokenizer (and no tokenizer_config.json)
    nomodel.mkdir()
    (nomodel / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')
    hfbad = tmp / "hfbad"  # a Hugging Face model directory whose config.json is cut short
    hfbad.mkdir()
    (hfbad / "config.json").write_text("{not json")
    (hfbad / "model.safetensors").write_bytes(b"\0" * 8)
    noweights = tmp / "noweights"
    noweights.mkdir()
    (noweights / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    weights = tmp / "weights.bin"
    weights.write_bytes(b"\0" * 8)
    torch_ckpt = tmp / "model.pt"
    torch_ckpt.write_bytes(b"\0" * 8)
    nothing = tmp / "nothing-here"
    nothing.mkdir()
    train = ["train", "--config_path", _config(tmp, "t0")]
    return {
        "unknown config field": (["plan", "--config_path", _config(tmp, "c1"), "--model.num_head", "4"],
                                 ("model.num_head",)),
        "invalid record under fail": (["cache", "--config_path", _config(tmp, "c2", train_urls=[str(bad)],
                                                                           on_invalid="fail")],
                                      ("bad.jsonl line 2", "on_invalid")),
        "a .gz that is plain text": (["cache", "--config_path", _config(tmp, "c3", train_urls=[str(plain)],
                                                                          on_invalid="fail")],
                                     ("plain.jsonl.gz", "not gzip-compressed")),
        "a truncated .gz under fail": (["cache", "--config_path", _config(tmp, "c4", train_urls=[str(cut)],
                                                                            on_invalid="fail")],
                                       ("cut.jsonl.gz", "truncated or corrupt", "on_invalid: skip")),
        "a data URL of an unknown scheme": (["plan", "--config_path", _config(tmp, "c5", train_urls=["foo://b/x.jsonl"])],
                                            ("data.train_urls", "foo://b/x.jsonl", "unknown URL scheme 'foo'")),
        "a store URL of an unknown scheme": (["plan", "--config_path", _config(tmp, "c6"), "--store.root", "bar://b/s"],
                                             ("store.root", "unknown URL scheme 'bar'")),
        "max_new_tokens 0": (["generate", "--checkpoint_path", str(tmp), "--prompt", "x", "--max_new_tokens", "0"],
                             ("max_new_tokens must be >= 1",)),
        "max_new_tokens -5": (["generate", "--checkpoint_path", str(tmp), "--prompt", "x", "--max_new_tokens", "-5"],
                              ("max_new_tokens must be >= 1",)),
        "temperature -1": (["generate", "--checkpoint_path", str(tmp), "--prompt", "x", "--temperature", "-1"],
                           ("temperature must be >= 0",)),
        "top_p 0": (["generate", "--checkpoint_path", str(tmp), "--prompt", "x", "--top_p", "0"], ("top_p must be in",)),
        "top_k 0": (["generate", "--checkpoint_path", str(tmp), "--prompt", "x", "--top_k", "0"], ("top_k must be >= 1",)),
        "no checkpoint there": (["export", "--checkpoint_path", str(tmp / "nowhere"), "--output_dir", str(tmp / "o")],
                                ("nowhere",)),
        "a mixture with the section's own validation_urls": (["plan", "--config_path", _config(
            tmp, "mix", train_urls=[], configs={"web": {"train_urls": [str(empty)]}, "code": {"train_urls": [str(empty)]}},
            train_weights={"web": 0.7, "code": 0.3})], ("data.validation_urls", "configs.<name>.validation_urls")),
        # 1: no training text
        "an empty training file (train)": (["train", "--config_path", _config(tmp, "e1", train_urls=[str(empty)])],
                                           ("data.train_urls", "empty.jsonl", "no training text")),
        "an empty training file (cache)": (["cache", "--config_path", _config(tmp, "e2", train_urls=[str(empty)])],
                                           ("data.train_urls", "empty.jsonl", "no training text")),
        # 2: data.tokenizer not a tokenizer
        "a tokenizer directory without tokenizer.json": (
            ["cache", "--config_path", _config(tmp, "k1", tokenizer=str(notok))],
            ("data.tokenizer", str(notok), "without tokenizer.json", "point data.tokenizer at")),
        "a tokenizer path that does not exist": (
            ["cache", "--config_path", _config(tmp, "k2", tokenizer=str(tmp / "nope"))],
            ("data.tokenizer", str(tmp / "nope"), "does not exist", "point data.tokenizer at")),
        "a tokenizer.json file as the tokenizer": (
            ["plan", "--config_path", _config(tmp, "k3", tokenizer=str(notjson / "tokenizer.json"))],
            ("data.tokenizer", "is a file", f"the directory that holds it: '{notjson}'")),
        # 4: a malformed config.json
        "a malformed config.json as initialize_from_hf": (
            [*train, "--initialize_from_hf", str(hfbad)],
            ("initialize_from_hf", f"{hfbad}/config.json", "not valid JSON", "line 1, column 2")),
        "a malformed config.json under use_hf_model_config": (
            ["plan", "--config_path", _config(tmp, "h2"), "--initialize_from_hf", str(hfbad), "--use_hf_model_config",
             "true"], ("initialize_from_hf", f"{hfbad}/config.json", "not valid JSON", "line 1, column 2")),
        "a malformed config.json to eval": (
            ["eval", "--config_path", _config(tmp, "h3"), "--checkpoint_path", str(hfbad)],
            ("checkpoint_path", f"{hfbad}/config.json", "not valid JSON", "line 1, column 2")),
        "a malformed config.json to export": (
            ["export", "--checkpoint_path", str(hfbad), "--output_dir", str(tmp / "o")],
            ("checkpoint_path", f"{hfbad}/config.json", "not valid JSON", "line 1, column 2")),
        "a malformed config.json to generate": (
            ["generate", "--checkpoint_path", str(hfbad), "--prompt", "x"],
            ("checkpoint_path", f"{hfbad}/config.json", "not valid JSON", "line 1, column 2")),
        "a Hugging Face directory without weights to eval": (
            ["eval", "--config_path", _config(tmp, "h4"), "--checkpoint_path", str(noweights)],
            ("checkpoint_path", str(noweights), "no *.safetensors")),
        # 5: a corrupt tokenizer.json; a file as initialize_from_hf
        "a tokenizer.json that is not JSON": (
            ["cache", "--config_path", _config(tmp, "k4", tokenizer=str(notjson))],
            ("data.tokenizer", f"{notjson}/tokenizer.json", "not valid JSON", "line 1, column 30")),
        "a tokenizer.json that is no tokenizer": (
            ["cache", "--config_path", _config(tmp, "k5", tokenizer=str(nomodel))],
            ("data.tokenizer", f"{nomodel}/tokenizer.json", "tokenizers library can load", "line 1 column 30")),
        "a file as initialize_from_hf": (
            [*train, "--initialize_from_hf", str(weights)],
            ("initialize_from_hf", str(weights), "is a file", "Hugging Face model directory", "hub repo id")),
        # 9: a checkpoint to resume from that is not one
        "a load_checkpoint_path that does not exist": (
            [*train, "--trainer.load_checkpoint_path", str(tmp / "no-such-run")],
            ("trainer.load_checkpoint_path", str(tmp / "no-such-run"), "does not exist")),
        "a .pt file as resume_from_checkpoint": (
            [*train, "--trainer.resume_from_checkpoint", str(torch_ckpt)],
            ("trainer.load_checkpoint_path", str(torch_ckpt), "is a file", "never loaded")),
        "a load_checkpoint_path that holds no checkpoint": (
            [*train, "--trainer.load_checkpoint_path", str(nothing)],
            ("trainer.load_checkpoint_path", "no complete checkpoint at or under", str(nothing))),
    }


NAMES = ["unknown config field", "invalid record under fail", "a .gz that is plain text", "a truncated .gz under fail",
         "a data URL of an unknown scheme", "a store URL of an unknown scheme",
         "max_new_tokens 0", "max_new_tokens -5", "temperature -1", "top_p 0", "top_k 0", "no checkpoint there",
         "a mixture with the section's own validation_urls",
         "an empty training file (train)", "an empty training file (cache)",
         "a tokenizer directory without tokenizer.json", "a tokenizer path that does not exist",
         "a tokenizer.json file as the tokenizer",
         "a malformed config.json as initialize_from_hf", "a malformed config.json under use_hf_model_config",
         "a malformed config.json to eval", "a malformed config.json to export", "a malformed config.json to generate",
         "a Hugging Face directory without weights to eval",
         "a tokenizer.json that is not JSON", "a tokenizer.json that is no tokenizer", "a file as initialize_from_hf",
         "a load_checkpoint_path that does not exist", "a .pt file as resume_from_checkpoint",
         "a load_checkpoint_path that holds no checkpoint"]

#: Variables that would send a request elsewhere than the test means: proxies, offline switches,
#: caches, endpoints.
_ROUTING = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy", "HF_HUB_OFFLINE",
            "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE",
            "HF_DATASETS_CACHE", "STORAGE_EMULATOR_HOST")


def _run(args: list[str], debug: bool = False, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "LM_PIPELINE_NO_TCMALLOC": "1", "JAX_PLATFORMS": "cpu"}
    full.pop("LM_PIPELINE_DEBUG", None)
    if env is not None:
        for name in _ROUTING:
            full.pop(name, None)
        full.update(env)
    return subprocess.run([sys.executable, "-m", "lm_pipeline.cli", *args, "--log_level", "ERROR",
                           *(["--debug"] if debug else [])], capture_output=True, text=True, timeout=300, env=full)


def _one_line(out: subprocess.CompletedProcess, needles: tuple[str, ...]) -> str:
    """The one ``error:`` line of a run that failed with exit code 2 (asserted), holding ``needles``."""
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("name", NAMES)
def test_a_user_error_is_one_line_with_exit_code_2(tmp_path, name):
    args, needles = _cases(tmp_path)[name]
    _one_line(_run(args), needles)


#: The hub ids below belong to no one (the endpoint cannot resolve anyway).
_TOKENIZER_ID = "lm-pipeline-tests/no-such-tokenizer"
_DATASET_ID = "lm-pipeline-tests/no-such-dataset"
_MODEL_ID = "lm-pipeline-tests/no-such-model"


@pytest.mark.parametrize("what,offline", [("tokenizer", "unreachable"), ("dataset", "unreachable"),
                                          ("model", "unreachable"), ("tokenizer", "HF_HUB_OFFLINE")])
def test_a_hub_id_offline_fails_in_seconds_in_one_line(tmp_path, what, offline):
    """Offline the hub clients retry for 25-50 s and end in a traceback; here one connection
    attempt decides, and the line names the id, says the hub cannot be used and what to do."""
    env = {"HF_HOME": str(tmp_path / "hf-home")}  # an empty cache
    env.update({"HF_ENDPOINT": "http://hub.invalid"} if offline == "unreachable" else {"HF_HUB_OFFLINE": "1"})
    args = {"tokenizer": ["cache", "--config_path", _config(tmp_path, "o1", tokenizer=_TOKENIZER_ID)],
            "dataset": ["cache", "--config_path", _config(tmp_path, "o2", id=_DATASET_ID, train_urls=None)],
            "model": ["plan", "--config_path", _config(tmp_path, "o3"), "--initialize_from_hf", _MODEL_ID]}[what]
    field = {"tokenizer": "data.tokenizer", "dataset": "data.hf_id", "model": "initialize_from_hf"}[what]
    ident = {"tokenizer": _TOKENIZER_ID, "dataset": _DATASET_ID, "model": _MODEL_ID}[what]
    why = "hub.invalid" if offline == "unreachable" else "HF_HUB_OFFLINE=1 is set"
    t0 = time.monotonic()
    out = _run(args, env=env)
    elapsed = time.monotonic() - t0
    _one_line(out, (field, ident, "the hub cannot be used", why, "local", "HF_HUB_OFFLINE=1"))
    assert elapsed < 10, f"{elapsed:.1f} s"


def test_a_bucket_offline_fails_in_seconds_in_one_line(tmp_path):
    """gcsfs retries for ~50 s offline and logs ~45 lines of tracebacks; the preflight check
    connects once and says it in one line."""
    env = {"STORAGE_EMULATOR_HOST": "http://storage.invalid"}  # GCS's endpoint, unresolvable
    t0 = time.monotonic()
    out = _run(["plan", "--config_path", _config(tmp_path, "g1"), "--store.root",
                "gs://lm-pipeline-tests-no-such-bucket/store"], env=env)
    elapsed = time.monotonic() - t0
    _one_line(out, ("store.root", "gs://lm-pipeline-tests-no-such-bucket/store", "cannot reach",
                    "storage.invalid", "network"))
    assert elapsed < 10, f"{elapsed:.1f} s"


_S3_ROUNDTRIP = """
import sys
from lm_pipeline.data.cache.storage import CacheRoot, create_array, open_array
root = CacheRoot(sys.argv[1])
root.write_atomic("ledger.json", b"{}")
assert root.read("ledger.json") == b"{}"
create_array(root, "tokens")
assert open_array(root, "tokens").shape == (0,)
"""


def test_token_cache_on_s3_logs_nothing_about_missing_aws_files(s3_bucket, tmp_path):  # noqa: F811 (fixtures)
    """With the credentials in the environment and no ~/.aws, TensorStore's default chain logged
    'Failed to open file' for ~/.aws/config and ~/.aws/credentials on every S3 access."""
    env = {**os.environ, **s3_bucket.env, "HOME": str(tmp_path)}  # no ~/.aws
    for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_PROFILE"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", _S3_ROUNDTRIP, s3_bucket.url("cache")], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Failed to open file" not in out.stderr and "CredentialsProvider" not in out.stderr, out.stderr[-3000:]


@pytest.mark.slow
def test_a_bogus_checkpoint_path_on_a_finished_run_is_an_error_not_a_cache_hit(tmp_path):
    """The run is complete in the store, and load_checkpoint_path is not part of its address:
    a path that holds no checkpoint used to come back as a silent cache hit."""
    config = _config(tmp_path, "f1")
    done = _run(["train", "--config_path", config])
    assert done.returncode == 0, done.stderr[-3000:]
    again = _run(["train", "--config_path", config])
    assert again.returncode == 0 and json.loads(again.stdout)["hit"] is True, again.stderr[-3000:]
    for path, needle in ((tmp_path / "no-such-run", "does not exist"), (tmp_path / "weights.pt", "is a file")):
        if needle == "is a file":
            path.write_bytes(b"\0" * 8)
        out = _run(["train", "--config_path", config, "--trainer.resume_from_checkpoint", str(path)])
        _one_line(out, ("trainer.load_checkpoint_path", str(path), needle))


def test_debug_shows_the_traceback(tmp_path):
    args, _ = _cases(tmp_path)["invalid record under fail"]
    out = _run(args, debug=True)
    assert out.returncode != 0 and "Traceback" in out.stderr and "DataValidationError" in out.stderr
