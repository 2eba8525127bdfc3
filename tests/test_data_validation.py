"""Record validation: planted defects under `fail` (clear, located errors) and `skip` (exact counts)."""

from __future__ import annotations

import json
import os
import pickle

import pytest

from lm_pipeline.data import validation as V
from lm_pipeline.data.config import DataConfig
from lm_pipeline.data.sources import iter_shard_texts, resolve_shards
from lm_pipeline.data.validation import (
    DataValidationError,
    RawRecord,
    RecordValidator,
    ShardReport,
    merge_reports,
)

GOOD = [json.dumps({"id": i, "text": f"valid document number {i}"}).encode() for i in range(4)]

# defect name -> (the bad JSONL line, expected reason, expected message after "<file> line 3: ")
DEFECTS = {
    "bad_json": (
        b'{"text": "unterminated',
        "bad_json",
        "invalid JSON: Unterminated string starting at (column 10)",
    ),
    "missing_key": (
        b'{"id": 7, "body": "x"}',
        "missing_key",
        "key 'text' missing (keys: id, body); set data.text_key or fix the record",
    ),
    "not_string": (b'{"text": 42}', "not_string", "'text' is a number, not a string"),
    "null": (b'{"text": null}', "not_string", "'text' is null, not a string"),
    "empty": (b'{"text": "   \\n "}', "empty", "'text' is empty or only whitespace"),
    "invalid_utf8": (
        b'{"text": "caf\xe9 au lait"}',
        "invalid_utf8",
        "invalid UTF-8 (byte 0xe9 at column 14)",
    ),
    "not_object": (b'["text", "a list"]', "not_object", "expected a JSON object, got an array"),
    "lone_surrogate": (
        b'{"text": "bad \\ud800 escape"}',
        "invalid_utf8",
        "'text' is not valid UTF-8 text (lone surrogate at character 4)",
    ),
}


def _jsonl(path, lines: list[bytes]) -> str:
    path = os.fspath(path)
    with open(path, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_fail_names_file_line_and_problem(tmp_path, defect):
    line, reason, message = DEFECTS[defect]
    p = _jsonl(tmp_path / f"{defect}.jsonl", [GOOD[0], GOOD[1], line, GOOD[2]])
    (shard,) = resolve_shards(DataConfig(train_urls=(p,)), "train")
    with pytest.raises(DataValidationError) as info:
        list(shard.iter_texts())
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.source, err.location, err.reason) == (p, "line 3", reason)
    assert str(err).startswith(f"{p} line 3: {message}")
    if reason != "missing_key":
        assert str(err).endswith(
            "set data.on_invalid: skip to drop such records"
        ) or "data.min_length" in str(err)
    # the error survives a process boundary with its fields
    again = pickle.loads(pickle.dumps(err))
    assert (again.location, again.reason, str(again)) == (err.location, err.reason, str(err))


def test_too_short_message(tmp_path):
    p = _jsonl(tmp_path / "s.jsonl", [GOOD[0], b'{"text": "  ab  "}'])
    with pytest.raises(
        DataValidationError,
        match=r"s\.jsonl line 2: 'text' has 2 characters after stripping, fewer than data.min_length = 5",
    ):
        list(iter_shard_texts(resolve_shards(DataConfig(train_urls=(p,), min_length=5), "train")))


def _planted(tmp_path) -> tuple[str, list[str], dict[str, int]]:
    """A corpus with every defect planted among valid lines; returns (path, valid texts, counts)."""
    lines: list[bytes] = []
    valid: list[str] = []
    counts: dict[str, int] = {}
    n = 0
    for _rep in range(3):
        for name in sorted(DEFECTS):
            text = f"valid record {n}"
            lines.append(json.dumps({"text": text}).encode())
            valid.append(text)
            n += 1
            bad, reason, _ = DEFECTS[name]
            lines.append(bad)
            counts[reason] = counts.get(reason, 0) + 1
        lines.append(b"")  # blank lines are not records
    return _jsonl(tmp_path / "planted.jsonl", lines), valid, counts


