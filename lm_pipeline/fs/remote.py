"""Object stores: the package each scheme needs, whether a URL can be used on this machine (scheme,
package, network, bucket, credentials; each problem in one line with what to do), the endpoints
and credential chains of the standard variables, and TensorStore kvstore specs."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator

import fsspec

from lm_pipeline.fs.paths import PathLike, get_fs, is_local, local_path, scheme

#: The package behind each object-store scheme (fsspec names it in its own error otherwise).
_FS_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
                "abfss": "adlfs", "hf": "huggingface_hub"}


def url_problem(url: PathLike) -> str | None:
    """Why ``url`` cannot be opened on this machine (an unknown scheme, or its filesystem package
    missing), in one line with what to do; None when it can (local paths always can). Reads
    nothing: credentials and buckets are checked when the URL is first used."""
    text = os.fspath(url)
    if is_local(text):
        return None
    protocol = scheme(text)
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError:
        package = _FS_PACKAGES.get(protocol, f"the fsspec implementation of {protocol}://")
        return f"{text}: reading {protocol}:// needs the {package} package, which is not installed (pip install {package})"
    except ValueError:
        return (f"{text}: unknown URL scheme {protocol!r}; use a local path or a URL fsspec knows "
                "(s3://, gs://, az://, https://, memory://, ...)")
    return None


def _bucket_of(url: str) -> str:
    return url.split("://", 1)[1].split("/", 1)[0]


def access_problem(url: PathLike) -> str | None:
    """Why ``url`` cannot be used (unknown scheme, missing package, missing bucket, no or refused
    credentials), in one line with what to do; None when its bucket can be listed. Local paths
    always can. Lists the bucket once (one request): called before any compute."""
    problem = url_problem(url)
    if problem or is_local(url):
        return problem
    text = os.fspath(url)
    bucket = _bucket_of(text)
    protocol = text.split("://", 1)[0]
    endpoint = _endpoint(protocol)
    if endpoint is not None:  # one quick connection first: offline, the clients retry for a minute
        why = connect_problem(endpoint)
        if why is not None:
            return (f"{text}: cannot reach {endpoint} ({why}); check this machine's network connection (and proxy "
                    "settings), or use a local path")
    try:
        with _quiet(*_CLIENT_LOGGERS):  # the one line below says it; not the clients' retry tracebacks
            store, _ = get_fs(text)
            store.ls(bucket)
    except FileNotFoundError:
        return f"{text}: the bucket {bucket!r} does not exist (or is not visible with these credentials); create it or fix the URL"
    except PermissionError as e:
        first = (str(e).splitlines() or [""])[0][:200]
        return (f"{text}: access to bucket {bucket!r} refused ({first}); check the credentials the standard "
                f"{_CHAIN.get(protocol, 'credential chain')} finds")
    except Exception as e:  # noqa: BLE001 - botocore's NoCredentialsError, google.auth's DefaultCredentialsError, ...
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        kind = type(e).__name__
        if "credential" in kind.lower() or "credential" in first.lower():
            return (f"{text}: no usable credentials ({kind}: {first}); provide them through the standard "
                    f"{_CHAIN.get(protocol, 'credential chain')}")
        return f"{text}: cannot be listed ({kind}: {first})"
    return None


def access_problems(urls: Iterable[PathLike]) -> dict[str, str]:
    """``url -> problem`` (as :func:`access_problem` words it, naming that URL) for each of ``urls``
    that cannot be used; the others are left out. Each bucket is listed once, however many of the
    URLs lie in it; local paths are never checked."""
    buckets: dict[str, str | None] = {}
    out: dict[str, str] = {}
    for url in urls:
        text = os.fspath(url)
        if is_local(text) or text in out:
            continue
        problem = url_problem(text)
        if problem is None:
            bucket = f"{text.split('://', 1)[0]}://{_bucket_of(text)}"
            if bucket not in buckets:
                buckets[bucket] = access_problem(bucket)
            problem = buckets[bucket] and buckets[bucket].replace(bucket, text, 1)
        if problem:
            out[text] = problem
    return out


#: Loggers of the object-store clients: their retries log whole tracebacks.
_CLIENT_LOGGERS = ("gcsfs", "s3fs", "aiobotocore", "botocore", "google.auth", "urllib3")


#: Seconds a reachability check waits for a connection (name lookup included).
CONNECT_TIMEOUT_S = 3.0


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """Only CRITICAL records of the loggers ``names`` during the block."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _endpoint(protocol: str) -> str | None:
    """The endpoint the client of ``protocol`` talks to (from the standard variables), or None when not
    known here. Computed without creating the client: a GCS client looks for credentials first,
    which takes a quarter of a minute offline."""
    if protocol in ("gs", "gcs"):
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
        if emulator and emulator != "default":
            return emulator if emulator.startswith(("http://", "https://")) else f"http://{emulator}"
        return "https://storage.googleapis.com"
    if protocol in ("s3", "s3a"):
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        return s3_endpoint() or (f"https://s3.{region}.amazonaws.com" if region else "https://s3.amazonaws.com")
    return None


