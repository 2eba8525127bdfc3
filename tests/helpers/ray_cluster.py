"""A small Ray cluster on this machine for tests: a head node and one worker node.

::

    from helpers.ray_cluster import ray_cluster  # noqa: F401  (pytest fixture, module scope)

    def test_something(ray_cluster):
        ray_cluster.job_api      # http://127.0.0.1:<port>: the job API (what the training resource needs)
        ray_cluster.gcs_address  # 127.0.0.1:<port>: what `ray start --address` / ray.init take

Each node is a ``ray start --block`` process in its own session, with 1 CPU, a 100 MB object
store and its own temporary directory (so no other Ray on the machine sees it as "the local
cluster"). The fixture yields once both nodes take work: a batch of ``SPREAD`` probe tasks has
run on each (a node that has only just registered gets no ``SPREAD`` task for a moment, so a
test's first tasks could all land on the head). The head runs the dashboard because Ray's job API lives there. Teardown always runs:
``SIGTERM`` to each ``ray start`` (which stops the node's processes), then ``SIGKILL`` to the
node's process group if anything is left; nothing else on the machine is touched.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

START_TIMEOUT_S = 120
OBJECT_STORE_BYTES = 100 * 1024 * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RayCluster:
    gcs_address: str
    job_api: str
    temp_dir: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    def logs(self) -> str:
        """The ``ray start`` outputs, for failure messages."""
        return "\n".join(f"--- {p.name}:\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(self.temp_dir.glob("*.out")))


def _ray_cli() -> str:
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else "ray"


def _start_node(cluster: RayCluster, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    out = open(cluster.temp_dir / f"{name}.out", "w")  # noqa: SIM115 - closed when the process ends
    proc = subprocess.Popen([_ray_cli(), "start", "--block", "--disable-usage-stats", "--num-cpus=1",
                             f"--object-store-memory={OBJECT_STORE_BYTES}", "--node-ip-address=127.0.0.1", *args],
                            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    cluster.procs.append(proc)
    return proc


def _wait_started(cluster: RayCluster, name: str, proc: subprocess.Popen, deadline: float) -> None:
    log = cluster.temp_dir / f"{name}.out"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray {name} exited with {proc.returncode}:\n{cluster.logs()}")
        if "Ray runtime started" in log.read_text(errors="replace"):
            return
        time.sleep(0.5)
    raise TimeoutError(f"ray {name} did not start within {START_TIMEOUT_S} s:\n{cluster.logs()}")


def _wait_job_api(cluster: RayCluster, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{cluster.job_api}/api/version", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the Ray job API at {cluster.job_api} did not answer:\n{cluster.logs()}")


def _wait_both_nodes_take_work(cluster: RayCluster, deadline: float) -> None:
    import ray

    try:
        ray.init(address=cluster.gcs_address, log_to_driver=False)

        @ray.remote(num_cpus=1, scheduling_strategy="SPREAD")
        def node_id() -> str:
            time.sleep(0.05)
            return ray.get_runtime_context().get_node_id()

        seen: set[str] = set()
        while True:  # at least one batch, each bounded by the deadline
            refs = [node_id.remote() for _ in range(4)]
            try:
                seen = set(ray.get(refs, timeout=max(1.0, deadline - time.monotonic())))
            except ray.exceptions.GetTimeoutError:
                for ref in refs:
                    ray.cancel(ref, force=True)
                raise TimeoutError(f"SPREAD probe tasks did not finish within {START_TIMEOUT_S} s:\n{cluster.logs()}") from None
            if len(seen) == 2:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"SPREAD probe tasks ran on {len(seen)} of the 2 nodes within {START_TIMEOUT_S} s:\n"
                                   f"{cluster.logs()}")
            time.sleep(0.5)
    except (TimeoutError, KeyboardInterrupt):
        raise
    except Exception as e:
        raise RuntimeError(f"the SPREAD probe of the test cluster failed: {e}\n{cluster.logs()}") from e
    finally:
        if ray.is_initialized():
            ray.shutdown()


def stop(cluster: RayCluster) -> None:
    """Stop the nodes (worker first), then make sure nothing of theirs is left."""
    for proc in reversed(cluster.procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
    for proc in cluster.procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the node's own process group (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass
        if proc.poll() is None:
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    try:
        import ray  # noqa: F401
    except ImportError as e:
        pytest.skip(f"ray is not installed ({e}); pip install -c constraints.txt -e '.[dev]'")
    # Short: Ray's socket paths live under it and must stay under the kernel's 108 characters.
    temp_dir = Path(tempfile.mkdtemp(prefix="lmray-", dir="/tmp"))
    gcs_port, dash_port, client_port = _free_port(), _free_port(), _free_port()
    cluster = RayCluster(gcs_address=f"127.0.0.1:{gcs_port}", job_api=f"http://127.0.0.1:{dash_port}", temp_dir=temp_dir)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"})
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        head = _start_node(cluster, "head", ["--head", f"--port={gcs_port}", f"--temp-dir={temp_dir}",
                                             "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                                             f"--dashboard-port={dash_port}", f"--ray-client-server-port={client_port}"], env)
        _wait_started(cluster, "head", head, deadline)
        # One log monitor per machine (the head's), or each worker line reaches the driver twice.
        worker = _start_node(cluster, "worker", [f"--address={cluster.gcs_address}", "--include-log-monitor=false"], env)
        _wait_started(cluster, "worker", worker, deadline)
        _wait_job_api(cluster, deadline)
        _wait_both_nodes_take_work(cluster, deadline)
        yield cluster
    finally:
        stop(cluster)
        shutil.rmtree(temp_dir, ignore_errors=True)


def one_line_failure(fn) -> str:
    """The description of the ``dagster.Failure`` that ``fn()`` raises, checked to be one line."""
    import dagster as dg

    with pytest.raises(dg.Failure) as info:
        fn()
    msg = info.value.description
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg
