"""Document tokenization for the token cache: special-token detection and shard encoding.

Kept free of TensorStore so that cache-building worker processes start quickly: a worker only
imports this module, numpy, ``tokenizers`` and :mod:`lm_pipeline.fs` (which reads its shards too).

Conventions (recorded in the cache ledger, see :func:`TokenizerInfo.settings`):

* Documents are encoded with ``add_special_tokens=True``, so whatever the tokenizer's
  post-processor adds (a BOS, say) is kept; nothing is assumed. What it adds is detected once by
  encoding a probe text with and without special tokens.
* EOS is appended to every document, unless the post-processor already ends every encoding with
  EOS (then it is not doubled).
* Special-token strings occurring *inside* a document's text (e.g. a literal ``<|endoftext|>``)
  are encoded as plain text (``encode_special_tokens = True``), so the only EOS in a document is
  its terminator.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any, NamedTuple, Protocol

import numpy as np

from lm_pipeline import fs

TOKEN_DTYPE = np.uint32
_PROBE = "lm_pipeline probe: hello world 123"
# One encode batch = one part the cache builder appends: at most this many documents, and at most
# this many characters unless it is a single longer document (see DocumentEncoder.iter_parts).
PART_DOCS = 512
PART_CHARS = 1 << 21


class Shard(Protocol):
    """What the cache builder consumes: a picklable, named, fingerprinted stream of texts."""

    name: str
    fingerprint: str

    def iter_texts(self) -> Iterator[str]: ...


class EncodedShard(NamedTuple):
    """One shard, tokenized: concatenated ids, per-document token counts and UTF-8 byte counts;
    for a chat source also the per-token loss mask (uint8, 1 = trained on; see :mod:`.chat`)."""

    tokens: np.ndarray  # uint32 [num_tokens]
    doc_lengths: np.ndarray  # int64 [num_docs]
    doc_bytes: np.ndarray  # int64 [num_docs]
    loss_mask: np.ndarray | None = None  # uint8 [num_tokens] (chat sources only)


def _token_string(value: Any) -> str | None:
    """``tokenizer_config.json`` stores special tokens as strings or AddedToken dicts."""
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


def _find(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i : i + len(needle)] == needle:
            return i
    return -1


@dataclass(frozen=True)
class TokenizerInfo:
    """What the cache needs to know about a tokenizer directory."""

    path: str
    fingerprint: str  # sha256 of tokenizer.json
    vocab_size: int
    eos_token: str
    eos_id: int
    bos_token: str | None
    prefix_ids: tuple[int, ...]  # ids the post-processor puts before every encoding (e.g. BOS)
    suffix_ids: tuple[int, ...]  # ids it puts after
    append_eos: bool  # False when the post-processor already ends encodings with EOS

    def settings(self) -> dict[str, Any]:
        """The tokenization settings that change the cache's bytes (stored in the ledger)."""
        return {
            "token_dtype": np.dtype(TOKEN_DTYPE).name,
            "eos_token": self.eos_token,
            "eos_id": self.eos_id,
            "bos_token": self.bos_token,
            "prefix_ids": list(self.prefix_ids),
            "suffix_ids": list(self.suffix_ids),
            "append_eos": self.append_eos,
            "add_special_tokens": True,
            "special_tokens_in_text": "literal",
            "vocab_size": self.vocab_size,
        }


def tokenizer_fingerprint(tokenizer_dir: str) -> str:
    """sha256 (hex) of the directory's ``tokenizer.json``."""
    return hashlib.sha256(fs.read_bytes(fs.join(tokenizer_dir, "tokenizer.json"), missing_ok=False)).hexdigest()


