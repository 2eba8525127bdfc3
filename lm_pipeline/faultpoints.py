"""Named fault points: places in long-running writes where a test can crash the process.

Production code calls :func:`faultpoint` at interesting moments (after a stage wrote its first
bytes, between a payload and its completion marker, ...). Unarmed, a call is one environment
look-up. A test arms a point for a child process through the environment::

    LM_PIPELINE_FAULTPOINT="cache.shard_written:3"   # the 3rd time the point is passed
    LM_PIPELINE_FAULTPOINT_ACTION="kill"              # kill (default) | raise | pause

- ``kill``: ``SIGKILL`` to itself, the harshest crash (no ``finally``, no flush, no atexit).
- ``raise``: :class:`FaultInjected` (an ordinary exception; for in-process tests).
- ``pause``: write ``$LM_PIPELINE_FAULTPOINT_FILE`` (if set) and sleep, so a test can kill the
  process from outside at a known moment.

Several points may be armed at once, separated by commas. Each armed point fires once per
process. Point names are ``<stage>.<moment>`` strings; ``grep -rn "faultpoint(" lm_pipeline``
lists them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

ENV = "LM_PIPELINE_FAULTPOINT"
ENV_ACTION = "LM_PIPELINE_FAULTPOINT_ACTION"
ENV_FILE = "LM_PIPELINE_FAULTPOINT_FILE"

_counts: dict[str, int] = {}
_lock = threading.Lock()


class FaultInjected(RuntimeError):
    """Raised at an armed fault point whose action is ``raise``."""


def _armed() -> dict[str, int]:
    spec = os.environ.get(ENV, "")
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, nth = part.partition(":")
        out[name] = int(nth) if nth else 1
    return out


def faultpoint(name: str) -> None:
    """Pass the fault point ``name``; crash here if a test armed it for this pass."""
    if ENV not in os.environ:
        return
    armed = _armed()
    if name not in armed:
        return
    with _lock:
        _counts[name] = _counts.get(name, 0) + 1
        hit = _counts[name] == armed[name]
    if not hit:
        return
    action = os.environ.get(ENV_ACTION, "kill")
    if action == "raise":
        raise FaultInjected(f"fault point {name!r} (pass {armed[name]})")
    if action == "pause":
        marker = os.environ.get(ENV_FILE)
        if marker:
            Path(marker).write_text(name)
        while True:  # until killed from outside
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)
