"""Process start-up helpers for the command-line entry points.

tcmalloc
--------
On CPU the JAX train step spends a large share of its time in glibc ``malloc``/``free``
(page faults from memory handed back to the kernel and taken again every step). Preloading
Google's tcmalloc (Debian/Ubuntu package ``libtcmalloc-minimal4``) makes it ~1.3x faster with
bit-identical results; see ``docs/benchmarks.md`` and ``bench/train_throughput.py``.

``LD_PRELOAD`` is read by the dynamic loader when a process *starts*, so the only way to get
tcmalloc from Python is to re-execute the process with the variable set, before any real work:
:func:`maybe_reexec_with_tcmalloc` does that, and is meant to be the first thing a CLI ``main``
calls. It re-executes when all of these hold:

* the platform is Linux;
* a tcmalloc shared library is found (:func:`find_tcmalloc`; ``LM_PIPELINE_TCMALLOC`` may name
  one explicitly);
* ``LD_PRELOAD`` is unset or empty (a preload chosen by the user is left alone);
* ``LM_PIPELINE_NO_TCMALLOC`` is unset or empty/``0`` (opt out: ``LM_PIPELINE_NO_TCMALLOC=1``);
* the process was not itself started by this function (the marker variable
  ``_LM_PIPELINE_TCMALLOC_REEXEC`` guards against loops, e.g. when the loader refuses the
  library).

In-process training cannot get tcmalloc this way: a training step run inside a long-lived
process that we do not start (a Dagster run worker, a notebook, pytest) keeps whatever allocator
it started with. To get it there, start that process with
``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4`` in its environment (e.g. the
Dagster run launcher's or the container's environment). Child processes started with a copy of
the environment inherit the variable.

Exit
----
A command that started JAX spends most of a second after its last output in interpreter
finalisation (the XLA client and its thread pools, module teardown). :func:`exit_now` ends such
a command the way the interpreter would, without that part: once no thread but the main one is
left that the interpreter would wait for, it runs the ``atexit`` handlers (logging's flush among
them), flushes standard output and error, and leaves with the exit code. Everything a command
writes is committed and closed before it returns (a writer that relied on a finaliser at
interpreter exit would be cut short here), so nothing is lost that a normal exit would have written.
``LM_PIPELINE_NORMAL_EXIT=1`` keeps the normal exit.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

OPT_OUT_ENV = "LM_PIPELINE_NO_TCMALLOC"
PATH_ENV = "LM_PIPELINE_TCMALLOC"
MARKER_ENV = "_LM_PIPELINE_TCMALLOC_REEXEC"

# Debian/Ubuntu (multiarch), then Fedora/RHEL and other common layouts. The "minimal" build
# (no heap profiler) is what we want; the full gperftools build works too.
_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
    "/usr/local/lib/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib64/libtcmalloc.so.4",
    "/usr/lib/libtcmalloc.so.4",
)


def _truthy(value: str | None) -> bool:
    return bool(value) and value.strip().lower() not in ("0", "false", "no", "off")


def find_tcmalloc() -> str | None:
    """Path of a tcmalloc shared library, or None. ``$LM_PIPELINE_TCMALLOC`` wins when it exists."""
    explicit = os.environ.get(PATH_ENV)
    if explicit:
        return explicit if os.path.isfile(explicit) else None
    for path in _CANDIDATES:
        if os.path.isfile(path):
            return path
    return None


def tcmalloc_loaded() -> bool:
    """Whether a tcmalloc library is mapped into this process (Linux only; False elsewhere)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return any("libtcmalloc" in line for line in f)
    except OSError:
        return False


def tcmalloc_status() -> str:
    """One line saying whether and why this process runs with tcmalloc (for logs)."""
    loaded = tcmalloc_loaded()
    if os.environ.get(MARKER_ENV):
        return "tcmalloc preloaded by re-exec" if loaded else "re-exec'd for tcmalloc but the library did not load"
    if loaded:
        return "tcmalloc preloaded (LD_PRELOAD set by the caller)"
    if _truthy(os.environ.get(OPT_OUT_ENV)):
        return f"tcmalloc disabled ({OPT_OUT_ENV} is set)"
    if not sys.platform.startswith("linux"):
        return "tcmalloc not used (not Linux)"
    if os.environ.get("LD_PRELOAD"):
        return "tcmalloc not used (LD_PRELOAD already set to something else)"
    if find_tcmalloc() is None:
        return "tcmalloc not found (install libtcmalloc-minimal4 for a faster CPU train step)"
    return "tcmalloc available but not preloaded (call maybe_reexec_with_tcmalloc at start-up)"


