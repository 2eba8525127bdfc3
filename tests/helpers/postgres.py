"""A throwaway PostgreSQL server for tests, on loopback, and a Dagster instance home that uses it.

::

    from helpers.postgres import pg_server, pg_database  # noqa: F401  (pytest fixtures)

    def test_something(pg_database, tmp_path):
        home = postgres_dagster_home(tmp_path, pg_database)
        instance = dg.DagsterInstance.from_config(str(home))  # runs, event logs, schedules in Postgres

or, outside a fixture, ``with postgres_server() as server: ...``.

The server is the machine's own PostgreSQL (``initdb``, ``pg_ctl``, ``postgres`` from
``$LM_PIPELINE_PG_BIN`` when set, else ``PATH``, else ``/usr/lib/postgresql/<version>/bin``): a fresh cluster in
a temporary directory (``initdb``), started by ``pg_ctl`` on ``127.0.0.1`` and a free port, with
its socket in that directory, and stopped (``pg_ctl stop -m fast``) and deleted on exit, also
when the test fails (a server whose test process was killed outright is stopped by the next
start). TCP logins need the password (scram-sha-256), so configs that pass it
through an environment variable are really checked; ``fsync`` is off (the data is thrown away).
Start-up takes about a second.

PostgreSQL refuses to run as root (``initdb`` and ``postgres`` exit with an error). As root, the
cluster belongs to an unprivileged system user (``postgres`` when it exists, else ``nobody``)
and every server command runs as that user (``subprocess`` ``user=`` / ``group=``: setuid in the
child, no ``sudo`` / ``runuser`` needed); the test process connects over TCP as usual.

Missing binaries: outside CI the fixtures skip, saying how to install them. Under ``CI=true``
they run ``scripts/install_postgres.sh`` (Debian packages) once, and fail, with its output, if
the binaries are still missing.
"""

from __future__ import annotations

import functools
import glob
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = REPO / "scripts" / "install_postgres.sh"
BINARIES = ("initdb", "pg_ctl", "postgres")
SUPERUSER = "postgres"
SCHEME = "postgresql+psycopg2"  # SQLAlchemy 2.1's bare postgresql:// means psycopg 3, not installed
_STOP_TIMEOUT_S = 30
_START_TIMEOUT_S = 60


def ci() -> bool:
    """``$CI`` is ``true`` / ``1`` / ``yes`` (as tests/conftest.py decides)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


# --------------------------------------------------------------------------------------------
# finding (and in CI installing) the binaries
# --------------------------------------------------------------------------------------------


def _has_binaries(d: Path) -> bool:
    return all(os.access(d / b, os.X_OK) and (d / b).is_file() for b in BINARIES)


def _version_key(d: str) -> tuple[int, ...]:
    m = re.search(r"/postgresql/([\d.]+)/bin$", d)
    return tuple(int(x) for x in m.group(1).split(".") if x) if m else ()


def find_postgres_bin() -> Path | None:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres`` (one installation), or None.

    ``$LM_PIPELINE_PG_BIN`` when set (only that directory); else the directory of ``pg_ctl`` on
    ``PATH`` (symlinks resolved, so ``/usr/local/bin/pg_ctl -> /usr/lib/postgresql/15/bin/pg_ctl``
    gives the real one, with its own ``postgres`` beside it); else the newest
    ``/usr/lib/postgresql/*/bin`` (Debian and Ubuntu keep the server binaries off ``PATH``)."""
    forced = os.environ.get("LM_PIPELINE_PG_BIN")
    if forced:
        return Path(forced) if _has_binaries(Path(forced)) else None
    candidates: list[Path] = []
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(Path(os.path.realpath(on_path)).parent)
    candidates += [Path(d) for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version_key, reverse=True)]
    return next((d for d in candidates if _has_binaries(d)), None)


