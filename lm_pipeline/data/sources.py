"""Data sources: configured urls / Hugging Face datasets / built-in corpora -> picklable shards.

URLs
    Each entry of ``train_urls``, ``validation_urls`` and ``validation: {name: urls}`` is brace
    expanded (``data-{001..032}.jsonl.gz``, ``{train,extra}.jsonl``), then globbed if it holds
    ``*``, ``?`` or ``[`` (matches sorted; ``**`` recurses), then read through fsspec: local paths,
    ``file://``, ``memory://``, and ``gs://`` / ``s3://`` / ... where their fsspec packages
    (gcsfs, s3fs) are installed. A directory stands for the supported files under it (sorted,
    recursive; hidden and ``_``-prefixed names skipped), except that a directory written by
    ``datasets.Dataset.save_to_disk`` is read as a Hugging Face dataset. A pattern matching
    nothing, a missing file and the same file listed twice are errors.

Formats (``data.format: auto`` picks by extension, after stripping ``.gz`` / ``.zst``)
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

Shards
    :class:`Shard` is picklable and is what the token-cache builder consumes: ``.name`` (stable,
    human-readable), ``.url``, ``.fingerprint`` and ``.iter_texts()`` (valid texts, in order, under
    the validation policy; see :mod:`lm_pipeline.data.validation`). Per-shard counts land in a
    :class:`~lm_pipeline.data.validation.ShardReport`: pass one to ``iter_texts(report)``, read
    ``shard.last_report`` afterwards, or call ``shard.scan()``.

Fingerprints
    File shards: sha256 of the shard's raw (still compressed) bytes plus the reader settings
    that affect the texts (format, compression, text_key, min_length, on_invalid, text_unit,
    json_records_key). Computed lazily on first access, or while ``iter_texts`` streams the file;
    if both happen, a mismatch raises :class:`ShardChangedError`. Hugging Face datasets: a
    ``save_to_disk`` directory hashes its Arrow files; a hub / builder dataset uses the dataset's
    own ``_fingerprint`` (non-streamed) or the resolved hub commit (streamed; pin
    ``hf_revision`` to a commit sha to avoid a hub query), plus the row range or shard index.
"""

from __future__ import annotations

import contextlib
import glob as _glob
import gzip
import hashlib
import io
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from lm_pipeline.data.config import DEFAULT_VALIDATION_SET, DataConfig
from lm_pipeline.data.validation import (
    DataValidationError,
    RawRecord,
    RecordValidator,
    ShardChangedError,
    ShardReport,
)
from lm_pipeline.schema import ConfigError

__all__ = [
    "DataValidationError",
    "HFSpec",
    "ReaderSettings",
    "Shard",
    "ShardChangedError",
    "ShardReport",
    "expand_urls",
    "infer_format",
    "iter_shard_texts",
    "resolve_shards",
    "scan_shards",
    "split_names",
    "validation_sets",
]

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
_BLOCK = 1 << 20
_BOM = b"\xef\xbb\xbf"


# --- settings -------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class HFSpec:
    """Which Hugging Face dataset rows a shard covers."""

    path: str
    loader: Literal["hub", "disk"]
    name: str | None = None
    split: str | None = None
    revision: str | None = None
    data_files: tuple[str, ...] = ()
    streaming: bool = False
    start: int = 0
    stop: int = 0
    index: int = 0
    num_shards: int = 1

    def dataset_key(self) -> tuple:
        return (self.path, self.loader, self.name, self.split, self.revision, self.data_files, self.streaming)


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


def _settings(cfg: DataConfig, fmt: str, compression: str | None) -> ReaderSettings:
    return ReaderSettings(
        format=fmt,  # type: ignore[arg-type]
        compression=compression,  # type: ignore[arg-type]
        text_key=cfg.text_key,
        min_length=cfg.min_length,
        on_invalid=cfg.on_invalid,
        text_unit=cfg.text_unit,
        json_records_key=cfg.json_records_key,
    )


# --- byte streams ---------------------------------------------------------------------------


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _local(url: str) -> str:
    return os.path.expanduser(url[len("file://") :] if url.startswith("file://") else url)


def _open_raw(url: str):
    if _is_local(url):
        return open(_local(url), "rb")
    import fsspec

    return fsspec.open(url, "rb").open()


class _HashingReader(io.RawIOBase):
    """Pass-through reader that hashes every byte it hands out."""

    def __init__(self, raw):
        self.raw = raw
        self.sha = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.raw.read(len(b))
        n = len(data)
        b[:n] = data
        self.sha.update(data)
        return n

    def drain(self) -> str:
        while True:
            data = self.raw.read(_BLOCK)
            if not data:
                return self.sha.hexdigest()
            self.sha.update(data)

    def close(self) -> None:
        self.raw.close()
        super().close()


