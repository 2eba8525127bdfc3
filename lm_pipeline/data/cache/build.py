"""Building a token cache: tokenize shards (in worker processes), commit them in shard order.

Each shard's ids, offsets and byte counts are written past the committed counts one encode batch
(a part of at most ``encode.PART_CHARS`` characters) at a time, as they are tokenized, so memory
does not grow with the shards' size; once a group of ``shard_group_size`` whole shards is written
the ledger is replaced (the commit). A killed build resumes from its last committed group and
ends byte-identical to an uninterrupted one; the output never depends on the number of workers.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from lm_pipeline import fs
from lm_pipeline.data import encode
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
    worker_main,
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


#: With ``num_workers=0`` (all cores), inputs of known size below this many bytes are tokenized in
#: the building process: a spawned worker's start-up (an interpreter, the tokenizer: ~1 s) costs
#: more than it saves there, and the in-process tokenizer batches on all cores itself. A 3.5 MB
#: corpus took 0.4 s in-process against 1.5 s with two workers (``docs/benchmarks.md``).
SMALL_INPUT_BYTES = 8 << 20


def input_bytes(shards: Sequence[Shard]) -> int | None:
    """The shards' total size where every one's is known without reading it: bytes of local
    uncompressed text/JSON files, characters of in-memory texts; None otherwise (object stores,
    Hugging Face datasets, compressed or Parquet files, whose text may be many times their size)."""
    total = 0
    for shard in shards:
        texts = getattr(shard, "texts", None)
        url = getattr(shard, "url", None)
        if isinstance(texts, tuple):
            total += sum(len(t) for t in texts)
        elif (isinstance(url, str) and getattr(shard, "hf", None) is None and _plain(shard)
              and (local := fs.as_local(url)) is not None and os.path.isfile(local)):
            total += os.path.getsize(local)
        else:
            return None
    return total


def _plain(shard: Shard) -> bool:
    """Whether a file shard's size on disk is about its text's: not compressed, not Parquet."""
    settings = getattr(shard, "settings", None)
    return settings is None or (getattr(settings, "compression", None) is None
                                and getattr(settings, "format", None) != "parquet")


# Encoded parts a worker may hold ready beyond the one being written, per worker: ~4 encode
# batches make an 8 MB shard, so a worker can run about two such shards ahead of the writer.
PARTS_AHEAD = 8
_POLL_S = 1.0

# What the writer consumes: (shard index in the list given, a part of it), then (index, None)
# once the shard's parts are all given.
PartStream = Iterator[tuple[int, EncodedShard | None]]


def _local_parts(shards: Sequence[Shard], tokenizer_dir: str, info: TokenizerInfo, chat: Any = None) -> PartStream:
    encoder = DocumentEncoder(tokenizer_dir, info, part_docs=encode.PART_DOCS, part_chars=encode.PART_CHARS, chat=chat)
    for i, shard in enumerate(shards):
        for part in encoder.iter_shard(shard):
            yield i, part
        yield i, None


def _worker_parts(shards: Sequence[Shard], workers: int, tokenizer_dir: str, info: TokenizerInfo,
                  chat: Any = None) -> PartStream:
    """The shards' parts, tokenized by ``workers`` processes, in shard order.

    Shard ``i`` goes to worker ``i % workers``, which streams its parts through its own queue of
    :data:`PARTS_AHEAD` parts: memory is bounded by the parts, whatever the shards' sizes, and the
    order costs no buffering (the writer reads one worker's queue at a time; a worker that is
    ahead waits on its full queue). Shards much bigger than the queue thus overlap less.
    """
    ctx = multiprocessing.get_context("spawn")  # never fork a process that runs TensorStore threads
    tasks = [ctx.Queue() for _ in range(workers)]
    results = [ctx.Queue(PARTS_AHEAD) for _ in range(workers)]
    args = (tokenizer_dir, info)
    limits = (encode.PART_DOCS, encode.PART_CHARS, chat)
    procs = [ctx.Process(target=worker_main, args=(*args, tasks[w], results[w], *limits), daemon=True,
                         name=f"lm_pipeline-tokenizer-{w}") for w in range(workers)]
    try:
        for p in procs:
            p.start()
        for i, shard in enumerate(shards):
            tasks[i % workers].put((i, shard))
        for q in tasks:
            q.put(None)
        for i in range(len(shards)):
            w = i % workers
            while True:
                index, kind, payload = _receive(results[w], procs[w], shards[i])
                if kind == "error":
                    message, trace, user = payload
                    log.debug("tokenizer worker %d failed:\n%s", w, trace)
                    if user is not None:  # invalid data: the error that names the file and record
                        raise user
                    raise RuntimeError(message)
                if index != i:
                    raise RuntimeError(f"tokenizer worker {w} sent shard {index}, expected {i}")
                yield i, (payload if kind == "part" else None)
                if kind == "end":
                    break
    finally:
        for q in tasks:
            q.cancel_join_thread()
            q.close()
        for p in procs:
            if p.pid is None:  # never started
                continue
            p.join(timeout=0.5 if p.is_alive() else None)
            if p.is_alive():  # still working (an error or an early stop): it holds nothing we need
                p.terminate()
                p.join()
        for q in results:
            q.close()


def _receive(q: Any, proc: Any, shard: Shard) -> tuple[int, str, Any]:
    """The next message from a worker's queue; raises if the worker died without one."""
    while True:
        try:
            return q.get(timeout=_POLL_S)
        except queue.Empty:
            if not proc.is_alive():
                try:
                    return q.get(timeout=_POLL_S)  # sent just before it exited
                except queue.Empty:
                    raise RuntimeError(
                        f"tokenizing shard {shard.name!r} failed: the tokenizer worker process died "
                        f"(exit code {proc.exitcode})"
                    ) from None


