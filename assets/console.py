"""How a run of this code location prints its events on the console (``dagster asset
materialize``, ``dagster job execute``, ``python -m assets materialize``; the UI reads the event
log, not this).

Dagster's console logger prints a step that failed on purpose -- a :class:`dagster.Failure` raised
with a one-line reason, such as "train_ckpt reads token_cache …, which is not built: materialize
token_cache first …" -- with the framework's stack trace under it, twice (the step's failure and
the run's). Its loggers are plain :mod:`logging` loggers made per run from
:func:`logging.getLoggerClass`, and a code location's own ``@logger`` is used only when a run's
config names it, which ``dagster asset materialize --select ...`` does not; so
:func:`install` (called by the code location, :mod:`assets.definitions`) sets a logger class that
prints such a failure as its one line -- the reason is the message, a traceback would only hide
it -- and leaves every other record, Dagster's format and levels as they are. An unexpected error
(any other exception) keeps its traceback.
"""

from __future__ import annotations

import logging
import re
from typing import Any


def _failure_line(record: logging.LogRecord) -> str | None:
    """The record's message with a deliberate failure's reason in place of its stack trace, or
    None when the record is not such a failure."""
    meta: Any = getattr(record, "dagster_meta", None)
    event = meta.get("dagster_event") if isinstance(meta, dict) else None
    data = getattr(event, "event_specific_data", None)
    user = getattr(data, "user_failure_data", None)  # a step's failure: set when it raised dg.Failure
    error = getattr(data, "error", None)
    if user is None and error is not None:  # a run's failure repeats its first failed step's error
        cause = error
        while cause is not None and cause.cls_name != "Failure":
            cause = cause.cause
        if cause is None:
            return None
        reason = re.sub(r"^[\w.]*Failure: ", "", cause.message.strip())
    elif user is not None:
        reason = (user.description or "").strip()
    else:
        return None
    if not reason or "\n" in reason:
        return None
    head = record.getMessage().split("\n\n", 1)[0]  # "<job> - <run> - <pid> - <step> - STEP_FAILURE - ..."
    return f"{head} {reason}"


class OneLineFailuresLogger(logging.getLoggerClass()):  # type: ignore[misc]
    """A logger that prints a deliberate failure's record as one line (see the module docstring)."""

    def handle(self, record: logging.LogRecord) -> None:
        line = _failure_line(record)
        if line is not None:
            record.msg, record.args = line, ()
        super().handle(record)


def install() -> None:
    """Make the loggers Dagster creates for each run (its console logger is made with
    :func:`logging.getLoggerClass`) print deliberate failures as one line. Only records that carry a
    Dagster failure event change; every other record is handled as before."""
    if not issubclass(logging.getLoggerClass(), OneLineFailuresLogger):
        logging.setLoggerClass(OneLineFailuresLogger)
