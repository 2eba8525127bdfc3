"""Bad inputs: a corpus of hostile shards, each handled per the validation policy with exact
counts (``skip``: dropped and counted per reason; ``fail``: one clear error naming the file, the
line and the fix), and the whole hostile corpus through the tokenizer and the token cache."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest

from lm_pipeline.config import load_config
from lm_pipeline.data.sources import resolve_shards, scan_shards
from lm_pipeline.data.validation import DataValidationError

GOOD = [json.dumps({"text": f"doc {i} hello world"}) for i in range(3)]


def _binary() -> bytes:
    rng = random.Random(0)
    lines = [b"\xff" + bytes(rng.randrange(256) for _ in range(200)).replace(b"\n", b"") for _ in range(10)]
    return b"\n".join(lines) + b"\n"


def _truncated_gz() -> bytes:
    rng = random.Random(1)
    words = ["alpha", "beta", "gamma", "delta", "x", "y", "zeta", "omega"]
    text = "\n".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(60))}) for _ in range(200)) + "\n"
    data = gzip.compress(text.encode())
    return data[: len(data) // 2]


def _whole_gz_texts() -> list[str]:
    """The texts of the file that _truncated_gz() cut in half."""
    rng = random.Random(1)
    words = ["alpha", "beta", "gamma", "delta", "x", "y", "zeta", "omega"]
    return [" ".join(rng.choice(words) for _ in range(60)) for _ in range(200)]


def _mixed() -> bytes:
    return b"\n".join([
        GOOD[0].encode(),
        json.dumps({"text": "caf\u00e9"}, ensure_ascii=False).encode("latin-1"),  # invalid_utf8
        GOOD[1].encode(),
        json.dumps({"text": "\u201cquoted\u201d"}, ensure_ascii=False).encode("cp1252"),  # invalid_utf8
        b'{"text": "lone \\ud800 surrogate"}',  # invalid_utf8 (a lone surrogate is not text)
        GOOD[2].encode(),
        "\ufeff".encode() + GOOD[0].encode(),  # a BOM mid-file: bad_json
    ]) + b"\n"


# name: (bytes, {policy: expected counts or the error's required substrings})
HOSTILE = {
    "huge_line.jsonl": (lambda: ("\n".join([GOOD[0], json.dumps({"text": "word " * 1_000_000}), GOOD[1]]) + "\n").encode(),
                        {"skip": {"records": 3, "valid": 3, "skipped": {}}, "fail": {"records": 3, "valid": 3, "skipped": {}}}),
    "binary.jsonl": (_binary, {"skip": {"records": 10, "valid": 0, "skipped": {"invalid_utf8": 10}},
                               "fail": ("line 1", "invalid UTF-8", "on_invalid: skip")}),
    "truncated.jsonl.gz": (_truncated_gz, {"skip": "read up to the damage",
                                           "fail": ("truncated or corrupt", "gzip", "re-download", "on_invalid: skip")}),
    "mixed_encodings.jsonl": (_mixed, {"skip": {"records": 7, "valid": 3, "skipped": {"bad_json": 1, "invalid_utf8": 3}},
                                       "fail": ("line 2", "invalid UTF-8", "0xe9")}),
    "array.jsonl": (lambda: json.dumps([{"text": "a"}, {"text": "b"}, {"text": "c"}]).encode() + b"\n",
                    {"skip": {"records": 1, "valid": 0, "skipped": {"not_object": 1}},
                     "fail": ("line 1", "expected a JSON object, got an array")}),
    "empty.jsonl": (lambda: b"", {"skip": {"records": 0, "valid": 0, "skipped": {}}, "fail": {"records": 0, "valid": 0, "skipped": {}}}),
    "no_spaces_1mb.jsonl": (lambda: json.dumps({"text": "x" * 1_000_000}).encode() + b"\n",
                            {"skip": {"records": 1, "valid": 1, "skipped": {}}, "fail": {"records": 1, "valid": 1, "skipped": {}}}),
}


def write_hostile(root: Path) -> dict[str, str]:
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, (make, _) in HOSTILE.items():
        (root / name).write_bytes(make())
        out[name] = str(root / name)
    return out


@pytest.mark.reliability("hostile data shards")
@pytest.mark.parametrize("policy", ["skip", "fail"])
@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_shard_is_handled_per_policy(tmp_path, note, name, policy):
    url = write_hostile(tmp_path)[name]
    expected = HOSTILE[name][1][policy]
    cfg = load_config(None, {"data.train_urls": [url], "data.on_invalid": policy})
    shards = resolve_shards(cfg.data, "train")
    if isinstance(expected, tuple):
        with pytest.raises(DataValidationError) as err:
            scan_shards(shards)
        msg = str(err.value)
        assert msg.startswith(url), msg
        for needle in expected:
            assert needle in msg, msg
        note(f"on_invalid {policy}: DataValidationError '<file>{msg[len(url):][:160]}'",
             lost="nothing: the run stops before any artifact is written")
        return
    (report,) = scan_shards(shards).values()
    if expected == "read up to the damage":  # a corrupt stream under skip: what came before it is kept
        texts = list(shards[0].iter_texts())
        whole = _whole_gz_texts()
        assert report.damaged and "truncated or corrupt" in report.damaged and "before the damage are kept" in report.damaged
        assert 0 < report.valid == len(texts) < len(whole) and texts == whole[: len(texts)]
        assert report.records == report.valid + report.invalid and set(report.skipped) <= {"bad_json"}
        note(f"on_invalid skip: the first {report.valid} of {len(whole)} records kept, the damaged rest unread and "
             "the shard marked damaged", lost="the unreadable rest of the file, reported as such")
        return
    got = {k: v for k, v in report.to_dict().items() if k in expected}
    assert got == expected and report.complete
    dropped = sum(got["skipped"].values())
    note(f"on_invalid {policy}: {got['records']} records, {got['valid']} valid, skipped {got['skipped'] or 'none'}",
         lost=f"nothing unaccounted ({dropped} invalid records dropped by the policy and counted)" if dropped else "nothing")


@pytest.mark.faults
@pytest.mark.timeout(300)
@pytest.mark.reliability("hostile data shards")
def test_hostile_corpus_through_tokenizer_and_cache(tmp_path, note):
    """Everything the skip policy accepts goes through BPE training and the token cache: exact
    document counts, the 1 MB word and the 5 MB line intact (their UTF-8 byte counts)."""
    from lm_pipeline.data.cache import open_cache
    from lm_pipeline.steps import Pipeline

    urls = write_hostile(tmp_path / "data")
    train = [u for n, u in urls.items() if n != "truncated.jsonl.gz"]
    cfg = load_config(None, {"data.train_urls": train, "data.validation_urls": [urls["huge_line.jsonl"]],
                             "data.on_invalid": "skip", "data.num_workers": 1, "data.shard_group_size": 2,
                             "data.tokenizer.vocab_size": 300, "store.root": str(tmp_path / "store")})
    pipe = Pipeline(cfg, progress=False)
    raw = pipe.raw_shards().manifest["summary"]
    assert (raw["records"], raw["valid"], raw["skipped"]) == (22 + 3, 7 + 3, 15)
    cache = pipe.token_cache()
    train_cache = open_cache(f"{cache.path}/train")
    assert train_cache.num_docs == 7
    assert sorted(train_cache.doc_bytes.tolist())[-2:] == [1_000_000, 5_000_000]
    assert 1_000_000 in train_cache.doc_bytes.tolist()
    note(f"6 shards (+1 validation) under on_invalid skip: {raw['records']} records, {raw['valid']} valid, "
         f"{raw['skipped']} skipped and counted; cache holds exactly the 7 valid training documents, "
         "including the 5 MB line and the 1 MB word byte-exact",
         lost=f"nothing unaccounted ({raw['skipped']} invalid records dropped by the policy and counted)")