def _proxy_for(url: str) -> str | None:
    """The proxy the standard variables route ``url`` through, if any."""
    import urllib.request

    host = url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
    if urllib.request.proxy_bypass_environment(host):
        return None
    return urllib.request.getproxies_environment().get(url.split("://", 1)[0].lower())


def connect_problem(url: str, timeout: float = CONNECT_TIMEOUT_S) -> str | None:
    """Why no TCP connection to the host of the http(s) ``url`` (or to the proxy the standard
    variables name for it) opens within ``timeout`` seconds, name lookup included: one line
    ('cannot resolve storage.googleapis.com: ...'); None when one does. Sends nothing."""
    import socket
    import threading
    import urllib.parse

    target = _proxy_for(url) or url
    parts = urllib.parse.urlsplit(target if "://" in target else f"http://{target}")
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return f"invalid port in {target}"
    where = f"{host}:{port}" + (f" (the proxy for {url})" if target != url else "")
    result: list[str | None] = []

    def attempt() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                result.append(None)
        except socket.gaierror as e:
            result.append(f"cannot resolve {host}: {e.strerror or e}")
        except TimeoutError:
            result.append(f"no answer from {where} within {timeout:g} s")
        except OSError as e:
            result.append(f"cannot connect to {where}: {e.strerror or e}")

    thread = threading.Thread(target=attempt, name="lm-pipeline-connect-check", daemon=True)
    thread.start()
    thread.join(timeout)  # a name lookup has no timeout of its own
    if not result:
        return f"no answer from {where} within {timeout:g} s"
    return result[0]


#: Where each object store's client looks for credentials (named in error messages).
_CHAIN = {
    "s3": "AWS chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE and ~/.aws, instance or pod role)",
    "s3a": "AWS chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE and ~/.aws, instance or pod role)",
    "gs": "Google chain (GOOGLE_APPLICATION_CREDENTIALS, gcloud auth application-default login, the metadata server)",
    "gcs": "Google chain (GOOGLE_APPLICATION_CREDENTIALS, gcloud auth application-default login, the metadata server)",
}


def s3_endpoint() -> str | None:
    """The S3 endpoint of an S3-compatible store, from the standard variables (``AWS_ENDPOINT_URL_S3``,
    then ``AWS_ENDPOINT_URL``; s3fs's ``FSSPEC_S3_ENDPOINT_URL`` too); None: AWS itself."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "FSSPEC_S3_ENDPOINT_URL"):
        value = os.environ.get(name)
        if value:
            return value
    return None


def kvstore_spec(url: PathLike) -> dict | str:
    """A TensorStore kvstore spec for a directory ``url`` (ending in ``/``).

    Local paths: the ``file`` driver. ``s3://``: the ``s3`` driver with the endpoint and region of
    the standard AWS variables (TensorStore does not read the endpoint variables itself);
    credentials stay with TensorStore's own AWS chain and never enter the spec. Other URLs are
    passed as TensorStore URLs (``gs://`` reads Google's application default credentials)."""
    text = os.fspath(url)
    if is_local(text):
        return {"driver": "file", "path": local_path(text).rstrip("/") + "/"}
    protocol, rest = text.split("://", 1)
    if protocol in ("s3", "s3a"):
        bucket, _, path = rest.partition("/")
        spec: dict = {"driver": "s3", "bucket": bucket, "path": path.strip("/") + "/" if path.strip("/") else ""}
        endpoint = s3_endpoint()
        if endpoint:
            spec["endpoint"] = endpoint
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            spec["aws_region"] = region
        return spec
    if protocol == "gcs":
        text = "gs://" + rest
    return text.rstrip("/") + "/"
