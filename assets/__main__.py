"""``python -m assets``: the Dagster CLI on this code location with a persistent local instance.

Dagster picks its instance from ``$DAGSTER_HOME`` before it loads any code; without it the CLI
uses a temporary instance that is deleted on exit. This wrapper sets ``DAGSTER_HOME`` to
``<repo>/.dagster_home`` when it is unset (creating it, with a dagster.yaml for SQLite storage),
so lineage and history persist with nothing exported::

    python -m assets materialize          # every experiment and the comparison (dagster job execute -j pipeline)
    python -m assets materialize --select train_ckpt            # the default experiment's training (dagster asset materialize)
    python -m assets materialize --select "*llama/train_ckpt"   # any selection
    python -m assets dev [-p 3000]        # the UI and daemon (sensors, schedules): dagster dev
    python -m assets home                 # create the instance directory (dagster.yaml: pools, run limits) and print it
    python -m assets dagster ARGS...      # any other dagster command, same instance

Before ``materialize`` and ``dev`` start Dagster, runs whose process is gone (killed) are marked
failed and their pool slots freed, and each run still holding a pool slot is named in one line
(:mod:`assets.dead_runs`), and the pools get their rows at the instance's default limit
(:func:`register_pools`: `dagster instance concurrency get --all` lists them). An existing ``$DAGSTER_HOME/dagster.yaml`` is kept; when it sets
none of the template's limits (one step per pool, two runs at a time) one line says so
(:func:`missing_limits`).

The experiments are the files of ``configs/experiments/`` (``$LM_PIPELINE_EXPERIMENTS_DIR``), or
the one file ``$LM_PIPELINE_EXPERIMENT``, with ``$LM_PIPELINE_OVERRIDES``; see :mod:`assets.experiment`.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_HOME = REPO_ROOT / ".dagster_home"
TEMPLATE = Path(__file__).resolve().parent / "dagster.yaml"
MODULE = "assets.definitions"
JOB = "pipeline"


def ensure_home(environ: dict[str, str] | None = None) -> Path:
    """``$DAGSTER_HOME`` (made absolute), else ``<repo>/.dagster_home``; created with a dagster.yaml."""
    env = os.environ if environ is None else environ
    home = Path(env.get("DAGSTER_HOME") or DEFAULT_HOME).expanduser().resolve()
    home.mkdir(parents=True, exist_ok=True)
    cfg = home / "dagster.yaml"
    if not cfg.exists() and TEMPLATE.exists():
        shutil.copyfile(TEMPLATE, cfg)
    env["DAGSTER_HOME"] = str(home)
    return home


def missing_limits(config: Any) -> list[str]:
    """The template's limits that an instance config (a parsed dagster.yaml) does not set: a default
    pool limit and a run limit (``concurrency:``; ``run_queue: max_concurrent_runs`` also counts)."""
    cfg = config if isinstance(config, dict) else {}
    conc = cfg.get("concurrency") if isinstance(cfg.get("concurrency"), dict) else {}
    pools = conc.get("pools") if isinstance(conc.get("pools"), dict) else {}
    runs = conc.get("runs") if isinstance(conc.get("runs"), dict) else {}
    queue = cfg.get("run_queue") if isinstance(cfg.get("run_queue"), dict) else {}
    missing = []
    if pools.get("default_limit") is None and conc.get("default_op_concurrency_limit") is None:
        missing.append("concurrency: pools: default_limit")
    if runs.get("max_concurrent_runs") is None and queue.get("max_concurrent_runs") is None:
        missing.append("concurrency: runs: max_concurrent_runs")
    return missing


def warn_missing_limits(home: Path) -> None:
    """One line on stderr when ``home``'s dagster.yaml sets none of the template's limits."""
    import yaml

    cfg = home / "dagster.yaml"
    try:
        missing = missing_limits(yaml.safe_load(cfg.read_text(encoding="utf-8")) or {})
    except (OSError, yaml.YAMLError):
        return
    if missing:
        print(f"warning: {cfg} sets no {' and no '.join(missing)}: trainings and evaluations may run at once; "
              f"copy the concurrency section of {TEMPLATE} into it", file=sys.stderr)


def register_pools(instance: Any) -> list[str]:
    """Give each of the project's pools its row in ``instance`` at the instance's default pool
    limit when it has none yet, and return those registered. Dagster creates a pool's row only when
    a step first claims a slot, so until then ``dagster instance concurrency get --all`` lists no
    pool; a limit set already (``dagster instance concurrency set``) is kept. Nothing on a storage
    without pool limits or an instance without a default limit."""
    from assets.names import POOLS

    storage = instance.event_log_storage
    limit = instance.get_concurrency_config().pool_config.default_pool_limit
    if limit is None or not storage.supports_global_concurrency_limits:
        return []
    have = set(storage.get_concurrency_keys())
    new = [pool for pool in POOLS.values() if pool not in have]
    for pool in new:
        storage.set_concurrency_slots(pool, limit)
    return new


def dagster_args(argv: list[str]) -> list[str] | None:
    """The ``dagster`` command line for ``python -m assets ARGS`` (None: handled here)."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        return None
    cmd, rest = argv[0], argv[1:]
    if cmd == "materialize":
        if any(a == "--select" or a.startswith("--select=") for a in rest):
            return ["asset", "materialize", "-m", MODULE, *rest]
        return ["job", "execute", "-m", MODULE, "-j", JOB, *rest]
    if cmd == "dev":
        return ["dev", "-m", MODULE, *rest]
    if cmd == "dagster":
        return rest
    if cmd == "home":
        return None
    raise SystemExit(f"unknown command {cmd!r}; use materialize, dev, home or dagster (see python -m assets --help)")


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m assets ARGS``: print help or the home, else become the ``dagster`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = dagster_args(argv)
    if args is None:
        if argv and argv[0] == "home":
            home = ensure_home()
            warn_missing_limits(home)
            print(home)
            return 0
        print(__doc__)
        return 0
    home = ensure_home()
    print(f"DAGSTER_HOME={home}", file=sys.stderr)
    warn_missing_limits(home)
    if argv[0] in ("materialize", "dev"):
        # A run killed earlier (its process gone) still holds its pool slots: free them, and say
        # who holds the slots this command's steps may wait for (assets/dead_runs.py).
        import dagster as dg

        from assets.dead_runs import check

        check()
        with dg.DagsterInstance.get() as instance:
            register_pools(instance)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # exec discards what is still buffered
    # Dagster's CLI has no public Python API: its public entry point is the `dagster` command,
    # which `python -m dagster` is. This process becomes it (same pid: signals reach it directly).
    os.execv(sys.executable, [sys.executable, "-m", "dagster", *args])


if __name__ == "__main__":
    raise SystemExit(main())
