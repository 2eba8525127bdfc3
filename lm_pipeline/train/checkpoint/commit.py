"""Multi-process commit of a checkpoint: the marker is written only after every process wrote its part.

Every process writes its own array shards (Orbax). Process 0 then waits until each other
process has reported its part written (or failed), with the files it uploaded (sizes, sha256),
through the ``jax.distributed`` key-value store, completes the checkpoint (marker, ``best/``, pruning) and publishes a verdict; the other
processes wait for that verdict, so after ``wait()`` every process sees the same checkpoints.
With one process there is nothing to exchange.
"""

from __future__ import annotations

import base64
import json
import logging
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

import jax

__all__ = ["TIMEOUT_S", "MultiProcessCommit", "log_on_primary"]

T = TypeVar("T")

TIMEOUT_S = 3600  # how long a process waits for the others' parts or for the verdict (seconds)


def log_on_primary(logger: logging.Logger, msg: str, *args: Any) -> None:
    """Log at INFO on process 0 and at DEBUG elsewhere (one line per event, not one per process)."""
    logger.log(logging.INFO if jax.process_index() == 0 else logging.DEBUG, msg, *args)


def _kv_client() -> Any:
    """The jax.distributed coordination client (key-value store), as Orbax also uses it."""
    from lm_pipeline import jax_private  # no public JAX API exposes it

    client = jax_private.coordination_client()
    if client is None:
        raise RuntimeError("multi-process checkpointing needs jax.distributed.initialize()")
    return client


def _status(error: BaseException | None) -> str:
    return "ok" if error is None else f"error: {type(error).__name__}: {error}"[:2000]


class MultiProcessCommit:
    """The commit protocol of one :class:`~.checkpointer.Checkpointer` (one per process).

    ``sync_key`` names one save, identically on every process; ``path`` is only for messages.
    """

    def __init__(self) -> None:
        self._published: str | None = None  # the previous save's verdict key, deleted at the next

    def follow(self, sync_key: str, path: str, local_error: BaseException | None,
               files: dict[str, dict] | None = None) -> None:
        """On a process other than 0: report this process's part (and the files it uploaded:
        relative path -> size, sha256), then wait for process 0's verdict.

        Raises this process's own error, or RuntimeError if process 0 did not complete the save."""
        client = _kv_client()
        me = jax.process_index()
        if local_error is None:  # set before the status: process 0 reads it once the status is ok
            packed = base64.b64encode(zlib.compress(json.dumps(files or {}, sort_keys=True).encode())).decode()
            client.key_value_set(f"{sync_key}_files_{me}", packed)
        client.key_value_set(f"{sync_key}_written_{me}", _status(local_error))
        status = client.blocking_key_value_get(f"{sync_key}_status", TIMEOUT_S * 1000)
        if local_error is not None:
            raise local_error
        if status != "ok":
            raise RuntimeError(f"checkpoint {path} was not completed by process 0: {status}")

    def lead(self, sync_key: str, path: str, local_error: BaseException | None,
             complete: Callable[[dict[int, dict[str, dict]]], T]) -> T:
        """On process 0: once every process's part is written, run ``complete`` with the files
        each other process reported (process -> relative path -> size, sha256; marker, cleanup)
        and publish the verdict (ok or the error) to the other processes. Returns what
        ``complete`` returns; raises the first error (this process's, another's, or ``complete``'s)."""
        nproc = jax.process_count()
        status = "error: unknown"
        try:
            if local_error is not None:
                raise local_error
            reported = self._await_parts(sync_key, path, nproc) if nproc > 1 else {}
            result = complete(reported)
            status = "ok"
            return result
        except BaseException as e:
            status = _status(e)
            raise
        finally:
            if nproc > 1:
                self._publish(f"{sync_key}_status", status)

    @staticmethod
    def _await_parts(sync_key: str, path: str, nproc: int) -> dict[int, dict[str, dict]]:
        """Barrier: every other process has reported its part; raises if one failed. Returns the
        files each reported."""
        client = _kv_client()
        failed = []
        reported: dict[int, dict[str, dict]] = {}
        for other in range(1, nproc):
            key = f"{sync_key}_written_{other}"
            got = client.blocking_key_value_get(key, TIMEOUT_S * 1000)
            client.key_value_delete(key)
            if got != "ok":
                failed.append(f"process {other}: {got}")
                continue
            files_key = f"{sync_key}_files_{other}"
            packed = client.blocking_key_value_get(files_key, 60_000)  # set before the status
            client.key_value_delete(files_key)
            reported[other] = json.loads(zlib.decompress(base64.b64decode(packed)))
        if failed:
            raise RuntimeError(f"checkpoint {path}: {'; '.join(failed[:5])}")
        return reported

    def _publish(self, key: str, status: str) -> None:
        client = _kv_client()
        client.key_value_set(key, status)
        if self._published:  # every process has read it (they all passed save() since)
            client.key_value_delete(self._published)
        self._published = key
