"""Every documented Dagster instance keeps the template's limits (one step at a time in each pool,
two runs at a time): the template itself, each ``dagster.yaml`` shown in the docs (taken from the
pages as written), the home that the documented commands create, and the PostgreSQL instance of
docs/production.md loaded against a real server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml
from helpers import pipeline as pt

from assets.names import EVALUATION_POOL, TRAINING_POOL

REPO = pt.REPO
TEMPLATE = REPO / "assets" / "dagster.yaml"
PAGES = ("pipeline.md", "production.md")
_YAML = re.compile(r"```yaml\n(?P<body>.*?)```", re.S)
_BASH = re.compile(r"```bash\n(?P<body>.*?)```", re.S)


def documented_instances() -> dict[str, str]:
    """Each ``dagster.yaml`` shown in the docs (a YAML block with instance sections), by where it is."""
    out = {}
    for page in PAGES:
        text = (REPO / "docs" / page).read_text(encoding="utf-8")
        for i, m in enumerate(_YAML.finditer(text)):
            cfg = yaml.safe_load(m.group("body")) or {}
            if isinstance(cfg, dict) and {"storage", "telemetry", "concurrency", "run_queue"} & set(cfg):
                out[f"{page} block {i + 1}"] = m.group("body")
    return out


def _limits(cfg: dict) -> dict:
    return {"concurrency": cfg.get("concurrency"), "run_monitoring": cfg.get("run_monitoring")}


def test_the_template_and_every_documented_instance_file_have_the_limits(tmp_path, monkeypatch):
    from dagster._core.instance.config import dagster_instance_config

    template = yaml.safe_load(TEMPLATE.read_text())
    assert template["concurrency"]["pools"] == {"default_limit": 1, "granularity": "op"}
    assert template["concurrency"]["runs"] == {"max_concurrent_runs": 2}
    assert template["run_monitoring"]["enabled"] is True
    docs = documented_instances()
    assert any(name.startswith("production.md") for name in docs), docs
    for var in ("DAGSTER_PG_HOST", "DAGSTER_PG_PORT", "DAGSTER_PG_USER", "DAGSTER_PG_PASSWORD", "DAGSTER_PG_DB"):
        monkeypatch.setenv(var, "5432" if var.endswith("PORT") else "x")
    for name, body in {"assets/dagster.yaml": TEMPLATE.read_text(), **docs}.items():
        cfg = yaml.safe_load(body)
        assert "run_queue" not in cfg, f"{name}: the legacy run_queue: spelling (use concurrency: runs:)"
        assert _limits(cfg) == _limits(template), f"{name}: not the template's limits"
        home = tmp_path / re.sub(r"\W+", "_", name)
        home.mkdir()
        (home / "dagster.yaml").write_text(body)
        dagster_instance_config(str(home))  # Dagster's own schema check of the instance file


def _instance_limits(instance: dg.DagsterInstance) -> tuple[int | None, int | None, dict[str, int]]:
    conf = instance.get_concurrency_config()
    pools = {p: instance.event_log_storage.get_concurrency_info(p).limit for p in (TRAINING_POOL, EVALUATION_POOL)}
    return conf.pool_config.default_pool_limit, conf.run_queue_config.max_concurrent_runs, pools


def _setup_line(page: str) -> str:
    """The page's command that makes ``$DAGSTER_HOME`` (the first bash line that exports it)."""
    text = (REPO / "docs" / page).read_text(encoding="utf-8")
    for m in _BASH.finditer(text):
        for line in m.group("body").splitlines():
            if line.startswith("export DAGSTER_HOME="):
                return line.split("#", 1)[0].strip()
    raise AssertionError(f"docs/{page} shows no command that sets DAGSTER_HOME")


