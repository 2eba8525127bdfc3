"""The train step compiled on a background thread while the state is initialised or restored.

A run's start-up compiles two large programs one after the other: the state's initialisation
(or a checkpoint's restore) and the train step. Neither needs the other's result: the step's
compilation needs only the state's shapes and shardings and the first batch's. :mod:`lm_pipeline.train.run`
traces it as soon as the step functions exist and compiles it on a thread (:class:`AheadStep`); XLA
compiles without holding the GIL, so on a machine with a second core the compilation overlaps
the initialisation (``docs/benchmarks.md``). The trace itself runs first, on the calling thread:
a trace holds the GIL, so tracing the step on the thread while the state's initialisation is
traced would run both on one core. CPU runs only:
a GPU compilation autotunes kernels on the device, which a concurrent initialisation would
disturb. The loop then calls
the :class:`AheadStep`, which runs the compiled program for arguments of the shapes it was
compiled for and hands any others to the jitted function (which compiles them as usual).

A failed trace (in the constructor) or compilation (on the thread) is not reported there: the
jitted function traces and compiles the same program on the first call and raises the same
error where the step is called.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

log = logging.getLogger(__name__)


def _signature(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Per argument: None, or (shape, dtype) of every array leaf (the state's are checked by the
    compiled program itself; a batch's decide which program runs)."""
    return tuple(None if a is None else (tuple(a.shape), str(a.dtype)) for a in args)


class AheadStep:
    """A step function whose program for one argument signature is compiled on a thread.

    ``fn``: the jitted step ``fn(state, *batch)``; ``state``: the abstract state (shapes and
    shardings); ``batch``: the first batch as the loop passes it (placed arrays or None), whose
    shapes, dtypes and shardings the program is compiled for. ``mesh``: entered while the step is
    traced, on the calling thread (sharding constraints inside the step resolve against it, as in
    the loop). ``compile_s``: seconds from the start of the trace to the end of the compilation.
    """

    def __init__(self, fn: Callable[..., Any], state: Any, batch: tuple[Any, ...], mesh: Any = None):
        self._fn = fn
        self._sig = _signature(batch)
        self._compiled: Callable[..., Any] | None = None
        self._error: BaseException | None = None
        self.compile_s: float | None = None
        abstract = tuple(None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                         for a in batch)
        t0 = time.perf_counter()
        lowered = None
        try:
            # Traced here, before the state's initialisation is: tracing holds the GIL, so two
            # traces on two threads would take turns on one core while the other idles.
            with mesh if mesh is not None else contextlib.nullcontext():
                lowered = self._fn.lower(state, *abstract)
        except Exception as e:  # the jitted call raises it where the step runs
            self._error = e
        # Not a daemon: a run that fails before its first step (a bad checkpoint path, Ctrl-C)
        # then exits once the compilation ends, instead of XLA aborting under a finalising
        # interpreter.
        self._thread = threading.Thread(target=self._compile, args=(lowered, t0),
                                        name="lm_pipeline-compile-ahead", daemon=False)
        self._thread.start()

    def _compile(self, lowered: Any, t0: float) -> None:
        if lowered is None:
            return
        try:
            self._compiled = lowered.compile()
            self.compile_s = time.perf_counter() - t0
            log.info("train step traced and compiled in %.2f s (compiled on a thread, while the state was initialised)",
                     self.compile_s)
        except BaseException as e:  # the jitted call raises it where the step runs
            self._error = e

    def ready(self, timeout: float | None = None) -> bool:
        """Whether the compilation has ended (successfully or not)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __call__(self, state: Any, *batch: Any) -> Any:
        self._thread.join()  # at once when the compilation has ended
        if self._compiled is not None and _signature(batch) == self._sig:
            return self._compiled(state, *batch)
        if self._error is not None:
            log.debug("the train step's compilation ahead failed (%s); compiling it on the first call",
                      type(self._error).__name__)
            self._error = None
        return self._fn(state, *batch)

