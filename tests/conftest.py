"""Suite-wide rules (every tier).

No silent skips in CI: when the environment has ``CI=true`` (``.ci/run`` exports it), a test that
skips FAILS instead, with the skip's reason. A skip usually means that something a tier needs is
missing (the browser and chromedriver, a C++ compiler, a system library, an optional Python
package), and CI must say so rather than pass without having run it. A skip that is legitimate on
the CI machine too (it can never run there, and nothing is missing) is allowed explicitly, in code::

    @pytest.mark.allow_skip_in_ci(reason="why this skip is not a missing dependency")

Expected failures (``xfail``) are not skips and are left alone. Outside CI nothing changes.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# One persistent XLA compilation cache for the session and the processes it starts: many tests
# build the same tiny train step again (a resumed run, a one-process reference, a CLI re-run), and
# a cache hit skips its compile. Compiled programs are keyed by JAX on their HLO, options, backend
# and versions, so a hit is the same program; a fresh directory per session keeps runs apart.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="lm_pipeline_test_xla_cache_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

ALLOW = "allow_skip_in_ci"


def ci() -> bool:
    """Whether this is a CI run (``$CI`` is ``true``, ``1`` or ``yes``, as CI services set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"{ALLOW}(reason): this test may skip under CI=true (the skip is legitimate on the CI "
        "machine, not a missing dependency); every other skip fails under CI=true")


def pytest_report_header(config):
    if ci():
        return "CI=true: a skipped test fails unless marked allow_skip_in_ci(reason=...)"
    return None


def _skip_reason(longrepr) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr or "")


def _failure(reason: str) -> str:
    return (f"skipped under CI=true, which fails in CI: {reason} -- install what is missing (scripts/setup.sh, "
            f"scripts/install_browser.sh) or, if the skip is legitimate on the CI machine, mark the test "
            f"@pytest.mark.{ALLOW}(reason=...)")


@pytest.hookimpl(hookwrapper=True, trylast=True)  # innermost: other wrappers see the final outcome
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail") or not ci():
        return
    mark = item.get_closest_marker(ALLOW)
    if mark is not None:
        if (mark.kwargs.get("reason") or (mark.args[0] if mark.args else "")).strip():
            return
        report.outcome = "failed"
        report.longrepr = f"@pytest.mark.{ALLOW} needs a reason=... saying why the skip is legitimate in CI"
        return
    report.outcome = "failed"
    report.longrepr = _failure(_skip_reason(report.longrepr))


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_make_collect_report(collector):
    """A whole module skipped at import (``pytest.importorskip`` or ``pytest.skip(allow_module_level=True)``
    at module level) fails too: it becomes a collection error naming the reason."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and ci():
        report.outcome = "failed"
        report.longrepr = _failure(_skip_reason(report.longrepr))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Ray's native core worker (``_raylet.so``) can crash (SIGSEGV) in interpreter finalization of
    a process that was a Ray driver, after every test has passed and the summary is printed, which
    turns a passing run's exit status into 139. When Ray was used here, disconnect from it and end
    the process with pytest's own exit status, skipping only the finalization."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not hasattr(ray, "is_initialized"):
        return
    if ray.is_initialized():
        ray.shutdown()
    session = getattr(config, "_lm_session", None)
    status = int(getattr(session, "exitstatus", 0) or 0) if session is not None else None
    if status is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    session.config._lm_session = session