def reexec_reason(env: dict[str, str] | None = None) -> str | None:
    """The tcmalloc library to preload if :func:`maybe_reexec_with_tcmalloc` would re-execute now,
    else None."""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux"):
        return None
    if env.get(MARKER_ENV) or env.get("LD_PRELOAD") or _truthy(env.get(OPT_OUT_ENV)):
        return None
    return find_tcmalloc()


def _command(argv: Sequence[str] | None) -> list[str]:
    """The command line that restarts this process.

    ``None`` or ``sys.argv`` itself: the interpreter's original command line (``sys.orig_argv``,
    which keeps ``-m package.module``, ``-c`` and interpreter flags), with the interpreter
    resolved to ``sys.executable``. Anything else: ``[sys.executable, *argv]`` (``argv[0]`` a
    script path).
    """
    if argv is None or list(argv) == list(sys.argv):
        orig = list(getattr(sys, "orig_argv", []) or [])
        if orig:
            return [sys.executable, *orig[1:]]
        argv = sys.argv
    return [sys.executable, *argv]


def maybe_reexec_with_tcmalloc(argv: Sequence[str] | None = None) -> None:
    """Re-execute this process with tcmalloc preloaded, when possible and wanted; else return.

    Call it first thing in ``main`` (before importing JAX or starting threads): on success it
    never returns (``os.execve`` replaces the process, same pid, same arguments). ``argv``: the
    program's arguments in ``sys.argv`` form; default (or ``sys.argv``) restarts exactly the
    original command line, ``python -m ...`` included. The conditions and the loop guard are
    described in the module docstring; :func:`tcmalloc_status` reports the outcome.
    """
    lib = reexec_reason()
    if lib is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = lib
    env[MARKER_ENV] = "1"
    cmd = _command(argv)
    for stream in {id(s): s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) if s is not None}.values():
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed/odd stream must not block the exec
            pass
    try:
        os.execve(sys.executable, cmd, env)
    except OSError:
        return  # could not exec (odd interpreter setup): carry on with the default allocator


#: Commands that run long JAX computations: started from the shell, they re-execute themselves
#: with tcmalloc preloaded when it is installed (1.3x faster CPU steps).
REEXEC_COMMANDS = ("train", "cache", "eval", "generate")


def cli() -> int:
    """The ``lm-pipeline`` command: re-executes with tcmalloc (for :data:`REEXEC_COMMANDS`) before
    the command line's own imports (the stage table, fsspec, YAML: 0.2-0.5 s), so that they run
    once, in the process that stays; then :func:`lm_pipeline.cli.main`."""
    if len(sys.argv) > 1 and sys.argv[1] in REEXEC_COMMANDS:
        maybe_reexec_with_tcmalloc()
    from lm_pipeline.cli import main

    rc = main()
    if len(sys.argv) > 1 and sys.argv[1] in REEXEC_COMMANDS:
        exit_now(rc)
    return rc


NORMAL_EXIT_ENV = "LM_PIPELINE_NORMAL_EXIT"


def exit_now(code: int) -> int:
    """Leave the process with ``code`` without interpreter finalisation (see the module's "Exit"),
    unless a non-daemon thread is still running (then the interpreter's own exit waits for it, and
    so does this: it returns ``code``) or ``$LM_PIPELINE_NORMAL_EXIT`` is set."""
    import atexit
    import threading

    if os.environ.get(NORMAL_EXIT_ENV, "").strip() not in ("", "0"):
        return code
    main = threading.main_thread()
    if any(t is not main and not t.daemon and t.is_alive() for t in threading.enumerate()):
        return code
    atexit._run_exitfuncs()  # what a normal exit runs first (logging.shutdown is one of them)
    for stream in {id(s): s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) if s is not None}.values():
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be written anyway
            pass
    os._exit(code)