@functools.lru_cache(maxsize=1)
def _install() -> str:
    """Run scripts/install_postgres.sh once per process; its exit status and output."""
    try:
        done = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=1200)
    except subprocess.TimeoutExpired as e:
        return f"{INSTALL_SCRIPT.name} timed out after {e.timeout:.0f} s"
    return f"{INSTALL_SCRIPT.name} exit {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"


def require_postgres_bin() -> Path:
    """The PostgreSQL binaries' directory; else skip (outside CI) or install them and, failing that,
    fail (under ``CI=true``)."""
    found = find_postgres_bin()
    if found is not None:
        return found
    where = ("$LM_PIPELINE_PG_BIN=" + os.environ["LM_PIPELINE_PG_BIN"]) if os.environ.get("LM_PIPELINE_PG_BIN") \
        else "PATH or /usr/lib/postgresql/*/bin"
    missing = f"PostgreSQL server binaries ({', '.join(BINARIES)}) not found on {where}"
    if not ci():
        pytest.skip(f"{missing}; install them with `bash scripts/install_postgres.sh` (Debian/Ubuntu: "
                    f"apt-get install postgresql) or point LM_PIPELINE_PG_BIN at their directory")
    report = _install()
    found = find_postgres_bin()
    if found is None:
        pytest.fail(f"{missing}, and scripts/install_postgres.sh could not install them (CI=true):\n{report}",
                    pytrace=False)
    return found


# --------------------------------------------------------------------------------------------
# the server
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PostgresServer:
    """Connection parameters of a running throwaway server (one database of it: ``db``)."""

    host: str
    port: int
    user: str
    password: str
    db: str
    data_dir: Path
    bin_dir: Path

    @property
    def url(self) -> str:
        """``postgresql://user:password@host:port/db``: a libpq URL (psycopg2, ``psql``; libpq also
        takes ``postgres://``)."""
        return f"postgresql://{self.user}:{self.password}@{self.host}:{self.port}/{self.db}"

    @property
    def sqlalchemy_url(self) -> str:
        """The URL for SQLAlchemy, and so for Dagster's ``postgres_url``: ``postgresql+psycopg2://...``.
        The driver must be named: SQLAlchemy 2.1 maps a bare ``postgresql://`` to psycopg 3, which is
        not installed (dagster-postgres installs psycopg2)."""
        return f"{SCHEME}://{self.user}:{self.password}@{self.host}:{self.port}/{self.db}"

    @property
    def dsn(self) -> dict[str, Any]:
        """Keyword arguments for ``psycopg2.connect``."""
        return {"host": self.host, "port": self.port, "user": self.user, "password": self.password,
                "dbname": self.db}

    def connect(self, **overrides: Any):
        """A psycopg2 connection to this database (``overrides`` replace ``dsn`` entries)."""
        import psycopg2

        return psycopg2.connect(**{**self.dsn, **overrides})

    def query(self, sql: str, params: Any = None) -> list[tuple]:
        """Rows of one SQL statement, on a fresh autocommit connection (closed afterwards)."""
        conn = self.connect()
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(sql, params)
                return cur.fetchall() if cur.description is not None else []
        finally:
            conn.close()

    def create_database(self, name: str) -> PostgresServer:
        """Create database ``name`` on this server; the same server, pointed at it."""
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", name):
            raise ValueError(f"database name {name!r}: lower-case letters, digits and _ only")
        replace(self, db="postgres").query(f"CREATE DATABASE {name}")
        return replace(self, db=name)

    def postgres_db_config(self, password_env: str | None = None) -> dict[str, Any]:
        """The ``postgres_db`` block of Dagster's ``storage: postgres:`` config (dagster_postgres'
        ``pg_config``): literal values, or ``password: {env: password_env}`` when given; ``scheme``
        names the psycopg2 driver (see :attr:`sqlalchemy_url`)."""
        return {"hostname": self.host, "port": self.port, "username": self.user,
                "password": {"env": password_env} if password_env else self.password, "db_name": self.db,
                "scheme": SCHEME}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unprivileged_user() -> pwd.struct_passwd:
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError("running as root, and neither a 'postgres' nor a 'nobody' user exists to run "
                       "PostgreSQL as (it refuses to run as root); create one, or run the tests as non-root")


