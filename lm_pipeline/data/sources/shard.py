"""Shards: one unit of input data (a file, or rows of a Hugging Face dataset), and its fingerprint.

:class:`Shard` is picklable and is what the token-cache builder consumes: ``.name`` (stable,
human-readable), ``.url``, ``.fingerprint`` and ``.iter_texts()`` (valid texts, in order, under
the validation policy; see :mod:`lm_pipeline.data.validation`). Per-shard counts land in a
:class:`~lm_pipeline.data.validation.ShardReport`: pass one to ``iter_texts(report)``, read
``shard.last_report`` afterwards, or call ``shard.scan()``.

Fingerprints (:func:`shard_fingerprint`): file shards hash the shard's raw (still compressed)
bytes plus the reader settings that affect the texts (format, compression, text_key, min_length,
on_invalid, text_unit, json_records_key). Computed lazily on first access, or while
``iter_texts`` streams the file; if both happen, a mismatch raises :class:`ShardChangedError`.
Hugging Face shards get theirs when resolved, from the dataset's identity (see
:mod:`lm_pipeline.data.sources.hf`) plus the row range or shard index.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import asdict

from lm_pipeline import fs
from lm_pipeline.data.sources.hf import HFSpec, iter_hf
from lm_pipeline.data.sources.readers import READER_VERSION, ReaderSettings, read_parquet, read_records
from lm_pipeline.data.sources.streams import (
    CORRUPT_STREAM_ERRORS,
    HashingReader,
    decompress,
    open_raw,
)
from lm_pipeline.data.validation import (
    DataValidationError,
    RawRecord,
    RecordValidator,
    ShardChangedError,
    ShardReport,
)

logger = logging.getLogger(__name__)

__all__ = ["Shard", "iter_shard_texts", "scan_shards", "shard_fingerprint"]


def shard_fingerprint(settings: ReaderSettings, content: str, hf: HFSpec | None = None) -> str:
    """Hex sha256 of what a shard's texts depend on: the reader version and ``settings``, ``content``
    (the raw bytes' sha256, or a Hugging Face dataset's identity) and, for ``hf``, which rows."""
    fields = asdict(settings)
    if not fields["chat"]:  # text sources: their fingerprints as before the chat flag existed
        del fields["chat"]
    doc = {"reader_version": READER_VERSION, "settings": fields, "content": content}
    if hf is not None:
        # a save_to_disk dataset is identified by its content, not by where it lies
        skip = ("loader", "path") if hf.loader == "disk" else ("loader",)
        doc["hf"] = {k: v for k, v in asdict(hf).items() if k not in skip}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


class Shard:
    """One unit of input data. Picklable; ``iter_texts`` may run in a worker process.

    Attributes:
        name: stable, human-readable name, unique within its split.
        url: where the bytes are: a path / fsspec URL, or the dataset id / directory (Hugging Face).
        settings: the :class:`ReaderSettings`.
        hf: for Hugging Face datasets, the :class:`HFSpec`; None for files.
        last_report: the :class:`ShardReport` of the latest ``iter_texts`` in this process.

    ``fingerprint``: a known fingerprint (Hugging Face shards get theirs when resolved); a file
    shard's is computed when first needed.
    """

    def __init__(
        self,
        name: str,
        url: str,
        settings: ReaderSettings,
        hf: HFSpec | None = None,
        *,
        fingerprint: str | None = None,
    ):
        self.name = name
        self.url = url
        self.settings = settings
        self.hf = hf
        self._fingerprint = fingerprint
        self._raw_sha256: str | None = None
        self.last_report: ShardReport | None = None

    def __repr__(self) -> str:
        return f"Shard({self.name!r}, format={self.settings.format!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Shard):
            return NotImplemented
        return (self.name, self.url, self.settings, self.hf) == (
            other.name,
            other.url,
            other.settings,
            other.hf,
        )

    def __hash__(self) -> int:
        return hash((self.name, self.url, self.settings, self.hf))

    # fingerprint --------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """sha256 of the raw bytes plus reader settings (computed once, then cached)."""
        if self._fingerprint is None:
            if self.hf is not None:  # pragma: no cover - HF shards get theirs at resolve time
                raise RuntimeError(f"{self.name}: Hugging Face shard without a fingerprint")
            if self._raw_sha256 is None:
                self._raw_sha256 = fs.sha256_of(self.url)
            self._fingerprint = shard_fingerprint(self.settings, self._raw_sha256, self.hf)
        return self._fingerprint

    # reading ------------------------------------------------------------------------------
    def iter_records(self, report: ShardReport | None = None) -> Iterator[RawRecord]:
        """All records as read, before validation (parse problems attached). A chat source's
        conversations come as their messages' JSON text (one line naming a record that is none)."""
        if not self.settings.chat:
            yield from self._iter_records(report)
            return
        from lm_pipeline.data.chat import messages_problem

        for rec in self._iter_records(report):
            if rec.reason or not rec.present:
                yield rec
                continue
            problem = messages_problem(rec.value)
            if problem is not None:
                yield RawRecord(rec.location, "bad_json", f"{self.settings.text_key!r} is not a conversation: {problem}",
                                False)
                continue
            yield rec._replace(value=json.dumps(rec.value, ensure_ascii=False))

    def _iter_records(self, report: ShardReport | None = None) -> Iterator[RawRecord]:
        report = report if report is not None else ShardReport(self.name)
        s = self.settings
        if self.hf is not None:
            yield from iter_hf(self.hf, s)
            return
        if s.format == "parquet":
            with open_raw(self.url) as f:
                if s.compression is None:
                    yield from read_parquet(f, s, report)
                else:
                    with decompress(f, s.compression) as d:
                        yield from read_parquet(io.BytesIO(d.read()), s, report)
            return
        with open_raw(self.url) as raw:
            hashing = HashingReader(raw)
            with decompress(hashing, s.compression) as stream:
                try:
                    yield from read_records(stream, s, report)
                except DataValidationError as e:  # file-level problems raised without a source
                    raise DataValidationError(self.url, e.location, e.reason, e.detail, e.hint) from None
                except CORRUPT_STREAM_ERRORS as e:  # the rest of the file is unreadable
                    detail = f"the {s.compression or s.format} stream is truncated or corrupt ({type(e).__name__}: {e})"
                    if "Not a gzipped file" in str(e):
                        detail = ("the file is not gzip-compressed although its name ends in .gz (rename it without "
                                  ".gz if it is plain text)")
                    if s.on_invalid == "skip":  # keep what came before the damage, say so, go on
                        report.damaged = f"{detail}; the records before the damage are kept, the rest is unread"
                        logger.warning("%s: %s", self.url, report.damaged)
                        return
                    raise DataValidationError(
                        self.url, "", "corrupt_file", detail,
                        "re-download or re-compress the file, remove it from the data urls, or set "
                        "data.on_invalid: skip to keep the records before the damage",
                    ) from None
                digest = hashing.drain()
        expected = self._raw_sha256
        if expected is not None and digest != expected:
            raise ShardChangedError(
                f"{self.url}: the file changed since it was fingerprinted; rebuild from the new data"
            )
        if self._raw_sha256 is None and self._fingerprint is None:
            self._raw_sha256 = digest
            self._fingerprint = shard_fingerprint(self.settings, digest, self.hf)

    def iter_texts(self, report: ShardReport | None = None, *, check=None) -> Iterator[str]:
        """The valid texts, in order. Invalid records raise (``fail``) or are counted (``skip``)
        in ``report`` (a fresh :class:`ShardReport` if None; also kept as ``self.last_report``).
        ``check``: a further check of each valid text (why it is invalid, or None; a chat
        source's rendering, see :class:`~lm_pipeline.data.validation.RecordValidator`)."""
        report = report if report is not None else ShardReport(self.name)
        report.complete = False
        self.last_report = report
        s = self.settings
        source = self.url if self.hf is None else self.name
        label = "the text" if s.format == "text" else None
        validator = RecordValidator(source, s.text_key, s.min_length, s.on_invalid, label=label, check=check)
        yield from validator.iter_valid(self.iter_records(report), report)
        report.complete = True

    def scan(self) -> ShardReport:
        """Read the whole shard under its policy and return its counts."""
        report = ShardReport(self.name)
        for _ in self.iter_texts(report):
            pass
        return report


def iter_shard_texts(shards: Iterable[Shard], reports: dict[str, ShardReport] | None = None) -> Iterator[str]:
    """The valid texts of several shards in order (e.g. to train a tokenizer); fills ``reports``."""
    for shard in shards:
        report = ShardReport(shard.name)
        if reports is not None:
            reports[shard.name] = report
        yield from shard.iter_texts(report)


def scan_shards(shards: Iterable[Shard]) -> dict[str, ShardReport]:
    """Validate every shard; {shard name: report}."""
    return {s.name: s.scan() for s in shards}
