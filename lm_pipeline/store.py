"""Content-addressed artifact store on fsspec.

Every artifact lives at ``<root>/<stage>/<fingerprint>/``. It is complete when its
``manifest.json`` exists; the manifest is written last and atomically, so partial output never
looks done. A present manifest is a cache hit and means no work. Writers of the same address
take an exclusive lock (``fcntl.flock`` on local roots, released by the kernel if the process
dies), so two concurrent writers never corrupt an artifact: the second waits, then sees the
manifest and does nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import fsspec

from lm_pipeline.atomic import atomic_write_text

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _local(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


@dataclass(frozen=True)
class Artifact:
    stage: str
    fingerprint: str
    path: str  # the artifact's directory (local path or URL)

    @property
    def manifest_path(self) -> str:
        return f"{self.path}/{MANIFEST}"


class ArtifactStore:
    """``<root>/<stage>/<fingerprint>/`` directories with manifests, on any fsspec root."""

    def __init__(self, root: str):
        self.root = root.rstrip("/")
        self.fs, _ = fsspec.core.url_to_fs(self.root)

    def artifact(self, stage: str, fp: str) -> Artifact:
        for part in (stage, fp):
            if not part or "/" in part or part in (".", ".."):
                raise ValueError(f"invalid artifact address component {part!r}")
        return Artifact(stage, fp, f"{self.root}/{stage}/{fp}")

    def manifest(self, stage: str, fp: str) -> dict[str, Any] | None:
        """The manifest of a complete artifact, or None."""
        art = self.artifact(stage, fp)
        try:
            with self.fs.open(art.manifest_path, "r") as f:
                return json.load(f)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def is_complete(self, stage: str, fp: str) -> bool:
        return self.manifest(stage, fp) is not None

    def complete(self, stage: str) -> list[dict[str, Any]]:
        """Manifests of all complete artifacts of a stage, oldest first."""
        base = f"{self.root}/{stage}"
        try:
            entries = self.fs.ls(base, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for entry in entries:
            fp = entry.rstrip("/").rsplit("/", 1)[-1]
            if fp.startswith("."):  # locks and fan-out scratch space
                continue
            m = self.manifest(stage, fp)
            if m is not None:
                out.append(m)
        return sorted(out, key=lambda m: m.get("created", ""))

    def commit(self, art: Artifact, info: dict[str, Any]) -> dict[str, Any]:
        """Write the manifest (last, atomically): the artifact is now complete."""
        manifest = {
            "stage": art.stage,
            "fingerprint": art.fingerprint,
            "created": datetime.now(UTC).isoformat(),
            **info,
        }
        atomic_write_text(art.manifest_path, json.dumps(manifest, indent=2, sort_keys=True, default=str))
        return manifest

    @contextlib.contextmanager
    def lock(self, art: Artifact, timeout: float | None = None) -> Iterator[None]:
        """Exclusive lock for building ``art`` (local roots; a no-op elsewhere)."""
        if not _is_local(art.path):
            yield
            return
        d = _local(f"{self.root}/{art.stage}")
        os.makedirs(d, exist_ok=True)
        fd = os.open(os.path.join(d, f".{art.fingerprint}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        t0 = time.monotonic()
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if timeout is not None and time.monotonic() - t0 > timeout:
                        raise TimeoutError(f"another process is building {art.path}") from None
                    time.sleep(0.1)
            yield
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
