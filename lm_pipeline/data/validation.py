"""Record validation: a pandera schema over chunks of records, with per-record error locations.

Readers (see :mod:`lm_pipeline.data.sources`) turn a shard into :class:`RawRecord` tuples, one per
JSONL line / JSON array item / Parquet or dataset row / text document. Problems found while
*parsing* one record (invalid UTF-8 in its bytes, a JSON syntax error, a JSON value that is not an
object) are attached to that record, so one bad line never takes the rest of the file with it.
The :class:`RecordValidator` then checks chunks of records against a pandera
``DataFrameSchema`` whose checks are mutually exclusive, one per :data:`REASONS` entry, in this
order (a record is reported under the first reason that applies):

=================  ===========================================================================
``bad_json``       the line / item is not valid JSON
``invalid_utf8``   its bytes are not valid UTF-8, or the text holds a lone surrogate
``not_object``     a JSON record that is not an object (``{...}``)
``missing_key``    the record has no ``text_key``
``not_string``     the value under ``text_key`` is not a string (null, number, list, ...)
``empty``          the text is empty or only whitespace (while ``min_length >= 1``)
``too_short``      fewer than ``min_length`` characters after stripping whitespace
``bad_conversation`` a chat source's conversation the chat template cannot render into something
                   to train on (no assistant text, the template's ``raise_exception(...)``, a
                   single-turn message without string content); checked by the cache builder,
                   which renders it (see :mod:`lm_pipeline.data.chat`)
=================  ===========================================================================

Policy ``fail`` raises :class:`DataValidationError` for the first invalid record (lowest position
in the shard) naming the file, the line or row, the problem and a fix. Policy ``skip`` drops the
record and counts it per reason in the shard's :class:`ShardReport`; nothing is dropped silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, NamedTuple

REASONS: tuple[str, ...] = (
    "bad_json",
    "invalid_utf8",
    "not_object",
    "missing_key",
    "not_string",
    "empty",
    "too_short",
    "bad_conversation",
)
_PARSE_REASONS = frozenset({"bad_json", "invalid_utf8", "not_object"})

#: Records are validated in chunks of at most this many records ...
CHUNK_RECORDS = 4096
#: ... or this many characters of text, whichever comes first.
CHUNK_CHARS = 8 << 20


class DataValidationError(ValueError):
    """An invalid record under ``on_invalid: fail``: where it is, what is wrong, how to fix it."""

    def __init__(self, source: str, location: str, reason: str, detail: str, hint: str = ""):
        self.source = source
        self.location = location
        self.reason = reason
        self.detail = detail
        self.hint = hint
        where = f"{source} {location}" if location else source
        super().__init__(f"{where}: {detail}" + (f"; {hint}" if hint else ""))

    def __reduce__(self):  # keep the fields when the error crosses a process boundary
        return (type(self), (self.source, self.location, self.reason, self.detail, self.hint))


class ShardChangedError(RuntimeError):
    """A shard's bytes changed between fingerprinting and reading."""


class RawRecord(NamedTuple):
    """One record as read, before validation.

    location: human-readable position, e.g. ``"line 7"`` or ``"row 12"``.
    reason: a parse-level problem (``bad_json``, ``invalid_utf8``, ``not_object``) or ``""``.
    detail: explanation of the parse problem (empty otherwise).
    present: whether the record has the text field.
    value: the value under the text field (anything; validated later).
    keys: the record's keys / columns, for the ``missing_key`` message.
    """

    location: str
    reason: str = ""
    detail: str = ""
    present: bool = True
    value: Any = None
    keys: tuple[str, ...] = ()


@dataclasses.dataclass
class ShardReport:
    """Per-shard counts: records read, valid records, invalid records per reason."""

    shard: str
    records: int = 0
    valid: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    blank_lines: int = 0
    complete: bool = False
    #: Under ``skip``: why the shard could be read only partly (a corrupt or truncated compressed
    #: stream); the records before the damage are kept, the rest is unread. None: read whole.
    damaged: str | None = None

    @property
    def invalid(self) -> int:
        return sum(self.skipped.values())

    def count_invalid(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "records": self.records,
            "valid": self.valid,
            "invalid": self.invalid,
            "skipped": {r: self.skipped[r] for r in REASONS if r in self.skipped},
            "blank_lines": self.blank_lines,
            "complete": self.complete,
            **({"damaged": self.damaged} if self.damaged else {}),
        }