def build_cache(
    out_dir: str | os.PathLike,
    shards: Iterable[Shard],
    tokenizer_dir: str | os.PathLike,
    *,
    num_workers: int = 0,
    shard_group_size: int = 8,
    progress: bool = True,
    overwrite: bool = False,
    chat: Any = None,
) -> dict[str, Any]:
    """Tokenize ``shards`` into a token cache at ``out_dir``; return the final ledger.

    Args:
        out_dir: a local directory or a TensorStore kvstore URL (``gs://...``, ``memory://...``).
        shards: picklable objects with ``.name``, ``.fingerprint`` and ``.iter_texts()``; their
            order is the documents' order in the cache.
        tokenizer_dir: directory with ``tokenizer.json`` and ``tokenizer_config.json`` (eos_token).
        num_workers: tokenizer processes; 0 = all cores (this process alone for an input of
            known size under :data:`SMALL_INPUT_BYTES`); 1 = tokenize in this process. Workers
            are started with ``spawn`` (never ``fork``: TensorStore runs threads), so a script
            that builds with several workers needs the ``if __name__ == "__main__":`` guard.
        shard_group_size: shards per commit (the unit of resumption).
        progress: show a progress bar.
        overwrite: replace an existing cache that was built from other inputs (by default that
            raises :class:`CacheMismatchError`).
        chat: a chat source's :class:`~lm_pipeline.data.chat.ChatSettings`: each shard's texts
            are conversations (their messages' JSON), rendered into ids and a loss mask stored
            beside them (``loss_mask/``); the ledger's ``settings.chat`` records the settings.

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
    chat_ledger = chat.ledger() if chat is not None else None
    with root.build_lock():
        ledger = root.read_json(LEDGER)
        if ledger is not None:
            problem = incompatibility(ledger, info, plan, chat_ledger)
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
            ledger, arrays = start_cache(root, info, plan, chat_ledger)
        else:
            arrays = open_arrays(root, chat=chat is not None)
        _build(root, ledger, arrays, shards, tokenizer_dir, info, workers, shard_group_size, progress, chat,
               auto_workers=num_workers == 0)
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
    chat: Any = None,
    auto_workers: bool = False,
) -> None:
    """Tokenize the shards past the ledger's committed ones and commit them in groups (in this
    process where ``auto_workers`` and the input is small: :data:`SMALL_INPUT_BYTES`)."""
    done = ledger["committed"]["shards"]
    todo = shards[done:]
    if not todo:
        return
    if done:
        log.info("%s: resuming the token cache build at shard %d of %d", root, done, len(shards))
    workers = min(workers, len(todo))
    if auto_workers and workers > 1 and (size := input_bytes(todo)) is not None and size < SMALL_INPUT_BYTES:
        log.debug("%s: %d bytes to tokenize: in this process", root, size)
        workers = 1
    if workers <= 1:
        parts = _local_parts(todo, tokenizer_dir, info, chat)
    else:
        parts = _worker_parts(todo, workers, tokenizer_dir, info, chat)
    committer = Committer(root, ledger, arrays)
    from tqdm.auto import tqdm

    bar = tqdm(total=len(shards), initial=done, desc="tokenize", unit="shard", disable=None if progress else True,
               dynamic_ncols=True, file=sys.stderr)
    try:
        for i, part in parts:
            if part is not None:
                committer.append_part(part)  # past the committed counts: invisible until the commit
                continue
            committer.end_shard(todo[i])
            if len(committer.staged) == group_size or i + 1 == len(todo):
                n = len(committer.staged)
                committer.commit()
                bar.update(n)
                bar.set_postfix(tokens=ledger["committed"]["tokens"], refresh=False)
    finally:
        bar.close()
        parts.close()  # stops the workers on errors too