@pytest.mark.parametrize("chunk", [3, 4096])
def test_skip_counts_every_reason_exactly(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(V, "CHUNK_RECORDS", chunk)  # also across chunk boundaries
    p, valid, counts = _planted(tmp_path)
    (shard,) = resolve_shards(DataConfig(train_urls=(p,), on_invalid="skip"), "train")
    report = ShardReport(shard.name)
    texts = list(shard.iter_texts(report))
    assert texts == valid and len(texts) == 3 * len(DEFECTS)
    assert (
        report.skipped
        == counts
        == {"bad_json": 3, "missing_key": 3, "not_string": 6, "empty": 3, "invalid_utf8": 6, "not_object": 3}
    )
    assert report.records == len(valid) + sum(counts.values()) and report.valid == len(valid)
    assert report.blank_lines == 3 and report.complete and shard.last_report is report
    d = report.to_dict()
    assert d["invalid"] == sum(counts.values()) and list(d["skipped"]) == [
        r for r in V.REASONS if r in counts
    ]
    assert merge_reports([report, report]).skipped["not_string"] == 12
    # under fail the first defect (lowest line) is the one reported, whatever the chunking
    (strict,) = resolve_shards(DataConfig(train_urls=(p,)), "train")
    with pytest.raises(DataValidationError, match=r"planted\.jsonl line 2: invalid JSON: "):
        list(strict.iter_texts())


def test_json_array_items_have_index_and_line(tmp_path):
    p = tmp_path / "a.json"
    p.write_bytes(
        b'[\n {"text": "ok"},\n {"text": 3},\n {"body": "x"},\n {"text": "caf\xe9"},\n {"text": "fine"}\n]'
    )
    cfg = DataConfig(train_urls=(str(p),))
    with pytest.raises(DataValidationError, match=r"a\.json item 1 \(line 3\): 'text' is a number"):
        list(iter_shard_texts(resolve_shards(cfg, "train")))
    (shard,) = resolve_shards(DataConfig(train_urls=(str(p),), on_invalid="skip"), "train")
    assert list(shard.iter_texts()) == ["ok", "fine"]
    assert shard.last_report.skipped == {"not_string": 1, "missing_key": 1, "invalid_utf8": 1}
    # a syntax error between items ends the file and is counted once
    p.write_bytes(b'[{"text": "ok"}, {"text": "two"} {"text": "lost"}]')
    (shard,) = resolve_shards(DataConfig(train_urls=(str(p),), on_invalid="skip"), "train")
    assert list(shard.iter_texts()) == ["ok", "two"] and shard.last_report.skipped == {"bad_json": 1}


def test_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"text": ["good one", None, "", "good two"]}), p)
    with pytest.raises(DataValidationError, match=r"d\.parquet row 1: 'text' is null, not a string"):
        list(iter_shard_texts(resolve_shards(DataConfig(train_urls=(p,)), "train")))
    (shard,) = resolve_shards(DataConfig(train_urls=(p,), on_invalid="skip"), "train")
    assert list(shard.iter_texts()) == ["good one", "good two"]
    assert shard.last_report.skipped == {"not_string": 1, "empty": 1}
    with pytest.raises(
        DataValidationError, match=r"row 0: key 'body' missing \(keys: text\); set data.text_key"
    ):
        list(iter_shard_texts(resolve_shards(DataConfig(train_urls=(p,), text_key="body"), "train")))