def merge_reports(reports: Iterable[ShardReport], name: str = "total") -> ShardReport:
    """Sum of several shards' reports."""
    out = ShardReport(name, complete=True)
    for r in reports:
        out.records += r.records
        out.valid += r.valid
        out.blank_lines += r.blank_lines
        out.complete = out.complete and r.complete
        for k, v in r.skipped.items():
            out.skipped[k] = out.skipped.get(k, 0) + v
    return out


# --- the pandera schema ---------------------------------------------------------------------

_SCHEMAS: dict[int, Any] = {}


def record_schema(min_length: int):
    """The pandera ``DataFrameSchema`` a chunk of records must satisfy.

    Columns: ``reason`` (parse problem or ""), ``present``, ``is_str``, ``utf8_ok`` (bool) and
    ``stripped_len`` (int, -1 when not a string). One wide check per reason, mutually exclusive,
    so every invalid row fails exactly one named check.
    """
    schema = _SCHEMAS.get(min_length)
    if schema is not None:
        return schema
    import pandera.pandas as pa

    def parsed(df):
        return df["reason"] == ""

    def is_text(df):
        return parsed(df) & df["present"] & df["is_str"]

    def well_formed(df):
        return is_text(df) & df["utf8_ok"]

    checks = [
        pa.Check(parsed, name="parse_error", ignore_na=False),
        pa.Check(lambda df: ~parsed(df) | df["present"], name="missing_key", ignore_na=False),
        pa.Check(lambda df: ~(parsed(df) & df["present"]) | df["is_str"], name="not_string", ignore_na=False),
        pa.Check(lambda df: ~is_text(df) | df["utf8_ok"], name="invalid_utf8", ignore_na=False),
    ]
    if min_length >= 1:
        checks.append(
            pa.Check(lambda df: ~well_formed(df) | (df["stripped_len"] > 0), name="empty", ignore_na=False)
        )
    if min_length >= 2:
        checks.append(
            pa.Check(
                lambda df: ~well_formed(df) | (df["stripped_len"] == 0) | (df["stripped_len"] >= min_length),
                name="too_short",
                ignore_na=False,
            )
        )
    schema = pa.DataFrameSchema(
        columns={
            "reason": pa.Column(object),
            "present": pa.Column(bool),
            "is_str": pa.Column(bool),
            "utf8_ok": pa.Column(bool),
            "stripped_len": pa.Column("int64", pa.Check.ge(-1)),
        },
        checks=checks,
        strict=True,
        name=f"text_records(min_length={min_length})",
    )
    _SCHEMAS[min_length] = schema
    return schema


def _utf8_ok(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (no lone surrogates); ASCII without trying."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        list: "a list",
        dict: "an object",
        bytes: "bytes",
    }.get(type(value), type(value).__name__)


