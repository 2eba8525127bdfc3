"""Data sources against expectations computed here: records the test writes itself and counts it
derives from them.

Checked: the JSONL reader takes the configured ``text_key`` (not ``text``); a Hugging Face
``save_to_disk`` dataset of more rows than one read batch yields every row once, in order;
``min_length`` keeps a text of exactly that many characters (after stripping) and drops shorter
ones, with the drops counted; under ``on_invalid: fail`` the report counts the records before the
failing one; the built-in ``python_stdlib`` corpus fills ``max_bytes`` with the documented greedy
rule (never above it, every file when they fit exactly) and its JSONL shards hold every selected
module exactly once, across shard boundaries; a :class:`TextShard`'s fingerprint covers its name
and where one text ends; the ``raw_shards`` stage lists each split's own files (validation files
apart from training ones) and its summary and manifest count the records, valid records and skips
of each split; a trained byte-level BPE equals one trained with the ``tokenizers`` library directly
on the first ``max_train_chars`` characters, with the special tokens first and the first as EOS.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig

import pytest

from lm_pipeline.data.config import DataConfig
from lm_pipeline.data.sources import iter_shard_texts, resolve_shards
from lm_pipeline.data.validation import DataValidationError


def _jsonl(path, rows) -> str:
    path = os.fspath(path)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


# --- readers ------------------------------------------------------------------------------


def test_jsonl_reads_the_configured_text_key(tmp_path):
    bodies = [f"body number {i}" for i in range(4)]
    p = _jsonl(tmp_path / "a.jsonl", [{"text": f"decoy {i}", "body": b} for i, b in enumerate(bodies)])
    (shard,) = resolve_shards(DataConfig(train_urls=(p,), text_key="body"), "train")
    assert list(shard.iter_texts()) == bodies
    # a record holding only the default key is missing the configured one
    q = _jsonl(tmp_path / "b.jsonl", [{"body": "kept"}, {"text": "no body here"}])
    (shard,) = resolve_shards(DataConfig(train_urls=(q,), text_key="body", on_invalid="skip"), "train")
    assert list(shard.iter_texts()) == ["kept"]
    assert shard.last_report.skipped == {"missing_key": 1}


def test_a_datasets_directory_larger_than_one_read_batch_yields_every_row(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    rows = [f"row {i}" for i in range(2600)]
    d = str(tmp_path / "ds")
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(d)
    shards = resolve_shards(DataConfig(train_urls=(d,), hf_shard_rows=2500), "train")
    assert len(shards) == 2
    assert list(iter_shard_texts(shards)) == rows


# --- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("with_invalid", [False, True])
def test_min_length_keeps_texts_of_exactly_that_length(tmp_path, with_invalid):
    n = 5
    texts = ["a" * (n - 1), "b" * n, "  " + "c" * n + "\n", "d" * (n + 1), " " + "e" * (n - 1) + " "]
    expected = [t for t in texts if len(t.strip()) >= n]
    rows: list = [{"text": t} for t in texts]
    if with_invalid:  # a record of another reason in the same chunk
        rows.append({"other": "x"})
    p = _jsonl(tmp_path / "a.jsonl", rows)
    (shard,) = resolve_shards(DataConfig(train_urls=(p,), min_length=n, on_invalid="skip"), "train")
    assert list(shard.iter_texts()) == expected
    report = shard.last_report
    want = {"too_short": len(texts) - len(expected)}
    if with_invalid:
        want["missing_key"] = 1
    assert report.skipped == want
    assert report.records == len(rows) and report.valid == len(expected)


def test_fail_reports_the_records_read_before_the_invalid_one(tmp_path):
    good = [{"text": f"valid document {i}"} for i in range(3)]
    p = _jsonl(tmp_path / "a.jsonl", [*good, "{not json", {"text": "after"}])
    (shard,) = resolve_shards(DataConfig(train_urls=(p,), on_invalid="fail"), "train")
    seen = []
    with pytest.raises(DataValidationError) as e:
        seen.extend(shard.iter_texts())
    assert e.value.location == "line 4" and e.value.reason == "bad_json"
    assert shard.last_report.records == len(good) and shard.last_report.valid == len(good)


# --- builtin corpus -----------------------------------------------------------------------


def _unit(salt: str, path: str) -> float:
    return int.from_bytes(hashlib.sha256(f"{salt}:{path}".encode()).digest()[:8], "big") / 2.0**64


def _fake_stdlib(root, sizes: dict[str, int]) -> None:
    for name, size in sizes.items():
        head = f"# {name}\n"
        body = head + "x" * (size - len(head) - 1) + "\n"
        assert len(body.encode()) == size
        (root / name).write_text(body, encoding="utf-8")


def test_builtin_selection_fills_max_bytes_by_the_documented_rule(tmp_path):
    from lm_pipeline.data.builtin import python_stdlib_documents

    sizes = {"alpha.py": 3000, "beta.py": 5000, "gamma.py": 7000, "delta.py": 11000, "eps.py": 13000}
    _fake_stdlib(tmp_path, sizes)
    total = sum(sizes.values())
    # every file fits exactly
    docs = python_stdlib_documents(max_bytes=total, validation_fraction=0.0, stdlib=str(tmp_path))
    assert sorted(d.path for d in docs) == sorted(sizes)
    # caps below the total: files in sha256("select:" + path) order, any that would overflow skipped
    order = sorted(sizes, key=lambda p: (_unit("select", p), p))
    for cap in (total - 1, total - 3000, 12000, 8000, 4999, 3000, 2999):
        expected, used = [], 0
        for p in order:
            if used + sizes[p] <= cap:
                expected.append(p)
                used += sizes[p]
        docs = python_stdlib_documents(max_bytes=cap, validation_fraction=0.0, stdlib=str(tmp_path))
        assert [d.path for d in docs] == sorted(expected), cap
        assert sum(sizes[d.path] for d in docs) <= cap


def test_builtin_shards_hold_every_selected_module_once(tmp_path):
    from lm_pipeline.data.builtin import materialize_builtin, python_stdlib_documents

    max_bytes, fraction = 1_600_000, 0.2
    corpus = materialize_builtin("python_stdlib", tmp_path, max_bytes=max_bytes, validation_fraction=fraction)
    docs = python_stdlib_documents(max_bytes, fraction)
    stdlib = sysconfig.get_paths()["stdlib"]
    for split, files in (("train", corpus.train), ("validation", corpus.validation)):
        want = sorted(d.path for d in docs if d.split == split)
        assert want and all(_unit("split", p) < fraction for p in want) == (split == "validation")
        records = [json.loads(line) for f in files for line in open(f, encoding="utf-8")]
        assert [r["path"] for r in records] == want
        for r in records:
            with open(os.path.join(stdlib, r["path"]), encoding="utf-8") as f:
                assert r["text"] == f.read(), r["path"]
    assert len(corpus.train) >= 2  # the train split crosses a shard boundary


# --- in-memory shards ---------------------------------------------------------------------


def test_text_shard_fingerprint_covers_its_name_and_text_boundaries():
    from lm_pipeline.data.textshard import TextShard

    a = TextShard("a", ("one", "two"))
    assert a.fingerprint == TextShard("a", ("one", "two")).fingerprint
    assert a.fingerprint != TextShard("b", ("one", "two")).fingerprint
    assert TextShard("a", ("ab", "c")).fingerprint != TextShard("a", ("a", "bc")).fingerprint
    assert a.fingerprint != TextShard("a", ("two", "one")).fingerprint


# --- the raw_shards stage -----------------------------------------------------------------


def test_raw_shards_counts_each_split(tmp_path, monkeypatch):
    from helpers import pipeline as pt

    from lm_pipeline.config import load_config
    from lm_pipeline.steps import Pipeline

    monkeypatch.setenv("LM_PIPELINE_NO_TCMALLOC", "1")
    d = tmp_path / "in"
    d.mkdir()
    t1 = _jsonl(d / "t1.jsonl", [{"text": f"train one {i}"} for i in range(5)] + [{"text": ""}])
    t2 = _jsonl(d / "t2.jsonl", [{"text": f"train two {i}"} for i in range(3)] + ["[1]", {"text": 7}])
    v1 = _jsonl(d / "v1.jsonl", [{"text": f"held out {i}"} for i in range(4)] + [{"no": "text"}])
    path = pt.write_config(
        tmp_path, data={"train_urls": [t1, t2], "validation_urls": [v1], "on_invalid": "skip"}
    )
    res = Pipeline(load_config(path, {}), progress=False).raw_shards()
    want_rows = {
        "train": [(t1, 6, 5, {"empty": 1}), (t2, 5, 3, {"not_object": 1, "not_string": 1})],
        "validation": [(v1, 5, 4, {"missing_key": 1})],
    }
    shards = res.manifest["shards"]
    assert sorted(shards) == sorted(want_rows)
    for split, rows in want_rows.items():
        got = [(r["url"], r["records"], r["valid"], r["skipped"]) for r in shards[split]]
        assert got == rows, split
    flat = [r for rows in want_rows.values() for r in rows]
    assert res.summary["num_shards"] == 3
    assert res.summary["records"] == sum(r[1] for r in flat) == 16
    assert res.summary["valid"] == sum(r[2] for r in flat) == 12
    assert res.summary["skipped"] == sum(sum(r[3].values()) for r in flat) == 4
    assert sorted(res.summary["splits"]) == ["train", "validation"]


# --- BPE training -------------------------------------------------------------------------


def _reference_bpe(texts: list[str], vocab_size: int, min_frequency: int, special: list[str]):
    """A byte-level BPE trained with the tokenizers library directly."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def test_bpe_trains_on_the_first_max_train_chars_characters(tmp_path):
    from tokenizers import Tokenizer

    from lm_pipeline.data.config import TokenizerConfig
    from lm_pipeline.data.tokenizer import train_bpe

    texts = ["hello world QJ said the parrot", "some other text QJ and then more", "never seen QJ QJ QJ"]
    cap = len(texts[0]) + len("some other text QJ")
    special = ["<|endoftext|>", "<|pad|>"]
    cfg = TokenizerConfig(vocab_size=400, min_frequency=2, special_tokens=tuple(special), max_train_chars=cap)
    info = train_bpe(list(texts), cfg, str(tmp_path / "tok"), progress=False)
    ref = _reference_bpe(
        [texts[0], texts[1][: cap - len(texts[0])]], cfg.vocab_size, cfg.min_frequency, special
    )
    got = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    assert "ĠQJ" in ref.get_vocab()  # the pair seen twice within the cap is merged
    assert got.get_vocab() == ref.get_vocab()
    assert json.loads(got.to_str())["model"]["merges"] == json.loads(ref.to_str())["model"]["merges"]
    # the special tokens are the first ids, the first of them EOS / BOS / PAD, none of them merged
    assert [got.token_to_id(t) for t in special] == [0, 1]
    assert (info.eos_id, info.bos_id, info.pad_id) == (0, 0, 0)
    assert info.vocab_size == len(ref.get_vocab())
