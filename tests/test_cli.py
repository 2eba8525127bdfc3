"""The command line's process start-up: tcmalloc re-execution for the long-running commands."""

import os
import subprocess
import sys

import pytest

from lm_pipeline.launch import MARKER_ENV, find_tcmalloc

CHILD = (
    "import os, sys\n"
    "print('LD_PRELOAD=' + os.environ.get('LD_PRELOAD', ''), flush=True)\n"
    "sys.argv = ['lm-pipeline', sys.argv[1], '--config_path', '/nonexistent/run.yaml']\n"
    "from lm_pipeline.cli import main\n"
    "raise SystemExit(main())\n"
)


def _run(command: str, **env) -> subprocess.CompletedProcess:
    import os

    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", MARKER_ENV)}
    return subprocess.run([sys.executable, "-c", CHILD, command], capture_output=True, text=True, timeout=120,
                          env={**clean, **env})


@pytest.mark.skipif(find_tcmalloc() is None, reason="libtcmalloc-minimal4 is not installed here")
def test_train_reexecutes_with_tcmalloc_then_reports_the_config_error():
    out = _run("train")
    lib = find_tcmalloc()
    # printed once before the re-exec (no preload) and once after it (tcmalloc preloaded)
    assert out.stdout.splitlines() == ["LD_PRELOAD=", f"LD_PRELOAD={lib}"], out.stdout
    assert out.returncode == 2 and "/nonexistent/run.yaml" in out.stderr


SCRIPT = (  # the installed `lm-pipeline` script's entry (pyproject's [project.scripts]), its re-exec recorded
    "import sys\n"
    "import lm_pipeline.launch as launch\n"
    "seen = []\n"
    "launch.maybe_reexec_with_tcmalloc = lambda: seen.append('lm_pipeline.cli' in sys.modules)\n"
    "sys.argv = ['lm-pipeline', sys.argv[1], '--config_path', '/nonexistent/run.yaml']\n"
    "rc = launch.cli()\n"
    "print(seen[:1], rc, 'lm_pipeline.cli' in sys.modules)\n"
)


def test_the_script_reexecutes_before_importing_the_command_line():
    """The console script re-executes first: the command line's modules (the stage table, fsspec,
    YAML) are then imported once, in the process that stays."""
    import tomllib

    scripts = tomllib.loads(open("pyproject.toml", "rb").read().decode())["project"]["scripts"]
    assert scripts["lm-pipeline"] == "lm_pipeline.launch:cli"
    run = [sys.executable, "-c", SCRIPT]
    env = {**os.environ, "LM_PIPELINE_NORMAL_EXIT": "1"}  # launch.cli returns its code to the script
    out = subprocess.run([*run, "train"], capture_output=True, text=True, timeout=120, env=env)
    # the first re-exec is asked before the import (main's own, after it, is a no-op once re-executed)
    assert out.stdout.split() == ["[False]", "2", "True"], out.stdout + out.stderr
    assert "/nonexistent/run.yaml" in out.stderr
    quick = subprocess.run([*run, "plan"], capture_output=True, text=True, timeout=120)
    assert quick.stdout.split() == ["[]", "2", "True"]  # a quick command does not re-execute


def test_opt_out_and_quick_commands_do_not_reexecute():
    assert _run("train", LM_PIPELINE_NO_TCMALLOC="1").stdout.splitlines() == ["LD_PRELOAD="]
    assert _run("plan").stdout.splitlines() == ["LD_PRELOAD="]


