"""Resolution: the ``data:`` config -> the shards of each split (train and validation sets).

Each entry of ``train_urls``, ``validation_urls`` and ``validation: {name: urls}`` is brace
expanded (``data-{001..032}.jsonl.gz``, ``{train,extra}.jsonl``), then globbed if it holds ``*``,
``?`` or ``[`` (matches sorted; ``**`` recurses), then read through fsspec: local paths,
``file://``, ``memory://``, and ``gs://`` / ``s3://`` / ... where their fsspec packages (gcsfs,
s3fs) are installed. A directory stands for the supported files under it (sorted, recursive;
hidden and ``_``-prefixed names skipped), except that a directory written by
``datasets.Dataset.save_to_disk`` is read as a Hugging Face dataset. A pattern matching nothing, a
missing file and the same file listed twice are errors. ``hf_id`` names a Hugging Face dataset
(split into shards of ``hf_shard_rows`` rows, or the streamed dataset's own shards) and
``builtin`` a built-in corpus.
"""

from __future__ import annotations

import glob as _glob
import os
import re
from collections.abc import Iterable
from dataclasses import replace

from lm_pipeline.data.config import DEFAULT_VALIDATION_SET, DataConfig
from lm_pipeline.data.sources.hf import HFSpec, content_identity, is_disk_dataset, load_hf
from lm_pipeline.data.sources.readers import ReaderSettings, infer_format
from lm_pipeline.data.sources.shard import Shard, shard_fingerprint
from lm_pipeline.data.sources.streams import local_path
from lm_pipeline.fs import is_local, norm
from lm_pipeline.schema import ConfigError

__all__ = ["expand_urls", "resolve_shards", "split_names", "validation_sets"]


def _settings(cfg: DataConfig, fmt: str, compression: str | None) -> ReaderSettings:
    return ReaderSettings(
        format=fmt,  # type: ignore[arg-type]
        compression=compression,  # type: ignore[arg-type]
        text_key=cfg.chat.messages_field if cfg.chat is not None else cfg.text_key,
        min_length=cfg.min_length,
        on_invalid=cfg.on_invalid,
        text_unit=cfg.text_unit,
        json_records_key=cfg.json_records_key,
        chat=cfg.chat is not None,
    )


_MAGIC = re.compile(r"[*?\[]")


def _expand_one(pattern: str, where: str) -> list[tuple[str, bool]]:
    """Files for one brace-expanded pattern: [(url, is_dataset_dir)]."""
    # Local matches keep the config's spelling (relative stays relative, file:// stays): shard names
    # enter fingerprints, and fsspec's local filesystem would make them absolute.
    if is_local(pattern):
        prefix = "file://" if pattern.startswith("file://") else ""
        path = local_path(pattern)
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
                if is_disk_dataset(h):
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
                key = norm(url)
                if key in seen:
                    raise ConfigError(where, f"{url!r} is listed twice")
                seen.add(key)
                out.append((url, is_ds))
    return out


def _file_shards(cfg: DataConfig, urls: Iterable[str], where: str) -> list[Shard]:
    shards = []
    for url, is_ds in expand_urls(urls, where):
        if is_ds:
            if os.path.isfile(os.path.join(local_path(url), "dataset_dict.json")):
                splits = sorted(
                    d for d in os.listdir(local_path(url)) if os.path.isdir(os.path.join(local_path(url), d))
                )
                raise ConfigError(
                    where,
                    f"{url!r} holds several splits ({', '.join(splits)}); list one split's directory, e.g. {url}/{splits[0] if splits else 'train'}",
                )
            shards.extend(_hf_shards(cfg, HFSpec(path=local_path(url), loader="disk"), prefix=url, url=url))
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
    ds = load_hf(spec)
    if spec.streaming:
        n = max(1, int(getattr(ds, "num_shards", 1) or 1))
        base = content_identity(spec, ds)
        out = []
        for i in range(n):
            sp = replace(spec, index=i, num_shards=n)
            fp = shard_fingerprint(settings, base, sp)
            out.append(Shard(f"{prefix}#{i:05d}-of-{n:05d}", url, settings, sp, fingerprint=fp))
        return out
    total = len(ds)
    base = content_identity(spec, ds)
    step = cfg.hf_shard_rows
    out = []
    for lo in range(0, max(total, 1), step):
        hi = min(lo + step, total)
        sp = replace(spec, start=lo, stop=hi)
        fp = shard_fingerprint(settings, base, sp)
        out.append(Shard(f"{prefix}[{lo}:{hi}]", url, settings, sp, fingerprint=fp))
    return out


def _hf_config_shards(cfg: DataConfig, split: str) -> list[Shard]:
    assert cfg.hf_id is not None
    path = local_path(cfg.hf_id)
    if os.path.isdir(path) and is_disk_dataset(path):
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