def _traversable_by_all(path: Path) -> bool:
    """Every directory from / down to ``path`` lets other users through (o+x)."""
    p = path.resolve()
    return all(os.stat(d).st_mode & 0o001 for d in (p, *p.parents))


@contextmanager
def postgres_server(db: str = "dagster", *, bin_dir: Path | None = None) -> Iterator[PostgresServer]:
    """Start a fresh PostgreSQL server on 127.0.0.1 (a free port) with an empty database ``db``;
    yield its :class:`PostgresServer`; stop it and delete its files on exit, whatever happened."""
    bin_dir = Path(bin_dir) if bin_dir is not None else require_postgres_bin()
    run_as: dict[str, Any] = {}
    base = Path(tempfile.gettempdir())
    owner = None
    if os.geteuid() == 0:
        owner = _unprivileged_user()
        run_as = {"user": owner.pw_uid, "group": owner.pw_gid, "extra_groups": []}
        if not _traversable_by_all(base):  # e.g. TMPDIR under /root: the server user could not reach it
            base = Path("/tmp")
    _reap_orphans(base)
    root = Path(tempfile.mkdtemp(prefix="lm_pg_", dir=base))  # short: the socket path is limited to 107 bytes
    password = secrets.token_hex(12)
    data, sock, log = root / "data", root / "sock", root / "server.log"
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", "LC_ALL": "C", "LANG": "C", "HOME": str(root),
           "TZ": "UTC"}  # no PG* variables of the caller's shell

    def run(*args: str, timeout: float = _START_TIMEOUT_S + 30) -> subprocess.CompletedProcess:
        return subprocess.run([str(bin_dir / args[0]), *args[1:]], cwd=root, env=env, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL, **run_as)

    def log_tail() -> str:
        try:
            return log.read_text(errors="replace")[-3000:]
        except OSError:
            return "(no server log)"

    started = False
    try:
        (root / "owner.pid").write_text(str(os.getpid()))  # for _reap_orphans, if this process is killed
        sock.mkdir()
        (root / "pwfile").write_text(password + "\n")
        if owner is not None:
            for p in (root, sock, root / "pwfile"):
                os.chown(p, owner.pw_uid, owner.pw_gid)
        os.chmod(root, 0o700)
        init = run("initdb", "-D", str(data), "-U", SUPERUSER, "--pwfile", str(root / "pwfile"),
                   "--auth-local=trust", "--auth-host=scram-sha-256", "--encoding=UTF8", "--locale=C",
                   "--no-sync")
        if init.returncode != 0:
            raise RuntimeError(f"initdb failed (exit {init.returncode}):\n{init.stdout[-2000:]}{init.stderr[-2000:]}")
        (root / "pwfile").unlink()
        for attempt in range(3):  # the free port may be taken between choosing it and binding it
            port = _free_port()
            opts = (f"-k {sock} -h 127.0.0.1 -p {port} -c fsync=off -c synchronous_commit=off "
                    f"-c full_page_writes=off")
            start = run("pg_ctl", "-D", str(data), "-l", str(log), "-o", opts, "-w", "-t", str(_START_TIMEOUT_S),
                        "start")
            started = True  # stop even after a failed start: the postmaster may be up but not ready
            if start.returncode == 0:
                break
            _stop(run, data)
            started = False
            if "could not bind" not in log_tail() or attempt == 2:
                raise RuntimeError(f"pg_ctl start failed (exit {start.returncode}):\n{start.stdout}{start.stderr}\n"
                                   f"--- server log\n{log_tail()}")
        server = PostgresServer(host="127.0.0.1", port=port, user=SUPERUSER, password=password, db="postgres",
                                data_dir=data, bin_dir=bin_dir)
        yield server.create_database(db) if db != "postgres" else server
    finally:
        if started:
            _stop(run, data)
        shutil.rmtree(root, ignore_errors=True)


