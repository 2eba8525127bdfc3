"""An S3-compatible server on loopback for tests (moto's server mode, as s3fs's own suite uses).

::

    from helpers.s3 import s3_server, s3_bucket  # noqa: F401  (pytest fixtures)

    def test_something(s3_bucket):
        root = s3_bucket.url("store")        # s3://<bucket>/store
        env = s3_bucket.env                   # AWS_* and endpoint variables for child processes

``s3_server`` (session scope) starts ``moto.server.ThreadedMotoServer`` on ``127.0.0.1`` and a
free port, and points the standard variables at it for the whole session: ``AWS_ENDPOINT_URL``
(boto3, aiobotocore, s3fs), ``FSSPEC_S3_ENDPOINT_URL`` (s3fs's own spelling), fake
credentials and a region. Credentials reach the code under test only through that standard
environment, as they would from a real chain. ``s3_bucket`` (function scope) creates a fresh bucket
and drops fsspec's cached filesystem instances, so nothing listed by an earlier test is seen.

moto is a dev dependency (``pip install -e ".[dev]"``); when it is missing the fixtures skip
outside CI and fail under ``CI=true`` (tests/conftest.py).
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    endpoint: str
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class S3Bucket:
    name: str
    server: S3Server

    @property
    def env(self) -> dict[str, str]:
        """The variables a child process needs to reach this server (merge into ``os.environ``)."""
        return dict(self.server.env)

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.name}", *[p.strip("/") for p in parts if p]])


def clear_fsspec_cache() -> None:
    """Forget fsspec's cached filesystem instances (and their listings)."""
    import fsspec

    for cls in list(fsspec.registry.values()) if hasattr(fsspec.registry, "values") else []:
        try:
            cls.clear_instance_cache()
        except Exception:  # noqa: BLE001 - a class without the cache
            pass
    try:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
    except ImportError:
        pass


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        pytest.skip(f"moto[server] is not installed ({e}); pip install -c constraints.txt -e '.[dev]'")
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ENDPOINT_URL_S3": endpoint,
        "FSSPEC_S3_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing-secret-" + secrets.token_hex(4),
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield S3Server(endpoint=endpoint, env=env)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        clear_fsspec_cache()
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[S3Bucket]:
    import boto3

    name = f"lm-test-{secrets.token_hex(4)}"
    client = boto3.client("s3", endpoint_url=s3_server.endpoint, region_name=REGION)
    client.create_bucket(Bucket=name)
    clear_fsspec_cache()
    yield S3Bucket(name=name, server=s3_server)
    clear_fsspec_cache()