class RecordValidator:
    """Validates :class:`RawRecord` streams and yields the valid texts in order."""

    def __init__(
        self,
        source: str,
        text_key: str,
        min_length: int,
        on_invalid: Literal["fail", "skip"],
        *,
        label: str | None = None,
        check: Callable[[Any], str | None] | None = None,
    ):
        self.source = source
        #: a further check of each record the schema passes: why it is invalid
        #: (``bad_conversation``), or None
        self.check = check
        self.text_key = text_key
        self.label = label if label is not None else repr(text_key)
        self.min_length = min_length
        self.on_invalid = on_invalid

    # messages -----------------------------------------------------------------------------
    def describe(self, rec: RawRecord, reason: str) -> tuple[str, str]:
        """(detail, hint) for an invalid record."""
        key, label = self.text_key, self.label
        skip = "fix the record or set data.on_invalid: skip to drop such records"
        if reason in _PARSE_REASONS and rec.reason == reason:
            return rec.detail or reason, skip
        if reason == "missing_key":
            keys = ", ".join(rec.keys) if rec.keys else "none"
            return f"key {key!r} missing (keys: {keys})", "set data.text_key or fix the record"
        if reason == "not_string":
            return f"{label} is {_type_name(rec.value)}, not a string", skip
        if reason == "invalid_utf8":
            bad = next((i for i, c in enumerate(rec.value) if 0xD800 <= ord(c) <= 0xDFFF), -1)
            return f"{label} is not valid UTF-8 text (lone surrogate at character {bad})", skip
        if reason == "empty":
            return f"{label} is empty or only whitespace", skip + " (or data.min_length: 0 to keep them)"
        if reason == "bad_conversation":
            return rec.detail, skip
        if reason == "too_short":
            n = len(rec.value.strip())
            return (
                f"{label} has {n} characters after stripping, fewer than data.min_length = {self.min_length}",
                skip,
            )
        return reason, skip

    def error(self, rec: RawRecord, reason: str) -> DataValidationError:
        detail, hint = self.describe(rec, reason)
        return DataValidationError(self.source, rec.location, reason, detail, hint)

    # validation ---------------------------------------------------------------------------
    def check_chunk(self, chunk: list[RawRecord]) -> dict[int, str]:
        """Validate one chunk against the pandera schema; {position in chunk: reason} of failures.

        A chunk whose every record is plainly a good text (parsed, present, a string, valid UTF-8,
        long enough: :meth:`_plainly_valid`, which passes every check of :func:`record_schema`)
        has no failures and skips the schema (and pandas' and pandera's import, ~0.5 s of a small
        corpus's run); any other chunk is classified by the schema."""
        if all(self._plainly_valid(rec) for rec in chunk):
            return {}
        return self._schema_failures(chunk)

    def _plainly_valid(self, rec: RawRecord) -> bool:
        v = rec.value
        if rec.reason or not rec.present or not isinstance(v, str) or not _utf8_ok(v):
            return False
        if self.min_length < 1:
            return True
        n = len(v.strip())
        return n > 0 and (self.min_length < 2 or n >= self.min_length)

    def _schema_failures(self, chunk: list[RawRecord]) -> dict[int, str]:
        import pandas as pd
        import pandera.pandas as pa

        n = len(chunk)
        reason = [""] * n
        present = [False] * n
        is_str = [False] * n
        utf8_ok = [False] * n
        stripped = [-1] * n
        for i, rec in enumerate(chunk):
            reason[i] = rec.reason
            present[i] = rec.present
            v = rec.value
            if isinstance(v, str):
                is_str[i] = True
                utf8_ok[i] = _utf8_ok(v)
                stripped[i] = len(v.strip())
        df = pd.DataFrame(
            {
                "reason": pd.Series(reason, dtype=object),
                "present": pd.Series(present, dtype=bool),
                "is_str": pd.Series(is_str, dtype=bool),
                "utf8_ok": pd.Series(utf8_ok, dtype=bool),
                "stripped_len": pd.Series(stripped, dtype="int64"),
            }
        )
        try:
            record_schema(self.min_length).validate(df, lazy=True)
        except pa.errors.SchemaErrors as e:
            fc = e.failure_cases
            fc = fc[(fc["schema_context"] == "DataFrameSchema") & fc["index"].notna()]
            failures: dict[int, str] = {}
            for check, idx in zip(fc["check"], fc["index"], strict=True):
                pos = int(idx)
                failures[pos] = chunk[pos].reason if check == "parse_error" else str(check)
            if not failures:  # a schema-level problem would be a bug in the reader, not bad data
                raise
            return failures
        return {}

    def iter_valid(self, records: Iterable[RawRecord], report: ShardReport) -> Iterator[str]:
        """Yield the texts of valid records in order; count (skip) or raise (fail) on the others."""
        chunk: list[RawRecord] = []
        chars = 0
        for rec in records:
            chunk.append(rec)
            if isinstance(rec.value, str):
                chars += len(rec.value)
            if len(chunk) >= CHUNK_RECORDS or chars >= CHUNK_CHARS:
                yield from self._flush(chunk, report)
                chunk, chars = [], 0
        if chunk:
            yield from self._flush(chunk, report)

    def _flush(self, chunk: list[RawRecord], report: ShardReport) -> Iterator[str]:
        failures = self.check_chunk(chunk)
        if self.check is not None:
            for i, rec in enumerate(chunk):
                if i in failures:
                    continue
                problem = self.check(rec.value)
                if problem is not None:
                    chunk[i] = rec._replace(detail=problem)
                    failures[i] = "bad_conversation"
        if failures and self.on_invalid == "fail":
            first = min(failures)
            report.records += first
            report.valid += first
            raise self.error(chunk[first], failures[first])
        report.records += len(chunk)
        for reason in failures.values():
            report.count_invalid(reason)
        report.valid += len(chunk) - len(failures)
        for i, rec in enumerate(chunk):
            if i not in failures:
                yield rec.value
