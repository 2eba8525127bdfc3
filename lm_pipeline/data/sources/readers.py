"""File formats: a shard file's (decompressed) bytes -> :class:`RawRecord` tuples.

``data.format: auto`` picks the format by extension, after stripping ``.gz`` / ``.zst``:

* JSONL (``.jsonl``, ``.ndjson``): one JSON object per line; blank lines are ignored (and
  counted in the report). Each line is decoded and parsed on its own, so a bad line is one
  invalid record.
* JSON (``.json``): a top-level array of objects, an object holding such an array (under
  ``data.json_records_key``, or its only list-valued key), or a single object (one record).
  Items are parsed one by one so errors carry the item's index and line. A syntax error
  between items ends the file: it counts as one ``bad_json`` record.
* Plain text (``.txt``, ``.text``, ``.md``): ``data.text_unit`` picks one document per file
  (default), per paragraph (blank-line separated) or per non-blank line. Undecodable bytes
  make the document invalid (``invalid_utf8``), not the file.
* Parquet (``.parquet``, ``.pq``): the ``text_key`` column, read in record batches.

Readers only parse; validation (types, lengths, the ``fail`` / ``skip`` policy) is
:mod:`lm_pipeline.data.validation`'s job.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any, Literal

from lm_pipeline.data.validation import DataValidationError, RawRecord, ShardReport

__all__ = ["READER_VERSION", "ReaderSettings", "infer_format", "read_parquet", "read_records"]

#: Bumped when a reader change alters the texts produced from the same bytes.
READER_VERSION = 1

_FORMAT_EXT = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".jsonlines": "jsonl",
    ".json": "json",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".parquet": "parquet",
    ".pq": "parquet",
}
_COMPRESSION_EXT = {".gz": "gzip", ".gzip": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class ReaderSettings:
    """How a shard's bytes become records; all of it enters the shard fingerprint."""

    format: Literal["jsonl", "json", "text", "parquet", "hf"]
    compression: Literal["gzip", "zstd"] | None
    text_key: str
    min_length: int
    on_invalid: Literal["fail", "skip"]
    text_unit: Literal["file", "paragraph", "line"] = "file"
    json_records_key: str | None = None
    chat: bool = False  # records hold conversations under text_key (the messages field); see data/chat.py


def infer_format(url: str, fmt: str = "auto") -> tuple[str | None, str | None]:
    """(format, compression) of a file from its name; format None when 'auto' cannot tell."""
    base = url.rsplit("/", 1)[-1].lower()
    root, ext = os.path.splitext(base)
    compression = _COMPRESSION_EXT.get(ext)
    if compression is not None:
        base = root
    if fmt != "auto":
        return fmt, compression
    return _FORMAT_EXT.get(os.path.splitext(base)[1]), compression


def _utf8_detail(data: bytes, err: UnicodeDecodeError, line_base: int = 1) -> tuple[int, str]:
    line = line_base + data.count(b"\n", 0, err.start)
    col = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
    return line, f"invalid UTF-8 (byte 0x{data[err.start]:02x} at line {line}, column {col})"


def _read_jsonl(stream, s: ReaderSettings, report: ShardReport) -> Iterator[RawRecord]:
    key = s.text_key
    for lineno, line in enumerate(stream, 1):
        if lineno == 1 and line.startswith(_BOM):
            line = line[3:]
        if not line.strip():
            report.blank_lines += 1
            continue
        loc = f"line {lineno}"
        line = line.rstrip(b"\r\n")
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            yield RawRecord(
                loc,
                "invalid_utf8",
                f"invalid UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1})",
                False,
            )
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            yield RawRecord(loc, "bad_json", f"invalid JSON: {e.msg} (column {e.colno})", False)
            continue
        if not isinstance(obj, dict):
            yield RawRecord(loc, "not_object", f"expected a JSON object, got {_json_type(obj)}", False)
            continue
        if key in obj:
            yield RawRecord(loc, "", "", True, obj[key])
        else:
            yield RawRecord(loc, "", "", False, None, tuple(map(str, obj)))


def _json_type(obj: Any) -> str:
    return {
        list: "an array",
        str: "a string",
        int: "a number",
        float: "a number",
        bool: "a boolean",
        dict: "an object",
    }.get(type(obj), "null")


_WS = re.compile(r"[ \t\n\r]*")


class _Lines:
    """Character offset -> 1-based line number, for increasing offsets."""

    def __init__(self, text: str):
        self.text, self.pos, self.line = text, 0, 1

    def __call__(self, pos: int) -> int:
        if pos < self.pos:
            self.pos, self.line = 0, 1
        self.line += self.text.count("\n", self.pos, pos)
        self.pos = pos
        return self.line


