"""Content-addressed artifact store on fsspec.

Every artifact lives at ``<root>/<stage>/<fingerprint>/``. It is complete when its
``manifest.json`` exists; the manifest is written last and atomically, so partial output never
looks done. A present manifest is a cache hit and means no work. On local roots writers of the
same address take an exclusive lock (``fcntl.flock``, released by the kernel if the process
dies), so two concurrent writers never corrupt an artifact: the second waits, then sees the
manifest and does nothing. Object stores (``s3://``, ``gs://``, ...) have no locks: there the
manifest-last rule alone keeps a partial artifact from ever looking complete, and a second
concurrent writer of one address repeats the work (one builder per address is the rule).

A stage may live elsewhere (``stage_roots``: ``data.cache_dir`` puts token caches at
``<cache_dir>/<fingerprint>/``). The store then keeps a pointer at its usual address,
``<root>/<stage>/<fingerprint>/location.json``, written after the artifact's own manifest, so a
reader that knows only ``root`` (lineage, another experiment) still finds the artifact.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from lm_pipeline import fs
from lm_pipeline.atomic import atomic_write_text, remove_stale_temps, remove_stale_temps_under
from lm_pipeline.faultpoints import faultpoint

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LOCATION = "location.json"


class StorageError(RuntimeError):
    """The store could not be written (full disk, read-only filesystem, quota, permissions)."""


_STORAGE_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EROFS: "read-only file system",
                   errno.EDQUOT: "disk quota exceeded", errno.EACCES: "permission denied"}
_STORAGE_TEXTS = ("no space left on device", "read-only file system", "disk quota exceeded")


def storage_problem(exc: BaseException) -> tuple[str, str | None] | None:
    """(what went wrong, the file if known) when ``exc`` or its causes is a storage failure.

    TensorStore and Orbax report them as ``ValueError``/``RuntimeError`` whose text carries the
    OS message, and the checkpointer re-raises them from its writer thread; the whole chain is
    searched."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS:
            return _STORAGE_ERRNOS[e.errno], e.filename
        text = str(e).lower()
        for needle in _STORAGE_TEXTS:
            if needle in text:
                return needle, None
        stack.extend([e.__cause__, e.__context__])
    return None


def storage_error(exc: BaseException, what: str, where: str) -> StorageError | None:
    """A :class:`StorageError` that says what failed, where, and what to do (None: not storage)."""
    found = storage_problem(exc)
    if found is None:
        return None
    problem, filename = found
    hint = {"no space left on device": "free space there (or point store.root elsewhere)",
            "read-only file system": "make it writable (or point store.root elsewhere)",
            "disk quota exceeded": "raise the quota or free space there",
            "permission denied": "fix the permissions there"}[problem]
    at = f" (writing {filename})" if filename else ""
    return StorageError(f"{what}: {problem} at {where}{at}: {hint} and run the same command again; "
                        "complete artifacts are untouched and this one is not marked complete")


@contextlib.contextmanager
def naming_storage_errors(what: str, where: str) -> Iterator[None]:
    """Inside: a storage failure (disk full, read-only, quota, permissions) is raised as the
    :class:`StorageError` :func:`storage_error` words; other exceptions pass through unchanged."""
    try:
        yield
    except StorageError:
        raise
    except Exception as e:
        clear = storage_error(e, what, where)
        if clear is None:
            raise
        raise clear from e


@dataclass(frozen=True)
class Artifact:
    stage: str
    fingerprint: str
    path: str  # the artifact's directory (local path or URL)

    @property
    def manifest_path(self) -> str:
        return f"{self.path}/{MANIFEST}"


