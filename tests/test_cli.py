"""The command line's process start-up: tcmalloc re-execution for the long-running commands."""

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


def test_opt_out_and_quick_commands_do_not_reexecute():
    assert _run("train", LM_PIPELINE_NO_TCMALLOC="1").stdout.splitlines() == ["LD_PRELOAD="]
    assert _run("plan").stdout.splitlines() == ["LD_PRELOAD="]