def _decompress(stream, compression: str | None):
    if compression == "gzip":
        return gzip.GzipFile(fileobj=stream, mode="rb")
    if compression == "zstd":
        import zstandard

        return io.BufferedReader(
            zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=True, closefd=False)
        )
    return io.BufferedReader(stream) if isinstance(stream, io.RawIOBase) else stream


def _corrupt_stream_errors() -> tuple[type[BaseException], ...]:
    """What a truncated or corrupt compressed stream raises while being read."""
    import zlib

    errors: list[type[BaseException]] = [EOFError, zlib.error, gzip.BadGzipFile]
    with contextlib.suppress(ImportError):
        import zstandard

        errors.append(zstandard.ZstdError)
    return tuple(errors)


_CORRUPT_STREAM = _corrupt_stream_errors()


def _sha256_of(url: str) -> str:
    sha = hashlib.sha256()
    with _open_raw(url) as f:
        while True:
            data = f.read(_BLOCK)
            if not data:
                return sha.hexdigest()
            sha.update(data)


# --- readers: bytes -> RawRecord ------------------------------------------------------------


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


def _read_parquet(f, s: ReaderSettings, report: ShardReport) -> Iterator[RawRecord]:
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


# --- Hugging Face datasets ------------------------------------------------------------------

_HF_CACHE: dict[tuple, Any] = {}


def _datasets():
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "Hugging Face dataset sources need the `datasets` package: pip install 'lm-pipeline[hf]'"
        ) from e
    return datasets