def load_tokenizer(tokenizer_dir: str):
    """The ``tokenizers.Tokenizer`` of a directory, set up for document encoding."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(fs.read_bytes(fs.join(tokenizer_dir, "tokenizer.json"), missing_ok=False).decode("utf-8"))
    tok.encode_special_tokens = True  # special-token strings inside documents stay plain text
    tok.no_padding()
    tok.no_truncation()
    return tok


def tokenizer_info(tokenizer_dir: str, tok=None) -> TokenizerInfo:
    """Inspect a tokenizer directory: fingerprint, EOS, and what the post-processor adds."""
    tokenizer_dir = os.fspath(tokenizer_dir)
    raw = fs.read_bytes(fs.join(tokenizer_dir, "tokenizer.json"), missing_ok=False)
    fingerprint = hashlib.sha256(raw).hexdigest()
    tok = tok or load_tokenizer(tokenizer_dir)
    cfg = json.loads(fs.read_bytes(fs.join(tokenizer_dir, "tokenizer_config.json")) or "{}")
    eos_token = _token_string(cfg.get("eos_token"))
    if not eos_token:
        raise ValueError(
            f"{tokenizer_dir}: tokenizer_config.json names no eos_token; the cache appends EOS to every document"
        )
    eos_id = tok.token_to_id(eos_token)
    if eos_id is None:
        raise ValueError(f"{tokenizer_dir}: eos_token {eos_token!r} is not in the vocabulary")
    bos_token = _token_string(cfg.get("bos_token"))
    with_sp = tok.encode(_PROBE, add_special_tokens=True).ids
    without = tok.encode(_PROBE, add_special_tokens=False).ids
    at = _find(with_sp, without)
    if at < 0:
        raise ValueError(
            f"{tokenizer_dir}: cannot tell which special tokens the tokenizer adds "
            "(the encoding with special tokens does not contain the one without)"
        )
    prefix, suffix = with_sp[:at], with_sp[at + len(without) :]
    return TokenizerInfo(
        path=tokenizer_dir,
        fingerprint=fingerprint,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        eos_token=eos_token,
        eos_id=int(eos_id),
        bos_token=bos_token,
        prefix_ids=tuple(int(i) for i in prefix),
        suffix_ids=tuple(int(i) for i in suffix),
        append_eos=not (suffix and suffix[-1] == eos_id),
    )


class DocumentEncoder:
    """Encodes documents the cache's way (see the module docstring)."""

    def __init__(self, tokenizer_dir: str, info: TokenizerInfo | None = None, *, part_docs: int | None = None,
                 part_chars: int | None = None, chat: Any = None):
        self.part_docs = part_docs or PART_DOCS
        self.part_chars = part_chars or PART_CHARS
        self.tok = load_tokenizer(tokenizer_dir)
        self.info = info or tokenizer_info(tokenizer_dir, self.tok)
        fast = getattr(self.tok, "encode_batch_fast", None)  # skips offsets; tokenizers >= 0.21
        self._encode_batch = fast if fast is not None else self.tok.encode_batch
        self.chat = None
        if chat is not None:  # a chat source: records are conversations (lm_pipeline.data.chat)
            from lm_pipeline.data.chat import ChatRenderer

            self.chat = ChatRenderer(tokenizer_dir, chat, self.tok, self.info)

    def _encode_chats(self, texts: list[str]) -> EncodedShard:
        ids, masks, nbytes = [], [], []
        for text in texts:
            try:
                i, m, b = self.chat.encode(text)
            except Exception as e:
                raise ValueError(f"conversation {text[:80]!r}{'...' if len(text) > 80 else ''}: {e}") from e
            ids.append(i)
            masks.append(m)
            nbytes.append(b)
        lens = np.fromiter(map(len, ids), np.int64, len(ids))
        flat = np.fromiter(chain.from_iterable(ids), TOKEN_DTYPE, int(lens.sum()))
        from lm_pipeline.data.chat import MASK_DTYPE

        mask = np.concatenate(masks).astype(MASK_DTYPE) if masks else np.zeros(0, MASK_DTYPE)
        return EncodedShard(flat, lens, np.asarray(nbytes, np.int64), mask)

    def encode_texts(self, texts: list[str]) -> EncodedShard:
        """Encode one batch of documents."""
        if self.chat is not None:
            return self._encode_chats(texts)
        if not texts:
            return EncodedShard(np.zeros(0, TOKEN_DTYPE), np.zeros(0, np.int64), np.zeros(0, np.int64))
        ids = [e.ids for e in self._encode_batch(texts, add_special_tokens=True)]
        lens = np.fromiter(map(len, ids), np.int64, len(ids))
        flat = np.fromiter(chain.from_iterable(ids), TOKEN_DTYPE, int(lens.sum()))
        if self.info.append_eos:
            flat = np.insert(flat, np.cumsum(lens), TOKEN_DTYPE(self.info.eos_id))
            lens = lens + 1
        nbytes = np.fromiter(
            (len(t) if t.isascii() else len(t.encode("utf-8")) for t in texts), np.int64, len(texts)
        )
        return EncodedShard(flat, lens, nbytes)

    def iter_parts(self, texts: Iterable[str]) -> Iterator[EncodedShard]:
        """Encode a stream of documents one batch at a time: one part per encode batch.

        A batch closes at ``part_docs`` documents (:data:`PART_DOCS`), or before the document that
        would take it past ``part_chars`` characters (:data:`PART_CHARS`; a single longer document
        is a part of its own), so the memory a caller needs is bounded by the part size, not by
        the stream's length. At least one (possibly empty) part is yielded. Concatenating the parts
        gives :meth:`encode_stream`'s result: tokenization is per document, whatever the batching.
        """
        batch: list[str] = []
        chars = 0
        yielded = False
        max_docs, max_chars = self.part_docs, self.part_chars
        for text in texts:
            if not isinstance(text, str):
                raise TypeError(f"documents must be str, got {type(text).__name__}")
            if batch and chars + len(text) > max_chars:
                yield self.encode_texts(batch)
                yielded = True
                batch, chars = [], 0
            batch.append(text)
            chars += len(text)
            if len(batch) >= max_docs or chars >= max_chars:
                yield self.encode_texts(batch)
                yielded = True
                batch, chars = [], 0
        if batch or not yielded:
            yield self.encode_texts(batch)

    def encode_stream(self, texts: Iterable[str]) -> EncodedShard:
        """Encode a stream of documents whole (the concatenation of :meth:`iter_parts`)."""
        return concat_parts(list(self.iter_parts(texts)))

    def iter_shard(self, shard: Shard) -> Iterator[EncodedShard]:
        """:meth:`iter_parts` over a shard's texts; errors name the shard."""
        from lm_pipeline.data.validation import DataValidationError, ShardChangedError

        try:
            if self.chat is not None:  # a conversation that cannot be rendered: an invalid record
                yield from self.iter_parts(shard.iter_texts(check=self.chat.check))
                report = getattr(shard, "last_report", None)
                bad = report.skipped.get("bad_conversation", 0) if report is not None else 0
                if bad:
                    import logging

                    logging.getLogger(__name__).warning(
                        "%s: skipped %d conversation(s) that cannot be trained on (data.on_invalid: skip)",
                        getattr(shard, "url", shard.name), bad)
            else:
                yield from self.iter_parts(shard.iter_texts())
        except (DataValidationError, ShardChangedError):
            raise  # a user error naming the file and record
        except Exception as e:
            raise RuntimeError(f"tokenizing shard {shard.name!r} failed: {e}") from e

    def encode_shard(self, shard: Shard) -> EncodedShard:
        """A whole shard, encoded (holds all its ids: the cache builder streams :meth:`iter_shard`)."""
        return concat_parts(list(self.iter_shard(shard)))


