"""Building a token cache: tokenize shards (in worker processes), commit them in shard order.

Each shard's ids, offsets and byte counts are written past the committed counts as soon as it is
tokenized; once a group of ``shard_group_size`` shards is written the ledger is replaced (the
commit). A killed build resumes from its last committed group and ends byte-identical to an
uninterrupted one; the output never depends on the number of workers.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from lm_pipeline.data.cache.errors import CacheMismatchError
from lm_pipeline.data.cache.ledger import incompatibility, shard_plan
from lm_pipeline.data.cache.storage import COMPLETE, LEDGER, CacheRoot
from lm_pipeline.data.cache.writer import Arrays, Committer, finalize_cache, open_arrays, start_cache
from lm_pipeline.data.encode import (
    DocumentEncoder,
    EncodedShard,
    Shard,
    TokenizerInfo,
    tokenizer_info,
    worker_encode,
    worker_init,
)

__all__ = ["build_cache"]

log = logging.getLogger(__name__)


def _resolve_workers(num_workers: int) -> int:
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0 (0 = all cores), got {num_workers}")
    if num_workers:
        return num_workers
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _ordered_map(
    fn: Callable[[Any], Any], items: Sequence[Any], workers: int, init: Callable[..., None], initargs: tuple
) -> Iterator[Any]:
    """``map(fn, items)`` over a process pool, in order, with a bounded window of work in flight."""
    ctx = multiprocessing.get_context("spawn")  # never fork a process that runs TensorStore threads
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=init, initargs=initargs) as pool:
        window = max(2 * workers, 2)
        pending: deque = deque()
        it = iter(items)
        try:
            for item in it:
                pending.append(pool.submit(fn, item))
                if len(pending) >= window:
                    break
            while pending:
                result = pending.popleft().result()
                for item in it:
                    pending.append(pool.submit(fn, item))
                    break
                yield result
        finally:
            for f in pending:
                f.cancel()


def build_cache(
    out_dir: str | os.PathLike,
    shards: Iterable[Shard],
    tokenizer_dir: str | os.PathLike,
    *,
    num_workers: int = 0,
    shard_group_size: int = 8,
    progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenize ``shards`` into a token cache at ``out_dir``; return the final ledger.

    Args:
        out_dir: a local directory or a TensorStore kvstore URL (``gs://...``, ``memory://...``).
        shards: picklable objects with ``.name``, ``.fingerprint`` and ``.iter_texts()``; their
            order is the documents' order in the cache.
        tokenizer_dir: directory with ``tokenizer.json`` and ``tokenizer_config.json`` (eos_token).
        num_workers: tokenizer processes; 0 = all cores; 1 = tokenize in this process. Workers
            are started with ``spawn`` (never ``fork``: TensorStore runs threads), so a script
            that builds with several workers needs the ``if __name__ == "__main__":`` guard.
        shard_group_size: shards per commit (the unit of resumption).
        progress: show a progress bar.
        overwrite: replace an existing cache that was built from other inputs (by default that
            raises :class:`CacheMismatchError`).

    Idempotent: a complete cache with the same inputs is returned untouched; an interrupted one
    is resumed from its last committed group.
    """
    shards = list(shards)
    if shard_group_size < 1:
        raise ValueError(f"shard_group_size must be >= 1, got {shard_group_size}")
    workers = _resolve_workers(num_workers)
    tokenizer_dir = os.fspath(tokenizer_dir)
    root = CacheRoot(out_dir)
    info = tokenizer_info(tokenizer_dir)
    plan = shard_plan(shards)
    with root.build_lock():
        ledger = root.read_json(LEDGER)
        if ledger is not None:
            problem = incompatibility(ledger, info, plan)
            if problem and not overwrite:
                raise CacheMismatchError(
                    f"{root}: the existing token cache does not match this build: {problem}. "
                    "Use another directory or pass overwrite=True."
                )
            if problem:
                log.warning("%s: replacing the token cache (%s)", root, problem)
                ledger = None
            elif ledger["complete"] and root.exists(COMPLETE):
                return ledger
        if ledger is None:
            ledger, arrays = start_cache(root, info, plan)
        else:
            arrays = open_arrays(root)
        _build(root, ledger, arrays, shards, tokenizer_dir, info, workers, shard_group_size, progress)
        finalize_cache(root, ledger, arrays)
    return ledger


def _build(
    root: CacheRoot,
    ledger: dict[str, Any],
    arrays: Arrays,
    shards: list[Shard],
    tokenizer_dir: str,
    info: TokenizerInfo,
    workers: int,
    group_size: int,
    progress: bool,
) -> None:
    """Tokenize the shards past the ledger's committed ones and commit them in groups."""
    done = ledger["committed"]["shards"]
    todo = shards[done:]
    if not todo:
        return
    if done:
        log.info("%s: resuming the token cache build at shard %d of %d", root, done, len(shards))
    workers = min(workers, len(todo))
    if workers <= 1:
        encoder = DocumentEncoder(tokenizer_dir, info)
        results: Iterator[EncodedShard] = map(encoder.encode_shard, todo)
    else:
        results = _ordered_map(worker_encode, todo, workers, worker_init, (tokenizer_dir, info))
    committer = Committer(root, ledger, arrays)
    from tqdm.auto import tqdm

    bar = tqdm(total=len(shards), initial=done, desc="tokenize", unit="shard", disable=None if progress else True,
               dynamic_ncols=True, file=sys.stderr)
    try:
        for i, part in enumerate(results):
            committer.append(todo[i], part)
            if len(committer.staged) == group_size or i + 1 == len(todo):
                n = len(committer.staged)
                committer.commit()
                bar.update(n)
                bar.set_postfix(tokens=ledger["committed"]["tokens"], refresh=False)
    finally:
        bar.close()
        if hasattr(results, "close"):
            results.close()  # shuts the pool down on errors too

