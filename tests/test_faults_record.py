"""The committed reliability record (tests/faults/last_run.json) is written only by a run of the
complete faults tier; a partial run leaves it byte-for-byte alone, says so, and writes a record
marked partial elsewhere, which tests/faults/report.py refuses to render.

Cheap: a real partial selection of one fast test, and a copy of the faults conftest over a fake
faults folder of three trivial tests (each pytest in its own process, well under a second each
but the real one).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FAULTS = REPO / "tests" / "faults"
MESSAGE = "faults record:"

FAKE_A = '''
import os
import pytest

@pytest.mark.faults
@pytest.mark.reliability("tiny class")
def test_one(note):
    note("ran", lost="nothing")

@pytest.mark.reliability("tiny class")  # unmarked: the fast subset, which -m faults runs too
def test_fast_subset():
    assert os.environ.get("FAKE_FAIL") != "1"
'''
FAKE_B = '''
import pytest

@pytest.mark.faults
@pytest.mark.reliability("other class")
def test_two():
    pass
'''
COMMITTED = b'{"markexpr": "faults", "complete": true, "rows": ["the committed record"]}\n'


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LM_PIPELINE_FAULTS_RESULTS", "PYTEST_ADDOPTS", "FAKE_FAIL") and not k.startswith("PYTEST_XDIST")}
    return {**env, **extra}


def _pytest(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    # no third-party plugins (hypothesis alone costs a second a process) but pytest-timeout's marker
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "pytest_timeout", "-q",
                           *args], cwd=cwd, env=_env(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", **env),
                          capture_output=True, text=True, timeout=120)


def _lines(out: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith(MESSAGE)]


@pytest.fixture
def fake(tmp_path) -> Path:
    """tmp/tests/faults: the real faults conftest over three trivial tests and a fake committed record."""
    faults = tmp_path / "tests" / "faults"
    faults.mkdir(parents=True)
    shutil.copy(FAULTS / "conftest.py", faults / "conftest.py")
    shutil.copytree(REPO / "tests" / "helpers", tmp_path / "tests" / "helpers",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (faults / "test_a.py").write_text(textwrap.dedent(FAKE_A))
    (faults / "test_b.py").write_text(textwrap.dedent(FAKE_B))
    (faults / "last_run.json").write_bytes(COMMITTED)
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers\npythonpath = tests\nmarkers =\n"
                                         "    faults: fault suite\n    slow: slow\n")
    return tmp_path


PARTIAL = {
    "one file": (["-m", "faults", "tests/faults/test_a.py"], {}, "not collected: test_b.py"),
    "-k": (["-m", "faults", "-k", "one or two", "tests/faults"], {}, "-k 'one or two'"),
    "marker expression": (["-m", "faults or slow", "tests/faults"], {}, "not exactly 'faults'"),
    "node ids": (["-m", "faults", "tests/faults/test_a.py::test_one", "tests/faults/test_b.py"], {},
                 "node-id selection 'tests/faults/test_a.py::test_one'"),
    "--deselect": (["-m", "faults", "--deselect", "tests/faults/test_b.py::test_two", "tests/faults"], {},
                   "1 test(s) in tests/faults deselected"),
    "-x stop": (["-m", "faults", "-x", "tests/faults"], {"FAKE_FAIL": "1"}, "1 of 3 collected test(s) never ran"),
}


@pytest.mark.parametrize("case", list(PARTIAL))
def test_partial_faults_run_leaves_the_committed_record_alone(fake, case):
    args, env, why = PARTIAL[case]
    out = _pytest(fake, *args, **env)
    assert out.returncode in (0, 1), out.stdout[-3000:] + out.stderr[-3000:]
    assert (fake / "tests" / "faults" / "last_run.json").read_bytes() == COMMITTED
    (line,) = _lines(out)
    assert "tests/faults/last_run.json NOT updated" in line and why in line, line
    partial = json.loads((fake / "test-artifacts" / "faults" / "partial_run.json").read_text())
    assert partial["complete"] is False and why in partial["partial"]


def test_complete_faults_run_writes_the_committed_record(fake):
    out = _pytest(fake, "-m", "faults", "tests/faults")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    record = json.loads((fake / "tests" / "faults" / "last_run.json").read_text())
    assert record["complete"] is True and "partial" not in record and record["markexpr"] == "faults"
    assert sorted(r["nodeid"] for r in record["rows"]) == [
        "tests/faults/test_a.py::test_fast_subset", "tests/faults/test_a.py::test_one", "tests/faults/test_b.py::test_two"]
    assert all(r["outcome"] == "passed" and r["faults_tier"] for r in record["rows"])
    (line,) = _lines(out)
    assert "tests/faults/last_run.json updated from the complete faults tier (3 recorded tests)" in line, line


def test_results_env_takes_partial_records_but_never_into_the_committed_file(fake, tmp_path):
    mine = tmp_path / "mine.json"
    out = _pytest(fake, "-m", "faults", "tests/faults/test_b.py", LM_PIPELINE_FAULTS_RESULTS=str(mine))
    assert out.returncode == 0, out.stdout[-3000:]
    assert json.loads(mine.read_text())["complete"] is False and "mine.json" in _lines(out)[0]
    committed = fake / "tests" / "faults" / "last_run.json"
    out = _pytest(fake, "-m", "faults", "tests/faults/test_b.py", LM_PIPELINE_FAULTS_RESULTS=str(committed))
    assert out.returncode == 0, out.stdout[-3000:]
    assert committed.read_bytes() == COMMITTED and "NOT updated" in _lines(out)[0]
    # report.py refuses a partial record: one line, exit 2, the doc untouched
    doc = (REPO / "docs" / "reliability.md").read_bytes()
    rep = subprocess.run([sys.executable, str(FAULTS / "report.py"), "--record", str(mine)], capture_output=True,
                         text=True, timeout=60)
    assert rep.returncode == 2 and rep.stdout == "" and len(rep.stderr.strip().splitlines()) == 1, rep
    assert "refusing" in rep.stderr and (REPO / "docs" / "reliability.md").read_bytes() == doc


def test_real_partial_faults_selection_keeps_the_committed_record_bytes():
    """The regression itself: ``pytest -m faults <one file> -k <one case>`` over the real suite
    (its partial record goes to the git-ignored test-artifacts/faults/partial_run.json)."""
    guarded = [FAULTS / "last_run.json", REPO / "docs" / "reliability.md"]
    before = {p: p.read_bytes() for p in guarded}
    try:
        out = _pytest(REPO, "-m", "faults", "-o", "addopts=-ra --strict-markers", "tests/faults/test_bad_inputs.py",
                      "-k", "empty.jsonl and skip")
        assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
        assert {p: p.read_bytes() for p in guarded} == before, "a partial run rewrote the committed record"
        (line,) = _lines(out)
        assert "NOT updated" in line and "-k 'empty.jsonl and skip'" in line, line
        partial = json.loads((REPO / "test-artifacts" / "faults" / "partial_run.json").read_text())
        assert partial["complete"] is False and [r["nodeid"] for r in partial["rows"]] == [
            "tests/faults/test_bad_inputs.py::test_hostile_shard_is_handled_per_policy[empty.jsonl-skip]"]
    finally:  # never leave a damaged record behind, even when the check above failed
        for p, data in before.items():
            if p.read_bytes() != data:
                p.write_bytes(data)
