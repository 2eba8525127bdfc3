"""Tokenizers: deterministic byte-level BPE, HF layout, transformers interop, info detection."""

from __future__ import annotations

import json
import os

import pytest

from lm_pipeline.data.config import TokenizerConfig
from lm_pipeline.data.tokenizer import (
    TokenizerError,
    build_tokenizer,
    load_hf_tokenizer,
    load_tokenizer,
    tokenizer_info,
    train_bpe,
)
from lm_pipeline.schema import ConfigError, from_dict

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SAMPLE = "def add(a, b):\n    return a + b  # héllo wörld ✓<|endoftext|>"


def _corpus() -> list[str]:
    import difflib
    import inspect
    import textwrap

    return [inspect.getsource(m) for m in (difflib, textwrap, json.decoder, json.encoder)]


CFG = TokenizerConfig(vocab_size=400, min_frequency=2, special_tokens=("<|endoftext|>", "<|pad|>"))


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("bpe")
    train_bpe(_corpus(), CFG, out)
    return str(out)


def _read(d: str) -> dict[str, bytes]:
    return {f: open(os.path.join(d, f), "rb").read() for f in FILES}


def test_bpe_is_byte_identical_when_retrained(tmp_path, bpe_dir):
    info = train_bpe(iter(_corpus()), CFG, tmp_path / "again", length=4, progress=False)
    assert _read(str(tmp_path / "again")) == _read(bpe_dir)
    assert info.vocab_size == 400
    train_bpe(_corpus(), CFG, tmp_path / "checked", check_determinism=True)
    with pytest.raises(ValueError, match="re-iterable"):
        train_bpe(iter(_corpus()), CFG, tmp_path / "x", check_determinism=True)


def test_bpe_info_and_round_trip(bpe_dir):
    info = tokenizer_info(bpe_dir)
    tok = load_tokenizer(bpe_dir)
    assert (info.eos_token, info.eos_id, info.bos_id, info.pad_id) == ("<|endoftext|>", 0, 0, 0)
    assert not info.adds_bos and not info.adds_eos
    assert tok.token_to_id("<|pad|>") == 1
    ids = tok.encode(SAMPLE).ids
    assert tok.decode(ids, skip_special_tokens=False) == SAMPLE
    assert ids[-1] == 0  # the special token is matched as one token
    conf = json.loads(open(os.path.join(bpe_dir, "tokenizer_config.json")).read())
    smap = json.loads(open(os.path.join(bpe_dir, "special_tokens_map.json")).read())
    assert conf["eos_token"] == smap["eos_token"] == "<|endoftext|>" and smap[
        "additional_special_tokens"
    ] == ["<|pad|>"]


def test_max_train_chars_caps_the_stream(tmp_path):
    cfg = TokenizerConfig(vocab_size=300, max_train_chars=5000)
    a = train_bpe(_corpus(), cfg, tmp_path / "a")
    b = train_bpe([_corpus()[0][:5000]], cfg, tmp_path / "b")
    assert a.fingerprint == b.fingerprint


def test_transformers_autotokenizer_matches(bpe_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(bpe_dir)
    tok = load_tokenizer(bpe_dir)
    assert hf.is_fast and hf.eos_token == "<|endoftext|>" and hf.eos_token_id == 0 and hf.pad_token_id == 0
    for text in (SAMPLE, "  leading spaces\n\ttabs", "日本語のテキスト"):
        assert hf(text)["input_ids"] == tok.encode(text).ids
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False).ids
    # a tokenizer that adds BOS itself: detected, copied byte for byte, and honoured by transformers
    from tokenizers import processors

    src = tmp_path / "src"
    src.mkdir()
    tok.post_processor = processors.TemplateProcessing(single="<|pad|> $A", special_tokens=[("<|pad|>", 1)])
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<|pad|>",
                "eos_token": {"content": "<|endoftext|>", "special": True},
            }
        )
    )
    info = load_hf_tokenizer(str(src), tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert (
        info.adds_bos and info.bos_id == 1 and info.eos_id == 0 and info.pad_id is None and not info.adds_eos
    )
    hf2 = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert hf2(SAMPLE)["input_ids"] == load_tokenizer(tmp_path / "out").encode(SAMPLE).ids
    assert hf2(SAMPLE)["input_ids"][0] == 1 and hf2.eos_token == "<|endoftext|>"


def test_load_hf_tokenizer_eos_rules(bpe_dir, tmp_path):
    src = tmp_path / "noeos"
    src.mkdir()
    (src / "tokenizer.json").write_bytes(open(os.path.join(bpe_dir, "tokenizer.json"), "rb").read())
    with pytest.raises(TokenizerError, match="set data.tokenizer.eos_token"):
        load_hf_tokenizer(str(src), tmp_path / "o1")
    with pytest.raises(TokenizerError, match="not in the tokenizer's vocabulary"):
        load_hf_tokenizer(str(src), tmp_path / "o2", eos_token="</s>")
    cfg = from_dict(TokenizerConfig, {"kind": "hf", "name_or_path": str(src), "eos_token": "<|pad|>"})
    info = build_tokenizer(cfg, tmp_path / "o3")
    assert info.eos_id == 1 and info.bos_id is None and sorted(os.listdir(tmp_path / "o3")) == sorted(FILES)


def test_tokenizer_config_validation():
    with pytest.raises(ConfigError, match="name_or_path"):
        from_dict(TokenizerConfig, {"kind": "hf"})
    with pytest.raises(ConfigError, match="at least 257"):
        from_dict(TokenizerConfig, {"vocab_size": 100})
    with pytest.raises(ConfigError, match="duplicates"):
        from_dict(TokenizerConfig, {"special_tokens": ["<a>", "<a>"]})