def _is_disk_dataset(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(
        os.path.join(path, "dataset_dict.json")
    )


def _load_hf(spec: HFSpec):
    key = spec.dataset_key()
    ds = _HF_CACHE.get(key)
    if ds is not None:
        return ds
    datasets = _datasets()
    if spec.loader == "disk":
        ds = datasets.load_from_disk(spec.path)
        if isinstance(ds, datasets.DatasetDict):
            if spec.split not in ds:
                raise ConfigError(
                    "data.hf_split", f"{spec.path} has splits {', '.join(ds)}; no split {spec.split!r}"
                )
            ds = ds[spec.split]
    else:
        ds = datasets.load_dataset(
            spec.path,
            spec.name,
            split=spec.split,
            revision=spec.revision,
            data_files=list(spec.data_files) or None,
            streaming=spec.streaming,
        )
    _HF_CACHE[key] = ds
    return ds


def _disk_fingerprint(path: str) -> str:
    """sha256 over the Arrow files of a ``save_to_disk`` dataset (its stored fingerprint is random)."""
    sha = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        if name.endswith(".arrow"):
            sha.update(name.encode() + b"\0" + _sha256_of(os.path.join(path, name)).encode())
    return sha.hexdigest()


def _hub_commit(spec: HFSpec) -> str:
    if spec.revision and re.fullmatch(r"[0-9a-f]{40}", spec.revision):
        return spec.revision
    if spec.data_files:  # a builder ('json', 'parquet', ...) over files: hash local ones
        out = []
        for f in spec.data_files:
            out.append(_sha256_of(f) if _is_local(f) and os.path.isfile(_local(f)) else f)
        return hashlib.sha256("\n".join(out).encode()).hexdigest()
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(spec.path, revision=spec.revision).sha
    except Exception as e:  # offline, private, ...
        raise ConfigError(
            "data.hf_revision",
            f"cannot resolve the hub commit of {spec.path!r} ({type(e).__name__}: {e}); pin hf_revision to a commit sha",
        ) from e


def _iter_hf(spec: HFSpec, s: ReaderSettings) -> Iterator[RawRecord]:
    ds = _load_hf(spec)
    key = s.text_key
    if spec.streaming:
        shard = ds.shard(num_shards=spec.num_shards, index=spec.index) if spec.num_shards > 1 else ds
        for row, rec in enumerate(shard):
            if key in rec:
                yield RawRecord(f"row {row}", "", "", True, rec[key])
            else:
                yield RawRecord(f"row {row}", "", "", False, None, tuple(rec))
        return
    names = tuple(ds.column_names)
    if key not in names:
        for row in range(spec.start, spec.stop):
            yield RawRecord(f"row {row}", "", "", False, None, names)
        return
    col = ds.select_columns([key])
    for lo in range(spec.start, spec.stop, 1024):
        values = col[lo : min(lo + 1024, spec.stop)][key]
        for k, v in enumerate(values):
            yield RawRecord(f"row {lo + k}", "", "", True, v)


# --- Shard ----------------------------------------------------------------------------------


class Shard:
    """One unit of input data. Picklable; ``iter_texts`` may run in a worker process.

    Attributes:
        name: stable, human-readable name, unique within its split.
        url: where the bytes are: a path / fsspec URL, or the dataset id / directory (Hugging Face).
        settings: the :class:`ReaderSettings`.
        hf: for Hugging Face datasets, the :class:`HFSpec`; None for files.
        last_report: the :class:`ShardReport` of the latest ``iter_texts`` in this process.
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
    def _make_fingerprint(self, content: str) -> str:
        doc = {"reader_version": READER_VERSION, "settings": asdict(self.settings), "content": content}
        if self.hf is not None:
            # a save_to_disk dataset is identified by its content, not by where it lies
            skip = ("loader", "path") if self.hf.loader == "disk" else ("loader",)
            doc["hf"] = {k: v for k, v in asdict(self.hf).items() if k not in skip}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    @property
    def fingerprint(self) -> str:
        """sha256 of the raw bytes plus reader settings (computed once, then cached)."""
        if self._fingerprint is None:
            if self.hf is not None:  # pragma: no cover - HF shards get theirs at resolve time
                raise RuntimeError(f"{self.name}: Hugging Face shard without a fingerprint")
            if self._raw_sha256 is None:
                self._raw_sha256 = _sha256_of(self.url)
            self._fingerprint = self._make_fingerprint(self._raw_sha256)
        return self._fingerprint

    # reading ------------------------------------------------------------------------------
    def iter_records(self, report: ShardReport | None = None) -> Iterator[RawRecord]:
        """All records as read, before validation (parse problems attached)."""
        report = report if report is not None else ShardReport(self.name)
        s = self.settings
        if self.hf is not None:
            yield from _iter_hf(self.hf, s)
            return
        if s.format == "parquet":
            with _open_raw(self.url) as f:
                if s.compression is None:
                    yield from _read_parquet(f, s, report)
                else:
                    with _decompress(f, s.compression) as d:
                        yield from _read_parquet(io.BytesIO(d.read()), s, report)
            return
        reader = _READERS[s.format]
        with _open_raw(self.url) as raw:
            hashing = _HashingReader(raw)
            with _decompress(hashing, s.compression) as stream:
                try:
                    yield from reader(stream, s, report)
                except DataValidationError as e:  # file-level problems raised without a source
                    raise DataValidationError(self.url, e.location, e.reason, e.detail, e.hint) from None
                except _CORRUPT_STREAM as e:  # under either policy: the rest of the file is unreadable
                    raise DataValidationError(
                        self.url, "", "corrupt_file",
                        f"the {s.compression or s.format} stream is truncated or corrupt ({type(e).__name__}: {e})",
                        "re-download or re-compress the file, or remove it from the data urls",
                    ) from None
                digest = hashing.drain()
        expected = self._raw_sha256
        if expected is not None and digest != expected:
            raise ShardChangedError(
                f"{self.url}: the file changed since it was fingerprinted; rebuild from the new data"
            )
        if self._raw_sha256 is None and self._fingerprint is None:
            self._raw_sha256 = digest
            self._fingerprint = self._make_fingerprint(digest)

    def iter_texts(self, report: ShardReport | None = None) -> Iterator[str]:
        """The valid texts, in order. Invalid records raise (``fail``) or are counted (``skip``)
        in ``report`` (a fresh :class:`ShardReport` if None; also kept as ``self.last_report``)."""
        report = report if report is not None else ShardReport(self.name)
        report.complete = False
        self.last_report = report
        s = self.settings
        source = self.url if self.hf is None else self.name
        label = "the text" if s.format == "text" else None
        validator = RecordValidator(source, s.text_key, s.min_length, s.on_invalid, label=label)
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


# --- resolution -----------------------------------------------------------------------------

_MAGIC = re.compile(r"[*?\[]")


def _expand_one(pattern: str, where: str) -> list[tuple[str, bool]]:
    """Files for one brace-expanded pattern: [(url, is_dataset_dir)]."""
    if _is_local(pattern):
        prefix = "file://" if pattern.startswith("file://") else ""
        path = _local(pattern)
        if _MAGIC.search(path):
            hits = sorted(_glob.glob(path, recursive=True))
            if not hits:
                raise ConfigError(where, f"{pattern!r} matches no files")
        elif os.path.exists(path):
            hits = [path]
        else:
            raise ConfigError(where, f"{pattern!r}: no such file or directory")
        out: list[tuple[str, bool]] = []
        for h in hits:
            if os.path.isdir(h):
                if _is_disk_dataset(h):
                    out.append((prefix + h, True))
                    continue
                files = sorted(
                    os.path.join(dp, f)
                    for dp, dns, fns in os.walk(h)
                    for f in fns
                    if not f.startswith((".", "_"))
                    and infer_format(f)[0] is not None
                    and not any(
                        part.startswith((".", "_"))
                        for part in os.path.relpath(dp, h).split(os.sep)
                        if part != "."
                    )
                )
                if not files:
                    raise ConfigError(where, f"{h!r}: directory holds no .jsonl/.json/.txt/.parquet files")
                out.extend((prefix + f, False) for f in files)
            else:
                out.append((prefix + h, False))
        return out
    import fsspec

    fs, path = fsspec.core.url_to_fs(pattern)
    if _MAGIC.search(path):
        hits = sorted(fs.glob(path))
        if not hits:
            raise ConfigError(where, f"{pattern!r} matches no files")
        urls = [fs.unstrip_protocol(h) for h in hits]
    elif fs.exists(path):
        hits, urls = [path], [pattern]
    else:
        raise ConfigError(where, f"{pattern!r}: no such file or directory")
    out = []
    for h, u in zip(hits, urls, strict=True):
        if fs.isdir(h):
            files = sorted(
                f
                for f in fs.find(h)
                if not f.rsplit("/", 1)[-1].startswith((".", "_")) and infer_format(f)[0] is not None
            )
            if not files:
                raise ConfigError(where, f"{u!r}: directory holds no .jsonl/.json/.txt/.parquet files")
            out.extend((fs.unstrip_protocol(f), False) for f in files)
        else:
            out.append((u, False))
    return out


def expand_urls(urls: Iterable[str], where: str = "data.train_urls") -> list[tuple[str, bool]]:
    """Brace-expand, glob and list directories: [(url, is_dataset_dir)] in order, no duplicates."""
    from braceexpand import braceexpand

    out: list[tuple[str, bool]] = []
    seen: set[str] = set()
    for u in urls:
        for pattern in braceexpand(u):
            for url, is_ds in _expand_one(pattern, where):
                key = os.path.abspath(_local(url)) if _is_local(url) else url
                if key in seen:
                    raise ConfigError(where, f"{url!r} is listed twice")
                seen.add(key)
                out.append((url, is_ds))
    return out


def _file_shards(cfg: DataConfig, urls: Iterable[str], where: str) -> list[Shard]:
    shards = []
    for url, is_ds in expand_urls(urls, where):
        if is_ds:
            if os.path.isfile(os.path.join(_local(url), "dataset_dict.json")):
                splits = sorted(
                    d for d in os.listdir(_local(url)) if os.path.isdir(os.path.join(_local(url), d))
                )
                raise ConfigError(
                    where,
                    f"{url!r} holds several splits ({', '.join(splits)}); list one split's directory, e.g. {url}/{splits[0] if splits else 'train'}",
                )
            shards.extend(_hf_shards(cfg, HFSpec(path=_local(url), loader="disk"), prefix=url, url=url))
            continue
        fmt, comp = infer_format(url, cfg.format)
        if fmt is None:
            raise ConfigError(
                where,
                f"{url!r}: cannot tell the format from the extension; use .jsonl/.json/.txt/.parquet (optionally .gz/.zst) or set data.format",
            )
        shards.append(Shard(url, url, _settings(cfg, fmt, comp)))
    return shards


def _hf_shards(cfg: DataConfig, spec: HFSpec, prefix: str, url: str) -> list[Shard]:
    """Shards of a Hugging Face dataset: row ranges of ``hf_shard_rows``, or the streamed dataset's
    own shards. Names are ``{prefix}[start:stop]`` / ``{prefix}#i-of-n``."""
    settings = _settings(cfg, "hf", None)
    ds = _load_hf(spec)
    if spec.streaming:
        n = max(1, int(getattr(ds, "num_shards", 1) or 1))
        base = _hub_commit(spec)
        out = []
        for i in range(n):
            sp = replace(spec, index=i, num_shards=n)
            sh = Shard(f"{prefix}#{i:05d}-of-{n:05d}", url, settings, sp)
            sh._fingerprint = sh._make_fingerprint(base)
            out.append(sh)
        return out
    total = len(ds)
    base = _disk_fingerprint(spec.path) if spec.loader == "disk" else ds._fingerprint
    step = cfg.hf_shard_rows
    out = []
    for lo in range(0, max(total, 1), step):
        hi = min(lo + step, total)
        sp = replace(spec, start=lo, stop=hi)
        sh = Shard(f"{prefix}[{lo}:{hi}]", url, settings, sp)
        sh._fingerprint = sh._make_fingerprint(base)
        out.append(sh)
    return out


def _hf_config_shards(cfg: DataConfig, split: str) -> list[Shard]:
    assert cfg.hf_id is not None
    path = _local(cfg.hf_id)
    if os.path.isdir(path) and _is_disk_dataset(path):
        is_dict = os.path.isfile(os.path.join(path, "dataset_dict.json"))
        if not is_dict and split != cfg.hf_split:
            raise ConfigError(
                "data.hf_validation_split",
                f"{cfg.hf_id} holds a single dataset, not splits; list a validation dataset under validation_urls",
            )
        spec = HFSpec(path=path, loader="disk", split=split if is_dict else None)
    else:
        spec = HFSpec(
            path=cfg.hf_id,
            loader="hub",
            name=cfg.hf_name,
            split=split,
            revision=cfg.hf_revision,
            data_files=tuple(cfg.hf_data_files),
            streaming=cfg.hf_streaming,
        )
    label = cfg.hf_id + (f":{cfg.hf_name}" if cfg.hf_name else "")
    return _hf_shards(cfg, spec, prefix=f"hf:{label}/{split}", url=cfg.hf_id)


def _builtin_shards(cfg: DataConfig, split: str, builtin_root: str | os.PathLike | None) -> list[Shard]:
    from lm_pipeline.data.builtin import materialize_builtin

    assert cfg.builtin is not None
    corpus = materialize_builtin(
        cfg.builtin,
        builtin_root,
        max_bytes=cfg.builtin_max_bytes,
        validation_fraction=cfg.builtin_validation_fraction,
    )
    settings = ReaderSettings("jsonl", None, "text", cfg.min_length, cfg.on_invalid)
    files = corpus.train if split == "train" else corpus.validation
    return [Shard(f"{cfg.builtin}/{os.path.basename(f)}", f, settings) for f in files]


def split_names(cfg: DataConfig) -> list[str]:
    """'train' (if configured) and the validation set names, in config order."""
    names = ["train"] if cfg.train_sources() else []
    if cfg.validation_urls or cfg.hf_validation_split is not None or cfg.builtin is not None:
        names.append(DEFAULT_VALIDATION_SET)
    names.extend(n for n in cfg.validation if n not in names)
    return names


def resolve_shards(
    cfg: DataConfig, split: str, *, builtin_root: str | os.PathLike | None = None
) -> list[Shard]:
    """The shards of ``split``: 'train' or a validation set name ('validation' or a named set).

    ``builtin_root``: where built-in corpora are materialised (default: ``$LM_PIPELINE_BUILTIN_DIR``
    or ``~/.cache/lm_pipeline/builtin``).
    """
    if split == "train":
        if cfg.train_urls:
            return _file_shards(cfg, cfg.train_urls, "data.train_urls")
        if cfg.hf_id is not None:
            return _hf_config_shards(cfg, cfg.hf_split)
        if cfg.builtin is not None:
            return _builtin_shards(cfg, "train", builtin_root)
        raise ConfigError(
            "data.train_urls",
            "no training data: set train_urls, hf_id or builtin (e.g. builtin: python_stdlib)",
        )
    if split == DEFAULT_VALIDATION_SET:
        if cfg.validation_urls:
            return _file_shards(cfg, cfg.validation_urls, "data.validation_urls")
        if cfg.hf_validation_split is not None:
            return _hf_config_shards(cfg, cfg.hf_validation_split)
        if cfg.builtin is not None:
            return _builtin_shards(cfg, "validation", builtin_root)
    if split in cfg.validation:
        return _file_shards(cfg, cfg.validation[split], f"data.validation.{split}")
    known = [n for n in split_names(cfg) if n != "train"]
    raise ConfigError(
        "data.validation", f"no validation set named {split!r}; configured: {', '.join(known) or 'none'}"
    )


def validation_sets(
    cfg: DataConfig, *, builtin_root: str | os.PathLike | None = None
) -> dict[str, list[Shard]]:
    """Every validation set: {'validation': ..., <named sets>...}, in config order."""
    return {
        name: resolve_shards(cfg, name, builtin_root=builtin_root)
        for name in split_names(cfg)
        if name != "train"
    }