def test_text_paragraph_with_bad_bytes(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes(b"first para\n\nsecond \xff para\nmore\n\n   \n\nthird")
    cfg = DataConfig(train_urls=(str(p),), text_unit="paragraph")
    with pytest.raises(
        DataValidationError, match=r"t\.txt line 3: invalid UTF-8 \(byte 0xff at line 3, column 8\)"
    ):
        list(iter_shard_texts(resolve_shards(cfg, "train")))
    (shard,) = resolve_shards(
        DataConfig(train_urls=(str(p),), text_unit="paragraph", on_invalid="skip"), "train"
    )
    assert list(shard.iter_texts()) == ["first para", "third"] and shard.last_report.skipped == {
        "invalid_utf8": 1
    }
    # whole-file documents: the file is one record
    with pytest.raises(DataValidationError, match=r"t\.txt line 3: invalid UTF-8"):
        list(iter_shard_texts(resolve_shards(DataConfig(train_urls=(str(p),)), "train")))


def test_min_length_zero_keeps_empty_texts():
    v = RecordValidator("mem", "text", 0, "fail")
    recs = [RawRecord("line 1", value=""), RawRecord("line 2", value=" x ")]
    assert list(v.iter_valid(recs, ShardReport("mem"))) == ["", " x "]


def test_pandera_schema_flags_each_row_once():
    v = RecordValidator("mem", "text", 3, "skip")
    chunk = [
        RawRecord("r0", value="fine text"),
        RawRecord("r1", "bad_json", "invalid JSON", False),
        RawRecord("r2", present=False, keys=("a",)),
        RawRecord("r3", value=["list"]),
        RawRecord("r4", value="\ud800"),
        RawRecord("r5", value=" \t"),
        RawRecord("r6", value=" ab "),
    ]
    assert v.check_chunk(chunk) == {
        1: "bad_json",
        2: "missing_key",
        3: "not_string",
        4: "invalid_utf8",
        5: "empty",
        6: "too_short",
    }
    schema = V.record_schema(3)
    assert {c.name for c in schema.checks} == {
        "parse_error",
        "missing_key",
        "not_string",
        "invalid_utf8",
        "empty",
        "too_short",
    }


def test_valid_records_of_a_planted_corpus_all_reach_the_cache(tmp_path):
    """Under `skip`, every valid record becomes exactly one cached document, in order."""
    from helpers.data import tiny_tokenizer

    from lm_pipeline.data.cache import build_cache, open_cache
    from lm_pipeline.data.tokenizer import load_tokenizer

    p, valid, counts = _planted(tmp_path)
    (shard,) = resolve_shards(DataConfig(train_urls=(p,), on_invalid="skip"), "train")
    tok_dir = str(tmp_path / "tok")
    tiny_tokenizer(tok_dir)
    build_cache(str(tmp_path / "cache"), [shard], tok_dir, num_workers=1, progress=False)
    cache = open_cache(str(tmp_path / "cache"))
    assert cache.num_docs == len(valid) == 3 * len(DEFECTS)
    assert cache.num_bytes == sum(len(t.encode("utf-8")) for t in valid)
    tok = load_tokenizer(tok_dir)
    assert [tok.decode(cache.doc(i)[:-1].tolist()) for i in range(cache.num_docs)] == valid


def test_cache_command_says_what_the_data_kept_and_skipped(tmp_path, capsys, monkeypatch):
    """``lm-pipeline cache`` under ``skip``: one line with the records kept per split and every
    skip reason counted -- also when the data was built before (a cache hit)."""

    import yaml
    from helpers import pipeline as pt

    from lm_pipeline.cli import main

    monkeypatch.setenv("LM_PIPELINE_NO_TCMALLOC", "1")
    p, valid, counts = _planted(tmp_path)
    val = _jsonl(tmp_path / "val.jsonl", [json.dumps({"text": f"validation text {i}"}).encode() for i in range(2)])
    cfg = pt.tiny_config(tmp_path)
    cfg["data"].update({"train_urls": [str(p)], "validation_urls": [str(val)], "on_invalid": "skip"})
    path = tmp_path / "planted.yaml"
    path.write_text(yaml.safe_dump(cfg))
    expected = (f"data: kept {len(valid) + 2} of {len(valid) + sum(counts.values()) + 2} records "
                f"(train {len(valid)}, validation 2); skipped {sum(counts.values())}: "
                "invalid_utf8×6, not_string×6, bad_json×3, empty×3, missing_key×3, not_object×3")
    for _ in range(2):  # built, then a cache hit
        assert main(["cache", "--config_path", str(path), "--data.tokenizer.vocab_size", "270"]) == 0
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("data: ")]
        assert lines == [expected]
        assert "%|" not in err and "\r" not in err  # no progress bars written into a log (not a terminal)


def test_a_data_error_under_fail_is_one_line_and_debug_shows_the_traceback(tmp_path):
    """``lm-pipeline cache`` with ``on_invalid: fail`` on a bad record: exit 2 and one line naming
    the file, the line and the fix; ``--debug`` gives the traceback instead."""
    import os
    import subprocess
    import sys

    import yaml
    from helpers import pipeline as pt

    p, _, _ = _planted(tmp_path)
    cfg = pt.tiny_config(tmp_path)
    cfg["data"].update({"train_urls": [str(p)], "on_invalid": "fail"})
    path = tmp_path / "strict.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "LM_PIPELINE_NO_TCMALLOC": "1", "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "lm_pipeline.cli", "cache", "--config_path", str(path), "--log_level", "ERROR"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    errors = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("error: ") and "planted.jsonl line 2" in errors[0], errors
    assert "on_invalid" in errors[0]  # and what to do about it
    debug = subprocess.run([*cmd, "--debug"], capture_output=True, text=True, timeout=300, env=env)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "DataValidationError" in debug.stderr


