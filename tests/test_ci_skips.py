"""tests/conftest.py: under CI=true a skip fails the test (a missing browser, compiler, library or
package must not pass silently), unless the test is marked ``allow_skip_in_ci(reason=...)``.
Outside CI a skip stays a skip. One pytest process per case over a tiny folder (well under a second)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT_CONFTEST = Path(__file__).resolve().parent / "conftest.py"

CASES = '''
import pytest

def test_runtime_skip():
    pytest.skip("/usr/bin/chromium not installed")

@pytest.mark.skipif(True, reason="needs a C++ compiler")
def test_skipif():
    pass

def test_importorskip():
    pytest.importorskip("surely_not_an_installed_module")

@pytest.fixture
def needs_thing():
    pytest.skip("no thing here")

def test_fixture_skip(needs_thing):
    pass

@pytest.mark.allow_skip_in_ci(reason="can never run on the CI machine")
def test_allowed():
    pytest.skip("platform")

@pytest.mark.allow_skip_in_ci
def test_allowed_without_reason():
    pytest.skip("platform")

@pytest.mark.xfail(reason="known bug", strict=True)
def test_xfail():
    assert False

def test_passes():
    pass
'''
MODULE_SKIP = 'import pytest\npytest.importorskip("surely_not_an_installed_module")\n\ndef test_never():\n    pass\n'


def _run(tmp_path: Path, ci: str | None) -> dict[str, str]:
    shutil.copy(ROOT_CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    if ci is not None:
        env["CI"] = ci
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--junitxml", "out.xml",
                    "--continue-on-collection-errors"],
                   cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    outcomes = {}
    for case in ET.parse(tmp_path / "out.xml").iter("testcase"):
        kinds = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
        name = case.get("name") or ""
        if case.get("classname", "").endswith("test_module_skip") or "test_module_skip" in name:
            name = "module"
        outcomes[name] = kinds[0] if kinds else "passed"
    return outcomes


def test_under_ci_every_skip_fails_unless_allowed(tmp_path):
    got = _run(tmp_path, "true")
    assert got == {
        "test_runtime_skip": "failure", "test_skipif": "error", "test_importorskip": "failure",
        "test_fixture_skip": "error", "test_allowed": "skipped", "test_allowed_without_reason": "failure",
        "test_xfail": "skipped",  # junit's name for xfailed: untouched
        "test_passes": "passed", "module": "error"}, got


def test_outside_ci_skips_stay_skips(tmp_path):
    got = _run(tmp_path, None)
    assert {k for k, v in got.items() if v == "skipped"} == {
        "test_runtime_skip", "test_skipif", "test_importorskip", "test_fixture_skip", "test_allowed",
        "test_allowed_without_reason", "test_xfail", "module"}, got
    assert got["test_passes"] == "passed"


@pytest.mark.parametrize("value", ["false", "0", ""])
def test_ci_false_is_not_ci(tmp_path, value):
    assert _run(tmp_path, value)["test_runtime_skip"] == "skipped"
