"""Byte streams of shard files: open a local path or fsspec URL, decompress, hash while reading.

Files are opened through :mod:`lm_pipeline.fs` (local paths and ``file://`` directly, other URLs
through fsspec). Compression is gzip or zstd. Hashes are sha256 of the raw (still compressed)
bytes, hex-encoded (:func:`lm_pipeline.fs.sha256_of` for a whole file).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
from typing import IO

from lm_pipeline.fs import open_binary

__all__ = [
    "CORRUPT_STREAM_ERRORS",
    "HashingReader",
    "decompress",
    "local_path",
    "open_raw",
]

BLOCK = 1 << 20  # bytes per read while hashing


def local_path(url: str) -> str:
    """The filesystem path of a local ``url`` (``file://`` stripped, ``~`` expanded), relative
    paths kept relative: shard names as the config spells them enter the fingerprints, so
    unlike :func:`lm_pipeline.fs.local_path` this does not make them absolute."""
    return os.path.expanduser(url[len("file://") :] if url.startswith("file://") else url)


def open_raw(url: str) -> IO[bytes]:
    """The raw (still compressed) bytes of ``url``, as a binary file object."""
    return open_binary(url)


class HashingReader(io.RawIOBase):
    """Pass-through reader that hashes every byte it hands out (sha256)."""

    def __init__(self, raw: IO[bytes]):
        self.raw = raw
        self.sha = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:
        data = self.raw.read(len(b))
        n = len(data)
        b[:n] = data
        self.sha.update(data)
        return n

    def drain(self) -> str:
        """Hash the bytes not read yet; return the hex digest of the whole stream."""
        while True:
            data = self.raw.read(BLOCK)
            if not data:
                return self.sha.hexdigest()
            self.sha.update(data)

    def close(self) -> None:
        self.raw.close()
        super().close()


def decompress(stream: IO[bytes], compression: str | None) -> IO[bytes]:
    """A buffered reader of ``stream``'s decompressed bytes (``compression``: gzip, zstd or None)."""
    if compression == "gzip":
        return gzip.GzipFile(fileobj=stream, mode="rb")
    if compression == "zstd":
        import zstandard

        return io.BufferedReader(
            zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=True, closefd=False)
        )
    return io.BufferedReader(stream) if isinstance(stream, io.RawIOBase) else stream


def _corrupt_stream_errors() -> tuple[type[BaseException], ...]:
    import zlib

    errors: list[type[BaseException]] = [EOFError, zlib.error, gzip.BadGzipFile]
    with contextlib.suppress(ImportError):
        import zstandard

        errors.append(zstandard.ZstdError)
    return tuple(errors)


#: What a truncated or corrupt compressed stream raises while being read.
CORRUPT_STREAM_ERRORS = _corrupt_stream_errors()

