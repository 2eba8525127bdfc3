"""Named fault points: places in long-running writes where a test can crash the process.

Production code calls :func:`faultpoint` at interesting moments (after a stage wrote its first
bytes, between a payload and its completion marker, ...). Unarmed, a call is one environment
look-up. A test arms points for a child process through the environment::

    LM_PIPELINE_FAULTPOINT="token_cache.before_commit:3"   # the 3rd time the point is passed
    LM_PIPELINE_FAULTPOINT_ACTION="kill"                    # kill (default) | raise | pause | sleep=S

Each comma-separated item is ``name[:N][:action]``: ``N`` is the 1-based pass to fire on
(default 1) or ``*`` for every pass; ``action`` overrides ``$LM_PIPELINE_FAULTPOINT_ACTION``.

- ``kill``: ``SIGKILL`` to itself, the harshest crash (no ``finally``, no flush, no atexit).
- ``raise``: :class:`FaultInjected` (an ordinary exception; for in-process tests).
- ``pause``: append ``<name> <pass>`` to ``$LM_PIPELINE_FAULTPOINT_FILE`` (if set) and sleep until
  killed, so a test can act (and kill the process) at a known moment.
- ``sleep=S``: sleep ``S`` seconds and go on (to widen race windows).

``LM_PIPELINE_FAULTPOINT_ONCE=<file>`` makes the crash happen once across processes (a retried
process must get past the point): the first firing creates the file, and while it exists no
point fires.

Point names are ``<stage>.<moment>``; ``grep -rn "faultpoint(" lm_pipeline`` lists them. Every
point is also recorded, when passed, in ``$LM_PIPELINE_FAULTPOINT_TRACE`` (if set; one name a
line), so a test can prove a point is really reached.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

ENV = "LM_PIPELINE_FAULTPOINT"
ENV_ACTION = "LM_PIPELINE_FAULTPOINT_ACTION"
ENV_FILE = "LM_PIPELINE_FAULTPOINT_FILE"
ENV_TRACE = "LM_PIPELINE_FAULTPOINT_TRACE"
ENV_ONCE = "LM_PIPELINE_FAULTPOINT_ONCE"

_counts: dict[str, int] = {}
_counted_under: list[str] = [""]  # the $LM_PIPELINE_FAULTPOINT value the counts belong to
_lock = threading.Lock()


class FaultInjected(RuntimeError):
    """Raised at an armed fault point whose action is ``raise``."""


def _armed(name: str) -> list[tuple[int | None, str]]:
    """The (pass or None for every pass, action) items armed for ``name``."""
    spec = os.environ.get(ENV, "")
    default = os.environ.get(ENV_ACTION, "kill")
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        point, _, rest = part.partition(":")
        if point != name:
            continue
        nth, _, action = rest.partition(":")
        out.append((None if nth == "*" else int(nth or 1), action or default))
    return out


def reset_counts() -> None:
    """Count passes from zero again: for a test that arms in one process the same points it armed
    before (passes count per arming, and an arming is told apart by its value only)."""
    with _lock:
        _counts.clear()
        _counted_under[0] = ""


def armed(name: str) -> bool:
    """Whether a test armed the fault point ``name`` (for any pass) in this process's environment."""
    return ENV in os.environ and bool(_armed(name))


def _claim_once() -> bool:
    """False when ``$LM_PIPELINE_FAULTPOINT_ONCE`` says a point already fired (in any process)."""
    marker = os.environ.get(ENV_ONCE)
    if not marker:
        return True
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def faultpoint(name: str, prepare: Callable[[], None] | None = None) -> None:
    """Pass the fault point ``name``; crash (or pause) here if a test armed it for this pass.

    ``prepare`` runs just before an armed point fires (never otherwise): e.g. to wait for a
    background write that the crash must come after.
    """
    trace = os.environ.get(ENV_TRACE)
    if trace:
        with open(trace, "a") as f:
            f.write(name + "\n")
    if ENV not in os.environ:
        return
    items = _armed(name)
    if not items:
        return
    with _lock:
        spec = os.environ.get(ENV, "")
        if spec != _counted_under[0]:  # armed anew: passes count from this arming on
            _counts.clear()
            _counted_under[0] = spec
        n = _counts[name] = _counts.get(name, 0) + 1
    for nth, action in items:
        if nth is not None and nth != n:
            continue
        if action.startswith("sleep="):
            time.sleep(float(action.split("=", 1)[1]))
            continue
        if action not in ("raise", "pause", "kill"):
            raise ValueError(f"{ENV_ACTION}/{ENV}: unknown action {action!r} (kill, raise, pause, sleep=S)")
        if not _claim_once():
            return
        if prepare is not None:
            prepare()
        if action == "raise":
            raise FaultInjected(f"fault point {name!r} (pass {n})")
        if action == "pause":
            marker = os.environ.get(ENV_FILE)
            if marker:
                with open(marker, "a") as f:
                    f.write(f"{name} {n}\n")
            while True:  # until killed from outside
                time.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL)


def reset() -> None:
    """Forget the pass counts (in-process tests that arm points more than once)."""
    with _lock:
        _counts.clear()


__all__ = ["ENV", "ENV_ACTION", "ENV_FILE", "ENV_ONCE", "ENV_TRACE", "FaultInjected", "armed", "faultpoint", "reset"]