def test_the_documented_way_to_make_a_home_gives_an_instance_with_the_limits(tmp_path, monkeypatch):
    """docs/pipeline.md's first command, run as written in a copy of the repository's layout:
    plain ``dagster`` commands (``dagster dev``, ``dagster-daemon``) then read a home with the limits."""
    line = _setup_line("pipeline.md")
    assert "mkdir" not in line, line  # a home made by hand has none of the template's limits
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DAGSTER_HOME", None)
    done = subprocess.run(["bash", "-c", f"set -e; {line}; echo \"$DAGSTER_HOME\""], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    home = Path(done.stdout.strip().splitlines()[-1])
    assert home == tmp_path / ".dagster_home" and (home / "dagster.yaml").is_file()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    with dg.DagsterInstance.get() as instance:
        assert _instance_limits(instance) == (1, 2, {TRAINING_POOL: 1, EVALUATION_POOL: 1})


def test_python_m_assets_says_when_an_existing_home_has_no_limits(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    env = {**os.environ, "DAGSTER_HOME": str(home), "PYTHONPATH": str(REPO)}
    done = subprocess.run([pt.python(), "-m", "assets", "home"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == str(home)
    assert "sets no concurrency: pools: default_limit and no concurrency: runs: max_concurrent_runs" in done.stderr
    (home / "dagster.yaml").write_text(TEMPLATE.read_text())
    done = subprocess.run([pt.python(), "-m", "assets", "home"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "warning" not in done.stderr


def test_the_documented_postgresql_instance_has_the_limits(tmp_path, monkeypatch):
    """docs/production.md's dagster.yaml as written, its variables set to a throwaway server's."""
    from helpers.postgres import postgres_server

    body = next(b for n, b in documented_instances().items() if n.startswith("production.md"))
    with postgres_server() as server:
        home = tmp_path / "home"
        home.mkdir()
        (home / "dagster.yaml").write_text(body)
        for var, value in {"DAGSTER_PG_HOST": server.host, "DAGSTER_PG_PORT": str(server.port),
                           "DAGSTER_PG_USER": server.user, "DAGSTER_PG_PASSWORD": server.password,
                           "DAGSTER_PG_DB": server.db, "DAGSTER_HOME": str(home)}.items():
            monkeypatch.setenv(var, value)
        with dg.DagsterInstance.get() as instance:
            assert type(instance.run_storage).__name__ == "PostgresRunStorage"
            assert _instance_limits(instance) == (1, 2, {TRAINING_POOL: 1, EVALUATION_POOL: 1})
            assert instance.run_monitoring_enabled
        _pools_are_listed(home)


def _concurrency_get_all() -> str:
    dagster = str(Path(sys.executable).parent / "dagster")
    done = subprocess.run([dagster, "instance", "concurrency", "get", "--all"], capture_output=True, text=True,
                          timeout=120, env=os.environ.copy())
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _pools_are_listed(home: Path) -> None:
    """Before a step claims a slot Dagster lists no pool; ``python -m assets`` registers both at the
    default limit, keeping a limit set by hand, and then the CLI lists them."""
    from assets.__main__ import register_pools

    assert "No concurrency limits set" in _concurrency_get_all()
    with dg.DagsterInstance.get() as instance:
        instance.event_log_storage.set_concurrency_slots(EVALUATION_POOL, 4)  # raised by hand, as the docs say
        assert register_pools(instance) == [TRAINING_POOL]
        assert register_pools(instance) == []
    listed = _concurrency_get_all()
    assert f'"{TRAINING_POOL}": 0 / 1 slots occupied' in listed, listed
    assert f'"{EVALUATION_POOL}": 0 / 4 slots occupied' in listed, listed


@pytest.mark.parametrize("page", PAGES)
def test_no_page_shows_a_home_made_by_hand(page):
    text = (REPO / "docs" / page).read_text(encoding="utf-8")
    for m in _BASH.finditer(text):
        assert not re.search(r"mkdir[^\n]*DAGSTER_HOME", m.group("body")), f"docs/{page}: {m.group('body')}"