def _stop(run, data: Path) -> None:
    """``pg_ctl stop -m fast`` (disconnects clients, clean shutdown); then ``-m immediate``; then
    signals to the postmaster of ``postmaster.pid`` if it is still there."""
    for mode in ("fast", "immediate"):
        try:
            if run("pg_ctl", "-D", str(data), "-m", mode, "-w", "-t", str(_STOP_TIMEOUT_S), "stop",
                   timeout=_STOP_TIMEOUT_S + 10).returncode == 0:
                return
        except subprocess.TimeoutExpired:
            pass
        if not (data / "postmaster.pid").exists():
            return
    _kill_postmaster(data)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_postmaster(data: Path) -> None:
    """SIGQUIT (immediate shutdown), then SIGKILL, to the postmaster of ``data/postmaster.pid``, if it
    runs (and is that server: its command line names ``data``). Its children exit when it dies."""
    try:
        pid = int((data / "postmaster.pid").read_text().split()[0])
        if str(data).encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return  # gone, and the pid recycled
    except (OSError, ValueError, IndexError):
        return
    for sig, wait_s in ((signal.SIGQUIT, 5.0), (signal.SIGKILL, 2.0)):
        try:
            os.kill(pid, sig)
        except OSError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                    return  # dead, waiting for init to reap it
            except OSError:
                return
            time.sleep(0.05)


def _reap_orphans(base: Path) -> None:
    """Stop and delete the servers of test processes that died before their cleanup ran (SIGKILL,
    the OOM killer, a CI job's timeout): their ``owner.pid`` names a process that is gone."""
    for root in base.glob("lm_pg_*"):
        try:
            owner = int((root / "owner.pid").read_text())
        except (OSError, ValueError):
            continue  # not one of ours, or just being created
        if owner == os.getpid() or _alive(owner):
            continue
        _kill_postmaster(root / "data")
        shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Dagster on it
# --------------------------------------------------------------------------------------------


def postgres_dagster_home(tmp_path: Path, server: PostgresServer, *, password_env: str | None = None,
                          template: Path | Mapping[str, Any] | None = None, name: str = "dagster_home") -> Path:
    """Write ``<tmp_path>/<name>/dagster.yaml`` for a Dagster instance whose run, event-log and
    schedule storage are ``server``'s database (``storage: postgres: postgres_db: ...``); return that
    directory (use it as ``$DAGSTER_HOME`` or with ``DagsterInstance.from_config``).

    password_env: write ``password: {env: NAME}`` (the caller sets ``$NAME``) instead of the
    password itself. template: a dagster.yaml (path or mapping; e.g. ``assets/dagster.yaml``) whose
    other settings are kept; its ``storage`` section, if any, is replaced. Telemetry is off."""
    if isinstance(template, Path):
        cfg = yaml.safe_load(template.read_text()) or {}
    else:
        cfg = dict(template or {})
    cfg.setdefault("telemetry", {"enabled": False})
    cfg["storage"] = {"postgres": {"postgres_db": server.postgres_db_config(password_env)}}
    home = Path(tmp_path) / name
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return home


# --------------------------------------------------------------------------------------------
# pytest fixtures (import them into a test module to use them)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pg_server() -> Iterator[PostgresServer]:
    """One throwaway server per test module (its ``db`` is an empty database ``dagster``)."""
    with postgres_server() as server:
        yield server


@pytest.fixture
def pg_database(pg_server: PostgresServer, request) -> PostgresServer:
    """A fresh, empty database on the module's server for each test (Dagster creates its tables)."""
    name = re.sub(r"[^a-z0-9_]", "_", request.node.name.lower())[:40]
    return pg_server.create_database(f"t{secrets.token_hex(3)}_{name}")
