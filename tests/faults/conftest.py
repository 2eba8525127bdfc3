"""Shared machinery of the fault and bad-input suite (``pytest -m faults``).

* A tiny experiment (``experiment``): a few JSONL shards of stdlib source, a 1-layer GPT-2 with
  32 hidden units, a 300-token BPE, 6 training steps, and one uninterrupted reference run of the
  whole pipeline (``reference``) that every crash test compares with.
* ``run_stage``: one stage in its own process (``drive.py`` or the ``lm-pipeline`` CLI) with
  fault points armed (:mod:`lm_pipeline.faultpoints`) and a trace of the points it passed.
* The reliability record: every test carries ``@pytest.mark.reliability("<fault class>")`` and
  may ``note(what happened, what was lost)``; at the end of a session the results are written to
  ``tests/faults/last_run.json``, which ``report.py`` turns into the tables of docs/reliability.md.
  Only a run of the COMPLETE faults tier writes that committed record: every test file here
  collected, ``-m faults`` exactly, no ``-k``, no deselection, no node-id subset, not stopped
  early, every collected test reported. Any other run that ran faults-tier tests writes its record
  (marked ``"complete": false``, which report.py refuses to render) to
  ``$LM_PIPELINE_FAULTS_RESULTS`` if set, else to the ignored ``test-artifacts/faults/partial_run.json``,
  and says in one line why the committed record was not updated. ``$LM_PIPELINE_FAULTS_RESULTS``
  also redirects a complete run's record (then the committed one is left alone).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import pipeline as pt

from lm_pipeline import faultpoints
from lm_pipeline.steps import STAGE_NAMES

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

STAGES = STAGE_NAMES
RECORD = HERE / "last_run.json"  # committed: written only by a complete run of the faults tier
PARTIAL_RECORD = REPO / "test-artifacts" / "faults" / "partial_run.json"  # git-ignored
RESULTS_ENV = "LM_PIPELINE_FAULTS_RESULTS"
_REPORTED: set[str] = set()  # node ids whose run finished (teardown reported) in this session


# --------------------------------------------------------------------------- the record

def pytest_configure(config):
    config.addinivalue_line("markers", "reliability(kind): the fault or input class a test belongs to (docs/reliability.md)")
    config._faults_rows = []  # type: ignore[attr-defined]
    config._faults_t0 = time.time()  # type: ignore[attr-defined]
    config._faults_items = set()  # type: ignore[attr-defined]  # node ids here, after selection
    config._faults_files = set()  # type: ignore[attr-defined]  # the test files they came from
    config._faults_deselected = 0  # type: ignore[attr-defined]  # items here deselected (-k, -m, --deselect, --lf)
    _REPORTED.clear()
    config._faults_message = None  # type: ignore[attr-defined]
    if _faults_tier(config):  # the whole tier: the fuzzers run longer
        os.environ.setdefault("LM_PIPELINE_FUZZ_EXAMPLES", "500")


def _faults_tier(config) -> bool:
    expr = (config.getoption("markexpr", "") or "").replace("(", " ").replace(")", " ").split()
    return "faults" in expr and "not" not in expr[: expr.index("faults")][-1:]


def _here(path) -> bool:
    return Path(str(path)).resolve().is_relative_to(HERE)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The unmarked tests here are the fast subset of the default run; the faults tier
    (``-m faults``) runs them too, so the whole suite is one tier."""
    if not _faults_tier(config):
        return
    for item in items:
        if _here(item.fspath) and item.get_closest_marker("faults") is None:
            item.add_marker(pytest.mark.faults)
            item.user_properties.append(("fast_subset", True))


def pytest_deselected(items):
    for item in items:
        if _here(item.fspath):
            item.config._faults_deselected += 1


def pytest_collection_finish(session):
    for item in session.items:
        if _here(item.fspath):
            session.config._faults_items.add(item.nodeid)
            session.config._faults_files.add(Path(str(item.fspath)).resolve())


