"""A run's Python logging (stderr and ``<log_dir>/<run_id>.log``, local or on an object store)
and secret redaction (hyperparameters, log records).

:func:`redact` removes secret-named keys (``WANDB_API_KEY``, ``HF_TOKEN``, ``AWS_*``,
``GOOGLE_*``, ``*password*``, ...) and masks the values of such environment variables wherever
they appear inside strings; hyperparameters pass through it before any tracker sees them
(:mod:`lm_pipeline.train.trackers`), and :func:`setup_logging`'s handlers mask the same values in
log records.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from lm_pipeline import fs

# --- secrets ----------------------------------------------------------------------------------

_SECRET_KEY = re.compile(
    r"^(wandb_api_key|hf_token|hf_hub_token|hugging_?face_(hub_)?token|github_token|gh_token)$"
    r"|^(aws|google|gcp|azure)_"
    r"|api_?key|secret|passw(or)?d|credential|access_token|auth_token|api_token|private_key",
    re.IGNORECASE,
)
# Environment variables whose values are masked in strings: the secret names plus any *TOKEN*.
_SECRET_ENV = re.compile(_SECRET_KEY.pattern + r"|token", re.IGNORECASE)
# ...except settings that are not secrets and would only mask ordinary words.
_NOT_SECRET_ENV = re.compile(r"(_REGION|_PROFILE|_PROJECT|_ZONE|_ENDPOINT_URL|_LOCATION)$", re.IGNORECASE)
_MIN_SECRET_LEN = 8
REDACTED = "<redacted>"


def is_secret_key(name: str) -> bool:
    """True for a key that names a secret (``WANDB_API_KEY``, ``HF_TOKEN``, ``AWS_*``, ...)."""
    return bool(_SECRET_KEY.search(name))


def _secret_values() -> list[str]:
    values = {
        v
        for k, v in os.environ.items()
        if _SECRET_ENV.search(k) and not _NOT_SECRET_ENV.search(k) and len(v) >= _MIN_SECRET_LEN
    }
    return sorted(values, key=len, reverse=True)  # longest first: no partial masking


def _mask(text: str, secrets: Sequence[str]) -> str:
    for s in secrets:
        if s in text:
            text = text.replace(s, REDACTED)
    return text


def redact(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``mapping`` (recursively) without secrets.

    Keys that name secrets are removed; strings containing the value of a secret environment
    variable get it replaced by ``<redacted>``. Lists/tuples are walked; other values are kept.
    """
    secrets = _secret_values()

    def clean(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: clean(v) for k, v in value.items() if not is_secret_key(str(k))}
        if isinstance(value, list):
            return [clean(v) for v in value]
        if isinstance(value, tuple):
            return tuple(clean(v) for v in value)
        if isinstance(value, str):
            return _mask(value, secrets)
        return value

    return clean(mapping)


class _RedactingFilter(logging.Filter):
    """Masks secret environment values in log records (message and formatted arguments)."""

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = _secret_values()
        if secrets:
            try:
                message = record.getMessage()
            except Exception:  # a broken format string: leave it to the formatter to report
                return True
            masked = _mask(message, secrets)
            if masked != message:
                record.msg, record.args = masked, None
        return True


# --- logging ----------------------------------------------------------------------------------

_HANDLER_TAG = "_lm_pipeline_handler"


def setup_logging(log_dir: str, run_id: str, level: int = logging.INFO) -> str:
    """Send Python logging to ``<log_dir>/<run_id>.log`` as well as stderr; returns the file path.

    Idempotent: calling it again for the same run adds nothing; for another run it moves the
    file handler there. A stderr handler is added only if the root logger has none already.
    Handlers installed here mask secret environment values.
    """
    target = fs.norm(fs.join(log_dir, f"{run_id}.log"))
    root = logging.getLogger()
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = None
    for h in list(root.handlers):
        if getattr(h, _HANDLER_TAG, None) == "file":
            if getattr(h, "target", None) == target:
                path = h.baseFilename
            else:
                root.removeHandler(h)
                h.close()
    if path is None:
        fh = _PublishingFileHandler(target)
        path = fh.baseFilename
        fh.setFormatter(fmt)
        fh.addFilter(_RedactingFilter())
        setattr(fh, _HANDLER_TAG, "file")
        root.addHandler(fh)
    has_stderr = any(
        getattr(h, _HANDLER_TAG, None) == "stderr"
        or (type(h) is logging.StreamHandler and getattr(h, "stream", None) in (sys.stderr, sys.__stderr__))
        for h in root.handlers
    )
    if not has_stderr:
        sh = logging.StreamHandler(sys.stderr)
        sh.setFormatter(fmt)
        sh.addFilter(_RedactingFilter())
        setattr(sh, _HANDLER_TAG, "stderr")
        root.addHandler(sh)
    if root.level > level:
        root.setLevel(level)
    return path


class _PublishingFileHandler(logging.FileHandler):
    """The log file ``target`` (a local path or URL) as an :class:`lm_pipeline.fs.AppendFile`: records
    go to its local file (the file itself, or on an object store, which cannot append, a local copy
    of it uploaded whole at most every ``every`` seconds and when the handler is closed:
    ``logging.shutdown`` at exit)."""

    def __init__(self, target: str, every: float = 30.0):
        self._file = fs.AppendFile(target)
        self.target, self.every = self._file.path, every
        super().__init__(self._file.local_file, encoding="utf-8")
        self._last = time.monotonic()
        self._publishing = False

    def _publish(self) -> None:
        if self._publishing:  # the upload's own log records
            return
        self._publishing = True
        try:
            self._file.publish()
            self._last = time.monotonic()
        except Exception:  # noqa: BLE001 - a log upload must never fail the run; the local file stays
            pass
        finally:
            self._publishing = False

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        if time.monotonic() - self._last >= self.every:
            self.flush()
            self._publish()

    def close(self) -> None:
        super().close()
        self._publishing = True  # the last upload's own log records start no other
        with contextlib.suppress(Exception):  # as in _publish: a log upload never fails the run
            self._file.close()  # publishes a last time