class ArtifactStore:
    """``<root>/<stage>/<fingerprint>/`` directories with manifests, on any fsspec root;
    ``stage_roots`` puts a stage's artifacts at ``<stage_root>/<fingerprint>/`` instead. Callers
    get one from :func:`open_store`."""

    def __init__(self, root: str, stage_roots: dict[str, str] | None = None):
        self.root = root.rstrip("/")
        self.stage_roots = {k: fs.norm(v) for k, v in (stage_roots or {}).items() if v}

    def with_stage_root(self, stage: str, root: str | None) -> ArtifactStore:
        """This store with ``stage`` at ``root`` (None: where it was)."""
        if not root:
            return self
        return ArtifactStore(self.root, {**self.stage_roots, stage: fs.norm(root)})

    def stage_dir(self, stage: str) -> str:
        """The directory holding ``stage``'s artifacts."""
        return self.stage_roots.get(stage) or f"{self.root}/{stage}"

    def artifact(self, stage: str, fp: str) -> Artifact:
        for part in (stage, fp):
            if not part or "/" in part or part in (".", ".."):
                raise ValueError(f"invalid artifact address component {part!r}")
        return Artifact(stage, fp, f"{self.stage_dir(stage)}/{fp}")

    def _pointer_path(self, stage: str, fp: str) -> str:
        return f"{self.root}/{stage}/{fp}/{LOCATION}"

    def _home(self, stage: str, fp: str) -> Artifact:
        return Artifact(stage, fp, f"{self.root}/{stage}/{fp}")

    def _pointed(self, stage: str, fp: str) -> Artifact | None:
        try:
            text = fs.read_text(self._pointer_path(stage, fp))
            where = json.loads(text)["path"] if text else None
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            log.warning("%s: unreadable pointer (%s); ignoring it", self._pointer_path(stage, fp), e)
            return None
        return Artifact(stage, fp, where) if isinstance(where, str) and where else None

    def locate(self, stage: str, fp: str) -> Artifact:
        """Where the artifact is: the first of its address here, its usual address under the root
        (a stage kept elsewhere may have been built before it was), and where a pointer says,
        that holds a manifest; its address here when none does."""
        art = self.artifact(stage, fp)
        if fs.exists(art.manifest_path):
            return art
        home = self._home(stage, fp)
        if home.path != art.path and fs.exists(home.manifest_path):
            return home
        pointed = self._pointed(stage, fp)
        if pointed is not None and pointed.path != art.path and fs.exists(pointed.manifest_path):
            return pointed
        return art

    def remember(self, art: Artifact) -> None:
        """Leave a pointer at the usual address to a complete artifact kept elsewhere (once: a
        hit in a shared ``cache_dir`` by an experiment of another store makes the pointer that
        the lineage of its runs follows)."""
        if art.path == self._home(art.stage, art.fingerprint).path:
            return
        pointed = self._pointed(art.stage, art.fingerprint)
        if pointed is None or pointed.path != fs.norm(art.path):
            atomic_write_text(self._pointer_path(art.stage, art.fingerprint), json.dumps({"path": fs.norm(art.path)}))

    def manifest(self, stage: str, fp: str) -> dict[str, Any] | None:
        """The manifest of a complete artifact (followed through a pointer), or None."""
        art = self.artifact(stage, fp)
        try:
            text = fs.read_text(art.manifest_path)  # the usual case: one read, no existence checks
            if text is None:
                art = self.locate(stage, fp)  # elsewhere (data.cache_dir), or not complete
                text = fs.read_text(art.manifest_path) if art.path != self.artifact(stage, fp).path else None
            if text is None:
                return None
            manifest = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            log.warning("%s: unreadable manifest (%s); treating the artifact as incomplete", art.manifest_path, e)
            return None
        # Only this store's commit of this address counts: a manifest.json that a stage copied in
        # with its payload (another artifact's) must not make a partial artifact look complete.
        if not isinstance(manifest, dict) or (manifest.get("stage"), manifest.get("fingerprint")) != (stage, fp):
            who = (manifest.get("stage"), manifest.get("fingerprint")) if isinstance(manifest, dict) else type(manifest).__name__
            log.warning("%s: manifest of %s, not of %s/%s; treating the artifact as incomplete",
                        art.manifest_path, who, stage, fp)
            return None
        return manifest

    def is_complete(self, stage: str, fp: str) -> bool:
        return self.manifest(stage, fp) is not None

    def complete(self, stage: str) -> list[dict[str, Any]]:
        """Manifests of all complete artifacts of a stage, oldest first."""
        out = {}
        for where in dict.fromkeys((f"{self.root}/{stage}", self.stage_dir(stage))):
            for fp, _is_dir in fs.listdir(where):
                if fp.startswith(".") or fp in out:  # locks and fan-out scratch space
                    continue
                m = self.manifest(stage, fp)
                if m is not None:
                    out[fp] = m
        return sorted(out.values(), key=lambda m: m.get("created", ""))

    def commit(self, art: Artifact, info: dict[str, Any]) -> dict[str, Any]:
        """Write the manifest (last, atomically): the artifact is now complete."""
        manifest = {
            "stage": art.stage,
            "fingerprint": art.fingerprint,
            "created": datetime.now(UTC).isoformat(),
            **info,
        }
        text = json.dumps(manifest, indent=2, sort_keys=True, default=str)
        # A writer killed mid-write (an earlier attempt at this address) may have left temporary
        # files in the payload; the lock is held and this attempt's writes are renamed, so any
        # temporary name still there is stale and must not be published with the artifact.
        for stale in remove_stale_temps_under(art.path):
            log.info("%s: removed a temporary file left by an interrupted writer", stale)
        faultpoint(f"{art.stage}.before_manifest")  # the payload is written, the marker not yet
        atomic_write_text(art.manifest_path, text, fault=f"{art.stage}.manifest_tmp_written")
        remove_stale_temps(art.manifest_path)  # temporary manifests of writers killed mid-write
        self.remember(art)  # kept elsewhere (data.cache_dir): a pointer at the usual address
        return manifest

    @contextlib.contextmanager
    def lock(self, art: Artifact, timeout: float | None = None) -> Iterator[None]:
        """Exclusive lock for building ``art`` (local roots; a no-op on object stores, see the
        module docstring); ``timeout`` in seconds, None waits forever."""
        with contextlib.ExitStack() as stack:
            try:
                # under the root even for a stage kept elsewhere: a local root locks a bucket's cache
                stack.enter_context(fs.exclusive_lock(f"{self.root}/{art.stage}/.{art.fingerprint}.lock", timeout))
            except TimeoutError:
                raise TimeoutError(f"another process is building {art.path}") from None
            yield


def open_store(where: ArtifactStore | str, stage_roots: dict[str, str | None] | None = None) -> ArtifactStore:
    """The artifact store at ``where`` (its root: a local path or URL), or ``where`` itself; with
    ``stage_roots``, the stages named there kept at their own roots (None: where they were)."""
    store = where if isinstance(where, ArtifactStore) else ArtifactStore(where)
    for stage, root in (stage_roots or {}).items():
        store = store.with_stage_root(stage, root)
    return store