def test_a_corrupt_compressed_shard_under_skip_keeps_what_precedes_the_damage_and_says_so(tmp_path):
    import gzip

    from lm_pipeline.config import load_config
    from lm_pipeline.steps import Pipeline
    from lm_pipeline.steps.builders import data_summary

    texts = [f"document {i}: " + "word " * 40 for i in range(300)]
    whole = gzip.compress(("\n".join(json.dumps({"text": t}) for t in texts) + "\n").encode())
    bad = tmp_path / "cut.jsonl.gz"
    bad.write_bytes(whole[: len(whole) // 2])
    good = _jsonl(tmp_path / "val.jsonl", [json.dumps({"text": "validation text"}).encode()])
    cfg = load_config(None, {"data.train_urls": [str(bad)], "data.validation_urls": [good], "data.on_invalid": "skip",
                             "store.root": str(tmp_path / "store")})
    res = Pipeline(cfg, progress=False).raw_shards()
    (row,) = res.manifest["shards"]["train"]
    assert 0 < row["valid"] < len(texts) and "truncated or corrupt" in row["damaged"]
    line = data_summary(res.manifest)
    assert line.startswith(f"kept {row['valid'] + 1} of {row['records'] + 1} records (train {row['valid']}, validation 1)")
    assert line.endswith(f"corrupt, read up to the damage (the records before it kept): {row['name']}")
    # under fail the same shard is one error naming the file and the way out
    strict = load_config(None, {"data.train_urls": [str(bad)], "store.root": str(tmp_path / "store2")})
    with pytest.raises(DataValidationError, match=r"cut\.jsonl\.gz: the gzip stream is truncated or corrupt.*on_invalid: skip"):
        Pipeline(strict, progress=False).raw_shards()


@pytest.mark.parametrize("min_length", [0, 1, 2, 5])
def test_a_clean_chunk_skips_the_schema_only_when_the_schema_passes_it(min_length, monkeypatch):
    """The fast path for chunks of plainly good texts agrees with the pandera schema: for random
    records of every kind, a record is 'plainly valid' exactly when the schema flags nothing for
    it; a chunk of such records never reaches the schema (nor imports pandera's checks), and one
    bad record among them sends the whole chunk to the schema, which names it."""
    import random

    rng = random.Random(min_length)
    values = ["", " ", " \t\n", "a", " ab ", "abcd", "abcde", "  abcdef  ", "é", "日本語テキスト", "\ud800x", "x\udfff",
              42, None, ["list"], {"o": 1}, 1.5, True]
    v = RecordValidator("mem", "text", min_length, "skip")
    records = []
    for i in range(400):
        kind = rng.random()
        if kind < 0.1:  # a parse problem, or a missing key, with or without a text beside it
            records.append(RawRecord(f"r{i}", "bad_json", "invalid JSON", rng.random() < 0.5, rng.choice([None, "good text"])))
        elif kind < 0.2:
            records.append(RawRecord(f"r{i}", present=False, value=rng.choice([None, "good text"]), keys=("a",)))
        else:
            records.append(RawRecord(f"r{i}", value=rng.choice(values)))
    schema = v._schema_failures(records)
    plain = {i for i, rec in enumerate(records) if v._plainly_valid(rec)}
    assert plain and len(plain) < len(records)
    assert plain == set(range(len(records))) - set(schema)  # plainly valid <=> no schema failure

    calls = []
    monkeypatch.setattr(v, "_schema_failures", lambda chunk: calls.append(len(chunk)) or {})
    clean = [records[i] for i in sorted(plain)]
    assert v.check_chunk(clean) == {} and calls == []
    monkeypatch.undo()
    bad = next(i for i in range(len(records)) if i not in plain)
    mixed = [*clean[:5], records[bad], *clean[5:9]]
    assert v.check_chunk(mixed) == {5: schema[bad]}