def test_experiment_by_name_is_the_file_the_deployment_names_so(tmp_path, monkeypatch, capsys):
    """``--experiment llama`` plans ``configs/experiments/llama.yaml`` (the deployment's ``llama``)."""
    import shutil

    from lm_pipeline.cli import main
    from lm_pipeline.config import load_config
    from lm_pipeline.steps import Pipeline

    folder = tmp_path / "configs" / "experiments"
    shutil.copytree("configs/experiments", folder)
    shutil.copytree("configs/data", tmp_path / "configs" / "data")
    monkeypatch.setenv("LM_PIPELINE_EXPERIMENTS_DIR", str(folder))
    root = str(tmp_path / "store")
    assert main(["plan", "--experiment", "llama", "--store.root", root]) == 0
    out = capsys.readouterr().out
    fps = {n: Pipeline(load_config(folder / f"{n}.yaml", [("store.root", root)]), progress=False).address("train_ckpt")
           .fingerprint for n in ("llama", "default")}
    assert fps["llama"] in out and fps["default"] not in out
    assert main(["plan", "--experiment", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no experiment 'nope'" in err and "default, llama" in err
    assert main(["plan", "--experiment", "llama", "--config_path", "x.yaml"]) == 2
    assert "not both" in capsys.readouterr().err


# --- estimate: the real tokenizer's vocabulary (issue #20 item 2) ------------------------------


def _estimate_json(capsys, path, *extra):
    import json

    from lm_pipeline.cli import main

    capsys.readouterr()
    assert main(["estimate", "--config_path", str(path), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_uses_the_vocabulary_of_a_local_hf_tokenizer(tmp_path, capsys):
    from helpers.data import tiny_tokenizer

    from lm_pipeline.data.tokenizer import tokenizer_info
    from lm_pipeline.models import Gpt2Config

    tok = tiny_tokenizer(str(tmp_path / "tok"), vocab_size=300)
    vocab = tokenizer_info(tok).vocab_size
    path = tmp_path / "c.yaml"
    path.write_text(f"data:\n  train_urls: [x.jsonl]\n  tokenizer: {tok}\nmodel:\n  type: gpt2\n  hidden_dim: 64\n"
                    "  num_heads: 4\n  num_layers: 2\n  seq_len: 32\n")
    est = _estimate_json(capsys, path)
    model = Gpt2Config(hidden_dim=64, num_heads=4, num_layers=2, seq_len=32)
    print(f"estimate with a local tokenizer dir: vocab {est['vocab_size']}, params {est['num_params']}")
    assert est["vocab_size"] == vocab != 4096
    assert est["num_params"] == model.num_params(vocab)
    assert _estimate_json(capsys, path, "--vocab_size", "512")["vocab_size"] == 512  # the flag still wins


def test_estimate_offline_with_an_unknown_tokenizer_name_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    from lm_pipeline.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  train_urls: [x.jsonl]\n  tokenizer: no-such-org/no-such-tokenizer\n")
    capsys.readouterr()
    assert main(["estimate", "--config_path", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no-such-org/no-such-tokenizer" in err and "--vocab_size" in err, err


_EXIT_CHILD = r"""
import atexit, sys, threading, time
from pathlib import Path
from lm_pipeline.launch import exit_now

out = Path(sys.argv[1])
atexit.register(lambda: out.write_text("atexit ran"))
sys.stdout.write("unflushed output without a newline")  # buffered: a bare os._exit would lose it
if sys.argv[2] == "thread":  # a non-daemon thread still writing: the process must wait for it
    threading.Thread(target=lambda: (time.sleep(0.5), out.with_suffix(".thread").write_text("done"))).start()
exit_now(3)
print(" / exit_now returned")
sys.exit(4)
"""


@pytest.mark.parametrize("mode", ["quiet", "thread"])
def test_exit_now_runs_atexit_and_flushes_but_waits_for_running_threads(tmp_path, mode):
    out = tmp_path / "marker"
    proc = subprocess.run([sys.executable, "-c", _EXIT_CHILD, str(out), mode], capture_output=True, text=True,
                          timeout=120)
    assert out.read_text() == "atexit ran"
    if mode == "quiet":  # left at once, with the code, after the handlers and the flush
        assert (proc.returncode, proc.stdout) == (3, "unflushed output without a newline")
    else:  # a thread was still running: the normal exit, which waits for it
        assert proc.returncode == 4 and proc.stdout.endswith("exit_now returned\n")
        assert out.with_suffix(".thread").read_text() == "done"
