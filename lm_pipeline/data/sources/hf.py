"""Hugging Face datasets as sources: load a dataset once per process, identify it, read its rows.

A dataset is a hub / builder dataset (``datasets.load_dataset``, optionally streamed) or a
directory written by ``datasets.Dataset.save_to_disk``. Its identity (what a shard fingerprint
covers): a ``save_to_disk`` directory hashes its Arrow files; a non-streamed hub / builder dataset
uses the dataset's own fingerprint; a streamed one the resolved hub commit (pin ``hf_revision`` to a
commit sha to avoid a hub query), or the hash of its local ``data_files``.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from lm_pipeline import fs
from lm_pipeline.data.sources.readers import ReaderSettings
from lm_pipeline.data.sources.streams import local_path
from lm_pipeline.data.validation import RawRecord
from lm_pipeline.schema import ConfigError

__all__ = ["HFSpec", "content_identity", "is_disk_dataset", "iter_hf", "load_hf"]


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
        """What identifies the loaded dataset (not the row range): the key of the per-process cache."""
        return (self.path, self.loader, self.name, self.split, self.revision, self.data_files, self.streaming)


# Loading is slow: a process loads each dataset once and every shard of it reads from that.
_HF_CACHE: dict[tuple, Any] = {}


def _datasets():
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "Hugging Face dataset sources need the `datasets` package: pip install 'lm-pipeline[hf]'"
        ) from e
    return datasets


def is_disk_dataset(path: str) -> bool:
    """Whether the directory ``path`` was written by ``save_to_disk`` (a dataset or a dataset dict)."""
    return os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(
        os.path.join(path, "dataset_dict.json")
    )


def load_hf(spec: HFSpec) -> Any:
    """The ``datasets`` dataset (or iterable dataset, when streamed) ``spec`` reads from."""
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
        ds = _load_dataset(datasets, spec)
    _HF_CACHE[key] = ds
    return ds


def _on_hub(datasets: Any, path: str) -> bool:
    """Whether ``load_dataset(path)`` reads the hub: not a URL, not a local directory or file, not a
    builder that ships with ``datasets`` ('json', 'parquet', ...)."""
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    return not fs.scheme(path) and not os.path.exists(local_path(path)) and path not in _PACKAGED_DATASETS_MODULES


def _load_dataset(datasets: Any, spec: HFSpec) -> Any:
    """``datasets.load_dataset`` for ``spec``, failing in one line that names ``data.hf_id``: a hub
    dataset when the hub cannot be reached (checked once, in seconds: :mod:`lm_pipeline.hf.hub`)
    comes from the local cache or not at all."""
    from lm_pipeline.inputs import looks_like_path

    hub_id = _on_hub(datasets, spec.path)
    if hub_id and looks_like_path(spec.path):
        raise ConfigError("data.hf_id", f"'{spec.path}' does not exist; data.hf_id takes a directory written by "
                          "save_to_disk, a hub dataset id 'org/name', or a builder ('json', 'parquet', ...) with "
                          "data.hf_data_files")
    offline = None
    if hub_id:
        from lm_pipeline.hf import hub

        offline = hub.unreachable()
    try:
        return datasets.load_dataset(
            spec.path,
            spec.name,
            split=spec.split,
            revision=spec.revision,
            data_files=list(spec.data_files) or None,
            streaming=spec.streaming,
        )
    except Exception as e:  # noqa: BLE001 - the hub client's and the builders' errors: one line each
        if offline is None and not isinstance(e, (FileNotFoundError, ConnectionError, OSError, ValueError)):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if offline is not None:
            from lm_pipeline.hf import hub

            raise ConfigError("data.hf_id", hub.offline_message(
                "dataset", spec.path, offline, "save it with Dataset.save_to_disk where there is network and point "
                "data.hf_id at that directory")) from None
        raise ConfigError("data.hf_id", f"cannot load the dataset {spec.path!r} ({type(e).__name__}: {first})") from None


def content_identity(spec: HFSpec, ds: Any) -> str:
    """What identifies the content of the dataset ``ds`` loaded for ``spec`` (see the module doc)."""
    if spec.streaming:
        return _hub_commit(spec)
    if spec.loader == "disk":
        return _disk_fingerprint(spec.path)
    return ds._fingerprint  # `datasets` exposes its content hash only under this name


def _disk_fingerprint(path: str) -> str:
    """sha256 over the Arrow files of a ``save_to_disk`` dataset (its stored fingerprint is random)."""
    sha = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        if name.endswith(".arrow"):
            sha.update(name.encode() + b"\0" + fs.sha256_of(os.path.join(path, name)).encode())
    return sha.hexdigest()


def _hub_commit(spec: HFSpec) -> str:
    if spec.revision and re.fullmatch(r"[0-9a-f]{40}", spec.revision):
        return spec.revision
    if spec.data_files:  # a builder ('json', 'parquet', ...) over files: hash local ones
        out = []
        for f in spec.data_files:
            local = fs.as_local(f)  # a file here is named by its content; a URL or a hub pattern by itself
            out.append(fs.sha256_of(local) if local is not None and os.path.isfile(local) else f)
        return hashlib.sha256("\n".join(out).encode()).hexdigest()
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(spec.path, revision=spec.revision).sha
    except Exception as e:  # offline, private, ...
        raise ConfigError(
            "data.hf_revision",
            f"cannot resolve the hub commit of {spec.path!r} ({type(e).__name__}: {e}); pin hf_revision to a commit sha",
        ) from e


def iter_hf(spec: HFSpec, s: ReaderSettings) -> Iterator[RawRecord]:
    """The records of the rows ``spec`` covers (its row range, or its shard of a streamed dataset)."""
    ds = load_hf(spec)
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
