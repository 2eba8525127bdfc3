"""Every user-caused error of the command line ends in one line naming the thing and the fix,
exit code 2, no traceback (``--debug`` shows it): bad config, bad data under ``fail``, a ``.gz``
that is not gzip, generation arguments out of range, a checkpoint path that holds none."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import pipeline_testing as pt  # noqa: E402


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
    }


NAMES = ["unknown config field", "invalid record under fail", "a .gz that is plain text", "a truncated .gz under fail",
         "a data URL of an unknown scheme", "a store URL of an unknown scheme",
         "max_new_tokens 0", "max_new_tokens -5", "temperature -1", "top_p 0", "top_k 0", "no checkpoint there"]


def _run(args: list[str], debug: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "LM_PIPELINE_NO_TCMALLOC": "1", "JAX_PLATFORMS": "cpu"}
    env.pop("LM_PIPELINE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "lm_pipeline.cli", *args, "--log_level", "ERROR",
                           *(["--debug"] if debug else [])], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("name", NAMES)
def test_a_user_error_is_one_line_with_exit_code_2(tmp_path, name):
    args, needles = _cases(tmp_path)[name]
    out = _run(args)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_debug_shows_the_traceback(tmp_path):
    args, _ = _cases(tmp_path)["invalid record under fail"]
    out = _run(args, debug=True)
    assert out.returncode != 0 and "Traceback" in out.stderr and "DataValidationError" in out.stderr