def concat_parts(parts: list[EncodedShard]) -> EncodedShard:
    """The parts of one stream joined into one."""
    if len(parts) == 1:
        return parts[0]
    if any(p.loss_mask is not None for p in parts):
        return EncodedShard(*(np.concatenate(p) for p in zip(*parts, strict=True)))
    return EncodedShard(*(np.concatenate(p) for p in zip(*(p[:3] for p in parts), strict=True)))


# --- worker-process side ---------------------------------------------------------------------


def worker_main(tokenizer_dir: str, info: TokenizerInfo, tasks: Any, results: Any,
                part_docs: int | None = None, part_chars: int | None = None, chat: Any = None) -> None:
    """A tokenizer worker process (see :mod:`lm_pipeline.data.cache.build`).

    Takes ``(index, shard)`` tasks from ``tasks`` until ``None``; for each, puts ``(index,
    "part", EncodedShard)`` on ``results`` per encode batch, then ``(index, "end", None)``. A
    failure puts ``(index, "error", (message, traceback))`` and ends the worker. ``results`` is bounded, so a
    worker ahead of the writer waits instead of holding its shard in memory.
    """
    # The workers are the parallelism; the tokenizer's own thread pool would oversubscribe cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    index = -1
    try:
        encoder = DocumentEncoder(tokenizer_dir, info, part_docs=part_docs, part_chars=part_chars, chat=chat)
        while (task := tasks.get()) is not None:
            index, shard = task
            for part in encoder.iter_shard(shard):
                results.put((index, "part", part))
            results.put((index, "end", None))
    except Exception as e:  # reported to the builder, which raises it
        import traceback

        from lm_pipeline.data.validation import DataValidationError, ShardChangedError

        # a data error crosses as itself (picklable), so the builder raises what a user fixes
        user = e if isinstance(e, (DataValidationError, ShardChangedError)) else None
        results.put((index, "error", (str(e), traceback.format_exc(), user)))