def _read_json(stream, s: ReaderSettings, report: ShardReport) -> Iterator[RawRecord]:
    # surrogateescape keeps undecodable bytes inside strings as lone surrogates: the record holding
    # them is reported as invalid UTF-8 by the validator, the rest of the file still parses.
    text = stream.read().decode("utf-8", "surrogateescape").lstrip("\ufeff")
    dec = json.JSONDecoder()
    lines = _Lines(text)
    i = _WS.match(text, 0).end()
    if i == len(text):
        return
    if text[i] == "[":
        yield from _json_array(text, i, dec, lines, s.text_key, "item")
        return
    if text[i] != "{":
        yield _json_error(text, i, lines, "expected a JSON array or object at the top level")
        return
    # Walk the top-level object's members, remembering where each value starts.
    members: dict[str, tuple[int, Any]] = {}
    j = i + 1
    try:
        while True:
            j = _WS.match(text, j).end()
            if text.startswith("}", j):
                break
            k, j = dec.raw_decode(text, j)
            j = _WS.match(text, j).end()
            if not text.startswith(":", j):
                raise json.JSONDecodeError("Expecting ':' delimiter", text, j)
            j = _WS.match(text, j + 1).end()
            start = j
            v, j = dec.raw_decode(text, j)
            members[k] = (start, v)
            j = _WS.match(text, j).end()
            if text.startswith(",", j):
                j += 1
            elif not text.startswith("}", j):
                raise json.JSONDecodeError("Expecting ',' delimiter", text, j)
    except json.JSONDecodeError as e:
        yield _json_error(text, e.pos, lines, e.msg)
        return
    rk = s.json_records_key
    if rk is None:
        lists = [k for k, (_, v) in members.items() if isinstance(v, list)]
        if s.text_key in members or not lists:  # the object itself is the one record
            yield RawRecord(
                f"line {lines(i)}",
                "",
                "",
                s.text_key in members,
                members.get(s.text_key, (0, None))[1],
                tuple(map(str, members)),
            )
            return
        if len(lists) == 1:
            rk = lists[0]
        else:
            raise DataValidationError(
                "",
                "",
                "ambiguous_json",
                f"the JSON object has several lists ({', '.join(lists)})",
                "set data.json_records_key to the one holding the records",
            )
    if rk not in members or not isinstance(members[rk][1], list):
        raise DataValidationError(
            "",
            "",
            "no_records",
            f"no list of records under key {rk!r} (keys: {', '.join(map(str, members))})",
            "fix data.json_records_key",
        )
    yield from _json_array(text, members[rk][0], dec, lines, s.text_key, f"{rk}[")


def _json_error(text: str, pos: int, lines: _Lines, msg: str) -> RawRecord:
    line = lines(pos)
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return RawRecord(
        f"line {line}",
        "bad_json",
        f"invalid JSON: {msg} (column {col}); the rest of the file is not read",
        False,
    )


def _json_array(
    text: str, start: int, dec: json.JSONDecoder, lines: _Lines, key: str, label: str
) -> Iterator[RawRecord]:
    n = 0
    j = _WS.match(text, start + 1).end()
    if text.startswith("]", j):
        return
    while True:
        try:
            obj, end = dec.raw_decode(text, j)
        except json.JSONDecodeError as e:
            yield _json_error(text, e.pos, lines, e.msg)
            return
        loc = f"item {n} (line {lines(j)})" if label == "item" else f"{label}{n}] (line {lines(j)})"
        if not isinstance(obj, dict):
            yield RawRecord(loc, "not_object", f"expected a JSON object, got {_json_type(obj)}", False)
        elif key in obj:
            yield RawRecord(loc, "", "", True, obj[key])
        else:
            yield RawRecord(loc, "", "", False, None, tuple(map(str, obj)))
        n += 1
        j = _WS.match(text, end).end()
        if text.startswith(",", j):
            j = _WS.match(text, j + 1).end()
        elif text.startswith("]", j):
            return
        else:
            yield _json_error(text, j, lines, "Expecting ',' delimiter")
            return


def _read_text(stream, s: ReaderSettings, report: ShardReport) -> Iterator[RawRecord]:
    if s.text_unit == "file":
        data = stream.read()
        if data.startswith(_BOM):
            data = data[3:]
        try:
            yield RawRecord("", "", "", True, data.decode("utf-8"))
        except UnicodeDecodeError as e:
            line, detail = _utf8_detail(data, e)
            yield RawRecord(f"line {line}", "invalid_utf8", detail, False)
        return

    def decoded(chunk: bytes, first_line: int) -> RawRecord:
        try:
            return RawRecord(f"line {first_line}", "", "", True, chunk.decode("utf-8").rstrip("\r\n"))
        except UnicodeDecodeError as e:
            line, detail = _utf8_detail(chunk, e, first_line)
            return RawRecord(f"line {first_line}", "invalid_utf8", detail, False)

    para: list[bytes] = []
    first = 0
    for lineno, line in enumerate(stream, 1):
        if lineno == 1 and line.startswith(_BOM):
            line = line[3:]
        blank = not line.strip()
        if s.text_unit == "line":
            if blank:
                report.blank_lines += 1
            else:
                yield decoded(line, lineno)
            continue
        if blank:
            if para:
                yield decoded(b"".join(para), first)
                para = []
        else:
            if not para:
                first = lineno
            para.append(line)
    if para:
        yield decoded(b"".join(para), first)


def read_parquet(f: IO[bytes], s: ReaderSettings, report: ShardReport) -> Iterator[RawRecord]:
    """Records of a Parquet file: its ``text_key`` column, one record per row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f)
    names = tuple(pf.schema_arrow.names)
    if s.text_key not in names:
        for row in range(pf.metadata.num_rows):
            yield RawRecord(f"row {row}", "", "", False, None, names)
        return
    row = 0
    for batch in pf.iter_batches(columns=[s.text_key], batch_size=4096):
        col = batch.column(0)
        binary = pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type)
        for v in col.to_pylist():
            loc = f"row {row}"
            row += 1
            if binary and v is not None:
                try:
                    v = v.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield RawRecord(
                        loc,
                        "invalid_utf8",
                        f"invalid UTF-8 (byte 0x{v[e.start]:02x} at offset {e.start})",
                        False,
                    )
                    continue
            yield RawRecord(loc, "", "", True, v)


_READERS = {"jsonl": _read_jsonl, "json": _read_json, "text": _read_text}


def read_records(stream: IO[bytes], s: ReaderSettings, report: ShardReport) -> Iterator[RawRecord]:
    """Records of a decompressed JSONL, JSON or text stream (Parquet: :func:`read_parquet`).

    File-level problems raise :class:`DataValidationError` without a source (the caller knows it).
    """
    return _READERS[s.format](stream, s, report)
