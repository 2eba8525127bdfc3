"""Data sources: url expansion, formats, compression, fsspec, HF datasets, shards, builtin corpus."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import uuid

import pytest

from lm_pipeline.data.config import DataConfig, TokenizerConfig
from lm_pipeline.data.sources import (
    Shard,
    ShardChangedError,
    expand_urls,
    infer_format,
    iter_shard_texts,
    resolve_shards,
    split_names,
    validation_sets,
)
from lm_pipeline.schema import ConfigError, from_dict, to_dict

DOCS = ["first document", "second one, with ünïcode ✓", "third\nhas two lines"]


def _compress(data: bytes, compression: str | None) -> bytes:
    if compression == "gzip":
        return gzip.compress(data, mtime=0)
    if compression == "zstd":
        import zstandard

        return zstandard.ZstdCompressor().compress(data)
    return data


def _payload(fmt: str, docs: list[str], key: str = "text") -> bytes:
    if fmt == "jsonl":
        return "".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()
    if fmt == "json":
        return json.dumps([{key: d} for d in docs], indent=1).encode()
    if fmt == "text":
        return "\n\n".join(docs).encode()
    raise AssertionError(fmt)


def _write(path, data: bytes) -> str:
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


def _texts(cfg: DataConfig, split: str = "train") -> list[str]:
    return list(iter_shard_texts(resolve_shards(cfg, split)))


# --- url expansion ----------------------------------------------------------------------------


def test_brace_expansion_and_order(tmp_path):
    for i in (1, 2, 3, 10):
        _write(tmp_path / f"part-{i}.jsonl", _payload("jsonl", [f"doc {i}"]))
    cfg = DataConfig(train_urls=(str(tmp_path / "part-{1..3}.jsonl"), str(tmp_path / "part-10.jsonl")))
    shards = resolve_shards(cfg, "train")
    assert [os.path.basename(s.name) for s in shards] == [
        "part-1.jsonl",
        "part-2.jsonl",
        "part-3.jsonl",
        "part-10.jsonl",
    ]
    assert _texts(cfg) == ["doc 1", "doc 2", "doc 3", "doc 10"]
    # zero-padded ranges, and a missing member is an error naming it
    _write(tmp_path / "z" / "s-01.jsonl", _payload("jsonl", ["a"]))
    _write(tmp_path / "z" / "s-02.jsonl", _payload("jsonl", ["b"]))
    assert len(expand_urls([str(tmp_path / "z" / "s-{01..02}.jsonl")])) == 2
    with pytest.raises(ConfigError, match=r"s-03\.jsonl'?: no such file"):
        expand_urls([str(tmp_path / "z" / "s-{01..03}.jsonl")])


def test_globs_directories_and_duplicates(tmp_path):
    _write(tmp_path / "d" / "b.jsonl", _payload("jsonl", ["b"]))
    _write(tmp_path / "d" / "a.jsonl.gz", _compress(_payload("jsonl", ["a"]), "gzip"))
    _write(tmp_path / "d" / "sub" / "c.txt", b"c")
    _write(tmp_path / "d" / "_SUCCESS", b"")
    _write(tmp_path / "d" / ".hidden.jsonl", b"{}")
    got = [os.path.relpath(u, tmp_path) for u, _ in expand_urls([str(tmp_path / "d" / "*.jsonl*")])]
    assert got == ["d/a.jsonl.gz", "d/b.jsonl"]
    got = [os.path.relpath(u, tmp_path) for u, _ in expand_urls([str(tmp_path / "d" / "**" / "*.txt")])]
    assert got == ["d/sub/c.txt"]
    # a directory stands for its supported files, sorted and recursive; hidden / _ files skipped
    got = [os.path.relpath(u, tmp_path) for u, _ in expand_urls([str(tmp_path / "d")])]
    assert got == ["d/a.jsonl.gz", "d/b.jsonl", "d/sub/c.txt"]
    assert _texts(DataConfig(train_urls=(str(tmp_path / "d"),))) == ["a", "b", "c"]
    with pytest.raises(ConfigError, match="matches no files"):
        expand_urls([str(tmp_path / "*.parquet")])
    with pytest.raises(ConfigError, match="listed twice"):
        expand_urls([str(tmp_path / "d" / "b.jsonl"), str(tmp_path / "d" / "*.jsonl")])
    # file:// urls work like paths
    assert _texts(DataConfig(train_urls=("file://" + str(tmp_path / "d" / "b.jsonl"),))) == ["b"]


def test_unknown_extension_needs_format(tmp_path):
    p = _write(tmp_path / "data.dat", _payload("jsonl", DOCS))
    with pytest.raises(ConfigError, match="data.format"):
        resolve_shards(DataConfig(train_urls=(p,)), "train")
    assert _texts(DataConfig(train_urls=(p,), format="jsonl")) == DOCS
    assert infer_format("x/y.JSONL.ZST") == ("jsonl", "zstd")
    assert infer_format("x/y.txt.gz") == ("text", "gzip")


# --- formats ----------------------------------------------------------------------------------


@pytest.mark.parametrize("compression", [None, "gzip", "zstd"])
@pytest.mark.parametrize("fmt", ["jsonl", "json", "text"])
def test_formats_and_compression_round_trip(tmp_path, fmt, compression):
    ext = {"jsonl": ".jsonl", "json": ".json", "text": ".txt"}[fmt] + {
        None: "",
        "gzip": ".gz",
        "zstd": ".zst",
    }[compression]
    p = _write(tmp_path / f"data{ext}", _compress(_payload(fmt, DOCS), compression))
    cfg = DataConfig(train_urls=(p,), text_unit="paragraph")
    (shard,) = resolve_shards(cfg, "train")
    assert shard.settings.format == fmt and shard.settings.compression == compression
    assert list(shard.iter_texts()) == DOCS
    assert shard.last_report.records == 3 and shard.last_report.valid == 3 and shard.last_report.complete


def test_text_units(tmp_path):
    p = _write(tmp_path / "t.txt", b"para one\nline two\n\n\npara two\n\nlast")
    assert _texts(DataConfig(train_urls=(p,))) == ["para one\nline two\n\n\npara two\n\nlast"]
    assert _texts(DataConfig(train_urls=(p,), text_unit="paragraph")) == [
        "para one\nline two",
        "para two",
        "last",
    ]
    cfg = DataConfig(train_urls=(p,), text_unit="line")
    (shard,) = resolve_shards(cfg, "train")
    assert list(shard.iter_texts()) == ["para one", "line two", "para two", "last"]
    assert shard.last_report.blank_lines == 3


def test_json_object_with_records(tmp_path):
    p = _write(
        tmp_path / "o.json", json.dumps({"meta": {"v": 1}, "rows": [{"body": d} for d in DOCS]}).encode()
    )
    assert _texts(DataConfig(train_urls=(p,), text_key="body")) == DOCS
    two = _write(tmp_path / "two.json", json.dumps({"a": [{"text": "x"}], "b": [{"text": "y"}]}).encode())
    with pytest.raises(ValueError, match="json_records_key"):
        _texts(DataConfig(train_urls=(two,)))
    assert _texts(DataConfig(train_urls=(two,), json_records_key="b")) == ["y"]
    single = _write(tmp_path / "one.json", json.dumps({"text": "solo", "tags": ["t"]}).encode())
    assert _texts(DataConfig(train_urls=(single,))) == ["solo"]


def test_parquet_local(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"id": list(range(3)), "content": DOCS}), p, row_group_size=2)
    cfg = DataConfig(train_urls=(p,), text_key="content")
    assert _texts(cfg) == DOCS
    # a binary column is decoded per value
    pb = str(tmp_path / "b.parquet")
    pq.write_table(pa.table({"text": pa.array([d.encode() for d in DOCS], pa.binary())}), pb)
    assert _texts(DataConfig(train_urls=(pb,))) == DOCS


def test_memory_fsspec_urls():
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"memory://lmp-{uuid.uuid4().hex[:8]}"
    with fs.open(f"{root}/a-1.jsonl.gz", "wb") as f:
        f.write(_compress(_payload("jsonl", DOCS[:2]), "gzip"))
    with fs.open(f"{root}/a-2.jsonl", "wb") as f:
        f.write(_payload("jsonl", DOCS[2:]))
    cfg = DataConfig(train_urls=(f"{root}/a-{{1..2}}.jsonl*",))
    shards = resolve_shards(cfg, "train")
    assert len(shards) == 2 and all(s.url.startswith("memory://") for s in shards)
    assert list(iter_shard_texts(shards)) == DOCS
    direct = DataConfig(train_urls=(f"{root}/a-2.jsonl",))
    assert _texts(direct) == DOCS[2:]
    fp = resolve_shards(direct, "train")[0].fingerprint
    assert len(fp) == 64


# --- Hugging Face datasets --------------------------------------------------------------------


def test_datasets_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    rows = [f"row {i}" for i in range(5)]
    d = str(tmp_path / "ds")
    datasets.Dataset.from_dict({"text": rows, "n": list(range(5))}).save_to_disk(d)
    # listed among urls ...
    cfg = DataConfig(train_urls=(d,), hf_shard_rows=2)
    shards = resolve_shards(cfg, "train")
    assert [s.name.rsplit("[", 1)[1] for s in shards] == ["0:2]", "2:4]", "4:5]"]
    assert list(iter_shard_texts(shards)) == rows
    assert len({s.fingerprint for s in shards}) == 3
    again = pickle.loads(pickle.dumps(shards[1]))
    assert list(again.iter_texts()) == rows[2:4] and again.fingerprint == shards[1].fingerprint
    # ... or as hf_id, with splits of a DatasetDict
    dd = str(tmp_path / "dd")
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"body": rows}),
            "test": datasets.Dataset.from_dict({"body": ["held out"]}),
        }
    ).save_to_disk(dd)
    with pytest.raises(ConfigError, match="several splits"):
        resolve_shards(DataConfig(train_urls=(dd,)), "train")
    assert _texts(DataConfig(train_urls=(os.path.join(dd, "test"),), text_key="body")) == ["held out"]
    cfg = DataConfig(hf_id=dd, hf_validation_split="test", text_key="body")
    assert _texts(cfg) == rows
    assert {k: [t for s in v for t in s.iter_texts()] for k, v in validation_sets(cfg).items()} == {
        "validation": ["held out"]
    }
    # identical content saved elsewhere has the same fingerprints (the stored one is random)
    d2 = str(tmp_path / "ds2")
    datasets.Dataset.from_dict({"text": rows, "n": list(range(5))}).save_to_disk(d2)
    assert [
        s.fingerprint for s in resolve_shards(DataConfig(train_urls=(d2,), hf_shard_rows=2), "train")
    ] == [s.fingerprint for s in shards]


def test_datasets_builder_streaming_over_local_files(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    a = _write(tmp_path / "a.jsonl", _payload("jsonl", DOCS[:2]))
    b = _write(tmp_path / "b.jsonl", _payload("jsonl", DOCS[2:]))
    cfg = DataConfig(hf_id="json", hf_data_files=(a, b), hf_streaming=True)
    shards = resolve_shards(cfg, "train")
    assert [s.name for s in shards] == ["hf:json/train#00000-of-00002", "hf:json/train#00001-of-00002"]
    assert list(iter_shard_texts(shards)) == DOCS


# --- shards -----------------------------------------------------------------------------------


def test_shard_pickles_and_fingerprints(tmp_path):
    p = _write(tmp_path / "a.jsonl", _payload("jsonl", DOCS))
    (shard,) = resolve_shards(DataConfig(train_urls=(p,)), "train")
    assert shard.name == p and shard.url == p
    lazy = shard.fingerprint
    clone = pickle.loads(pickle.dumps(shard))
    assert clone == shard and clone.fingerprint == lazy
    assert list(clone.iter_texts()) == DOCS
    # computed while streaming == computed from the raw bytes
    (fresh,) = resolve_shards(DataConfig(train_urls=(p,)), "train")
    assert list(fresh.iter_texts()) == DOCS and fresh._fingerprint == lazy
    # reader settings enter the fingerprint
    (other,) = resolve_shards(DataConfig(train_urls=(p,), min_length=3), "train")
    assert other.fingerprint != lazy
    # a file changed after fingerprinting is caught while reading
    _write(p, _payload("jsonl", DOCS + ["more"]))
    with pytest.raises(ShardChangedError):
        list(shard.iter_texts())
    (changed,) = resolve_shards(DataConfig(train_urls=(p,)), "train")
    assert changed.fingerprint != lazy


def test_shard_in_worker_process(tmp_path):
    import concurrent.futures
    import multiprocessing

    p = _write(tmp_path / "a.jsonl.zst", _compress(_payload("jsonl", DOCS), "zstd"))
    (shard,) = resolve_shards(DataConfig(train_urls=(p,)), "train")
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as ex:
        assert ex.submit(_worker_texts, shard).result(timeout=60) == DOCS


def _worker_texts(shard: Shard) -> list[str]:
    return list(shard.iter_texts())


def test_validation_sets_and_split_names(tmp_path):
    t = _write(tmp_path / "train.jsonl", _payload("jsonl", DOCS))
    v = _write(tmp_path / "val.jsonl", _payload("jsonl", ["v"]))
    w = _write(tmp_path / "wiki.txt", b"w")
    cfg = from_dict(DataConfig, {"train_urls": [t], "validation_urls": [v], "validation": {"wiki": [w]}})
    assert split_names(cfg) == ["train", "validation", "wiki"]
    sets = validation_sets(cfg)
    assert list(sets) == ["validation", "wiki"]
    assert [list(s.iter_texts()) for s in sets["wiki"]] == [["w"]]
    with pytest.raises(ConfigError, match="no validation set named 'nope'; configured: validation, wiki"):
        resolve_shards(cfg, "nope")
    with pytest.raises(ConfigError, match="no training data"):
        resolve_shards(DataConfig(), "train")


# --- config -----------------------------------------------------------------------------------


def test_config_rules_and_aliases():
    with pytest.raises(ConfigError, match="only one training source"):
        from_dict(DataConfig, {"train_urls": ["a.jsonl"], "builtin": "python_stdlib"})
    with pytest.raises(ConfigError, match="data.validation.validation|'validation' is already given"):
        from_dict(DataConfig, {"validation_urls": ["a"], "validation": {"validation": ["b"]}}, "data")
    with pytest.raises(ConfigError, match="reserved"):
        from_dict(DataConfig, {"validation": {"train": ["b"]}})
    with pytest.raises(ConfigError, match="needs hf_id"):
        from_dict(DataConfig, {"hf_validation_split": "test"})
    with pytest.raises(ConfigError, match="python_stdlib"):
        from_dict(DataConfig, {"builtin": "python_stdlb"})
    cfg = from_dict(
        DataConfig, {"id": "wikitext", "name": "wikitext-2-raw-v1", "stream": True, "tokenizer": "gpt2"}
    )
    assert (cfg.hf_id, cfg.hf_name, cfg.hf_streaming) == ("wikitext", "wikitext-2-raw-v1", True)
    assert cfg.tokenizer == TokenizerConfig(kind="hf", name_or_path="gpt2")


def test_semantic_flags():
    sem = to_dict(DataConfig(), semantic_only=True)
    assert {"cache_dir", "num_workers", "shard_group_size"}.isdisjoint(sem)
    for name in (
        "train_urls",
        "validation_urls",
        "validation",
        "text_key",
        "format",
        "min_length",
        "on_invalid",
        "hf_id",
        "hf_revision",
        "builtin",
        "builtin_max_bytes",
        "tokenizer",
        "packing",
        "text_unit",
    ):
        assert name in sem, name
    assert set(to_dict(TokenizerConfig(), semantic_only=True)) == set(to_dict(TokenizerConfig()))


# --- builtin corpus ---------------------------------------------------------------------------


def test_builtin_python_stdlib(tmp_path):
    from lm_pipeline.data.builtin import materialize_builtin

    cfg = DataConfig(builtin="python_stdlib", builtin_max_bytes=400_000, builtin_validation_fraction=0.2)
    train = resolve_shards(cfg, "train", builtin_root=tmp_path / "a")
    val = validation_sets(cfg, builtin_root=tmp_path / "a")["validation"]
    assert train and val and all(s.name.startswith("python_stdlib/") for s in train + val)
    corpus = materialize_builtin("python_stdlib", tmp_path / "b", max_bytes=400_000, validation_fraction=0.2)
    # deterministic: another materialisation elsewhere has the same files, names and fingerprints
    again = resolve_shards(cfg, "train", builtin_root=tmp_path / "b")
    assert [(s.name, s.fingerprint) for s in again] == [(s.name, s.fingerprint) for s in train]
    docs = corpus.manifest["documents"]
    assert docs["train"] == sorted(docs["train"]) and docs["train"]
    assert not set(docs["train"]) & set(docs["validation"])
    assert not any("test" in p.split("/")[0] for p in docs["train"] + docs["validation"])
    assert sum(corpus.manifest["bytes"].values()) < 400_000 * 1.2
    texts = list(iter_shard_texts(train))
    assert len(texts) == len(docs["train"]) and len(list(iter_shard_texts(val))) == len(docs["validation"])
    records = [json.loads(line) for f in corpus.train for line in open(f, encoding="utf-8")]
    assert [r["path"] for r in records] == docs["train"] and [r["text"] for r in records] == texts
    with pytest.raises(ConfigError, match="already given by builtin"):
        DataConfig(builtin="python_stdlib", validation={"validation": ("x",)}).validate()


@pytest.mark.parametrize("where", ["local", "memory"])
def test_builtin_corpus_is_written_once_and_an_interrupted_write_is_redone(tmp_path, where):
    from lm_pipeline import fs
    from lm_pipeline.data.builtin import materialize_builtin

    root = str(tmp_path / "b") if where == "local" else f"memory://lmp-builtin-{uuid.uuid4().hex[:8]}"
    corpus = materialize_builtin("python_stdlib", root, max_bytes=100_000)
    files = {f: fs.read_bytes(f) for f in (*corpus.train, *corpus.validation, fs.join(corpus.root, "manifest.json"))}
    assert all(files.values()) and fs.parent(corpus.root) == fs.join(root, "python_stdlib")
    if where == "local":
        stamps = {f: os.stat(f).st_mtime_ns for f in files}
        assert materialize_builtin("python_stdlib", root, max_bytes=100_000) == corpus
        assert {f: os.stat(f).st_mtime_ns for f in files} == stamps  # reused, not rewritten
    # a writer killed midway: no manifest yet, a shard cut short
    fs.remove(fs.join(corpus.root, "manifest.json"))
    first = corpus.train[0]
    fs.rmtree(first)
    fs.put(_write_bytes(tmp_path / "cut", files[first][:100]), first)
    assert materialize_builtin("python_stdlib", root, max_bytes=100_000) == corpus
    assert {f: fs.read_bytes(f) for f in files} == files
    fs.rmtree(root)


def _write_bytes(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)