def pytest_runtest_logreport(report):
    if report.when == "teardown":  # the last phase: the test's run finished (whatever its outcome)
        _REPORTED.add(report.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    mark = item.get_closest_marker("reliability")
    if mark is None:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        row = {"nodeid": item.nodeid, "kind": mark.args[0], "outcome": report.outcome,
               "faults_tier": item.get_closest_marker("faults") is not None,
               "fast_subset": any(k == "fast_subset" for k, _ in item.user_properties),
               "seconds": round(report.duration, 2), "notes": [v for k, v in item.user_properties if k == "note"]}
        if report.skipped:
            row["reason"] = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        elif report.failed:
            row["reason"] = str(report.longrepr).splitlines()[-1][:300] if report.longrepr else ""
        item.config._faults_rows.append(row)


def partial_reasons(config, exitstatus) -> list[str]:
    """Why this session is not a run of the complete faults tier (empty: it is one)."""
    why = []
    markexpr = " ".join((config.getoption("markexpr", "") or "").split())
    if markexpr != "faults":
        why.append(f"marker expression {markexpr!r} is not exactly 'faults'")
    if config.getoption("keyword", "") or "":
        why.append(f"-k {config.getoption('keyword')!r}")
    for arg in config.args:
        path, sep, _ = str(arg).partition("::")
        if sep and _here(Path(config.invocation_params.dir, path)):
            why.append(f"node-id selection {arg!r}")
    files = {p.resolve() for p in HERE.rglob("test_*.py")} | {p.resolve() for p in HERE.rglob("*_test.py")}
    missing = sorted(str(p.relative_to(HERE)) for p in files - config._faults_files)
    if missing:
        why.append(f"not collected: {', '.join(missing)}")
    if config._faults_deselected:
        why.append(f"{config._faults_deselected} test(s) in tests/faults deselected")
    if int(exitstatus) == int(pytest.ExitCode.INTERRUPTED):
        why.append("the session was interrupted")
    unreported = config._faults_items - _REPORTED
    if unreported:
        why.append(f"{len(unreported)} of {len(config._faults_items)} collected test(s) never ran to the end "
                   "(-x / --maxfail stop, or a crash)")
    return why


def _show(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    rows = getattr(config, "_faults_rows", [])
    if not any(r["faults_tier"] for r in rows):  # no faults-tier test ran: no record of any kind
        return
    why = partial_reasons(config, exitstatus)
    record = {"markexpr": config.getoption("markexpr", "") or "",
              "seconds": round(time.time() - config._faults_t0, 1), "exitstatus": int(exitstatus),
              "complete": not why}
    if why:
        record["partial"] = "; ".join(why)
    record["rows"] = rows
    explicit = os.environ.get(RESULTS_ENV)
    target = Path(explicit) if explicit else (PARTIAL_RECORD if why else RECORD)
    if why and target.resolve() == RECORD.resolve():  # never, not even when asked to
        target = PARTIAL_RECORD
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(record, indent=1) + "\n")
    if why:
        msg = (f"faults record: {_show(RECORD)} NOT updated: not a complete faults-tier run ({record['partial']}); "
               f"this run's partial record is {_show(target)}")
    elif target.resolve() != RECORD.resolve():
        msg = f"faults record: complete faults-tier run written to {_show(target)} (${RESULTS_ENV}); {_show(RECORD)} left alone"
    else:
        msg = f"faults record: {_show(RECORD)} updated from the complete faults tier ({len(rows)} recorded tests)"
    config._faults_message = msg
    if config.pluginmanager.get_plugin("terminalreporter") is None:
        print(msg, file=sys.stderr)


def pytest_terminal_summary(terminalreporter, config):
    msg = getattr(config, "_faults_message", None)
    if msg:
        terminalreporter.write_line(msg)


@pytest.fixture
def note(request):
    """``note(what happened, lost="nothing", cases=1)``: a line for this test in the reliability
    table (``cases``: how many cases the line stands for, e.g. hypothesis examples)."""

    def add(what: str, lost: str = "nothing", cases: int = 1) -> None:
        request.node.user_properties.append(("note", {"what": what, "lost": lost, "cases": cases}))

    return add


# --------------------------------------------------------------------------- the experiment

@dataclass
class Experiment:
    root: Path
    config: Path  # the YAML every process loads (store root overridden per run)
    reference: Path  # the store of the uninterrupted run

    def store(self, name: str) -> Path:
        return self.root / name / "store"


def _tiny_config(tmp: Path) -> dict[str, Any]:
    cfg = pt.tiny_config(tmp)
    cfg["trainer"].update({"num_train_steps": 6, "steps_per_eval": 3, "log_every": 1,
                           "checkpointer": {"save_interval": "10m", "keep": [{"every": 2}]}})
    cfg["eval"] = {"batch_size": 2, "max_eval_batches": 3}
    return cfg


_JAX_CACHE: dict[str, str] = {}  # the session's persistent compilation cache (set by ``experiment``)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("LM_PIPELINE_FAULTPOINT") and k != "LM_PIPELINE_CACHE_FAULT"}
    env.update({"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
    if _JAX_CACHE:  # compile once per session, not once per process (same executables: same bits)
        env.update({"JAX_COMPILATION_CACHE_DIR": _JAX_CACHE["dir"], "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})
    env.update(extra or {})
    return env


@dataclass
class StageRun:
    returncode: int
    output: str
    trace: list[str]  # the fault points the process passed, in order
    killed: bool

    def passed(self, point: str) -> int:
        return self.trace.count(point)


def run_stage(exp: Experiment, store: Path, stage: str, *, fault: str | None = None, action: str = "kill",
              cli: bool = False, env: dict[str, str] | None = None, timeout: float = 240,
              kill_when=None, trace: Path | None = None, overrides: tuple[str, ...] = (),
              wait: bool = True, nonfinite_steps: str | None = None):
    """Run ``stage`` over ``store`` in a new process. ``fault``: ``point[:N]`` to arm; ``cli``: run
    ``lm-pipeline train`` instead of drive.py (train_ckpt only); ``nonfinite_steps``: with ``cli``,
    the comma-separated 1-based train steps made NaN (``tests/helpers/nonfinite.py``);
    ``kill_when``: a callable polled every 10 ms whose truth makes the test SIGKILL the process
    (kill when a file appears)."""
    trace = trace or store.parent / f"trace-{time.monotonic_ns()}.txt"
    store.parent.mkdir(parents=True, exist_ok=True)
    extra = {faultpoints.ENV_TRACE: str(trace), **(env or {})}
    if fault:
        extra.update({faultpoints.ENV: fault, faultpoints.ENV_ACTION: action})
    overrides = ["--store.root", str(store), *overrides]
    if cli:
        assert stage == "train_ckpt"
        entry = ["helpers.nonfinite", nonfinite_steps] if nonfinite_steps else ["lm_pipeline.cli"]
        cmd = [sys.executable, "-m", *entry, "train", "--config_path", str(exp.config), *overrides]
    else:
        cmd = [sys.executable, str(HERE / "drive.py"), str(exp.config), stage, *overrides]
    proc = subprocess.Popen(cmd, cwd=exp.root, env=child_env(extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    if not wait:  # the caller collects it with finish()
        proc.trace = trace  # type: ignore[attr-defined]
        return proc
    return finish(proc, trace, timeout, kill_when)


def finish(proc: subprocess.Popen, trace: Path | None = None, timeout: float = 240, kill_when=None) -> StageRun:
    """Wait for a process started by ``run_stage(wait=False)``."""
    trace = trace or proc.trace  # type: ignore[attr-defined]
    killed = False
    try:
        if kill_when is not None:
            deadline = time.time() + timeout
            while proc.poll() is None and time.time() < deadline:
                if kill_when():
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed = True
                    break
                time.sleep(0.01)
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    passed = trace.read_text().split() if trace.exists() else []
    return StageRun(proc.returncode, out, passed, killed or proc.returncode == -signal.SIGKILL)


def copy_store(src: Path, dst: Path, drop: tuple[str, ...] = ()) -> Path:
    """A copy of the store ``src`` at ``dst`` without the artifacts of the ``drop`` stages."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*(d for d in drop), ".*.lock"))
    return dst


def artifact_dir(store: Path, stage: str) -> Path | None:
    """The one artifact directory of ``stage`` in ``store`` (None if there is none)."""
    found = [p for p in (store / stage).iterdir() if p.is_dir() and not p.name.startswith(".")] if (store / stage).exists() else []
    assert len(found) <= 1, found
    return found[0] if found else None


def files(path: Path, *, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every file under ``path``: relative name -> bytes (names in ``skip`` left out)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name not in skip}


@pytest.fixture(scope="session")
def experiment(tmp_path_factory) -> Experiment:
    """The tiny experiment and its uninterrupted reference run (all six stages)."""
    root = tmp_path_factory.mktemp("faults")
    _JAX_CACHE["dir"] = str(root / "jax-cache")
    cfg = _tiny_config(root)
    config = root / "tiny.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    exp = Experiment(root, config, root / "reference" / "store")
    for stage in ("hf_export", "eval_report"):
        res = run_stage(exp, exp.reference, stage)
        assert res.returncode == 0, res.output[-3000:]
    return exp


def final_params(run_dir: Path) -> dict[str, Any]:
    """The model arrays of the run's latest complete checkpoint, by dotted key."""
    import jax
    import numpy as np

    from lm_pipeline.train.checkpoint import latest_checkpoint, load, read_metadata

    path = latest_checkpoint(str(run_dir))
    assert path is not None, f"no complete checkpoint under {run_dir}"
    arrays = read_metadata(path)["state"]["arrays"]
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tree: dict = {}
    for key, v in sorted(arrays.items()):
        if not key.startswith("model."):
            continue
        node = tree
        *parents, leaf = key[len("model."):].split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = jax.ShapeDtypeStruct(tuple(v["shape"]), np.dtype(v["dtype"]), sharding=device)
    loaded = load(path, tree, subtree="model")
    flat = jax.tree_util.tree_flatten_with_path(loaded)[0]
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat} | {"__step__": read_metadata(path)["step"]}
