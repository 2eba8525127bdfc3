"""Levanter's mixture configs as written: component names with '/' (``paloma/4chan``), components
with validation sets only (weight 0), a component's ``tags``, ``format: {type: ...}`` and
``data.vocab_size``."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import yaml
from helpers.mixture import write_mixture
from tokenizers import Tokenizer

from lm_pipeline.config import load_config
from lm_pipeline.data.cache import open_cache
from lm_pipeline.data.component_names import asset_segment, name_problems, parse_split_key, split_key
from lm_pipeline.data.sources import iter_shard_texts
from lm_pipeline.schema import ConfigError
from lm_pipeline.steps import Pipeline

GOOD = ["web", "paloma/4chan", "dolma/cc-news", "a/b/c", "c4.en", "0x"]
BAD = ["/x", "x/", "a//b", "-x", "a/-b", "a/.b", "..", "a/../b", "", "a b", "a:b", "a\\b"]


@pytest.mark.parametrize("name", GOOD)
def test_good_component_names_give_their_keys(name):
    assert name_problems([name]) == []
    key = split_key(name, "validation")
    assert key == name + "/validation" and parse_split_key(key) == (name, "validation")
    segment = asset_segment(name)
    assert segment == "".join(c if c.isalnum() or c == "_" else "_" for c in name)


@pytest.mark.parametrize("name", BAD)
def test_bad_component_names_are_refused(name):
    assert [n for n, _ in name_problems([name])] == [name]


def test_names_that_would_share_an_asset_key_are_refused():
    found = name_problems(["dolma/cc-news", "dolma_cc_news", "web", "dolma.cc.news"])
    assert [n for n, _ in found] == ["dolma_cc_news", "dolma.cc.news"]
    assert all("'dolma/cc-news'" in problem for _, problem in found)


def levanter_mixture(tmp_path):
    """The tiny mixture with books renamed ``paloma/books`` and kept for evaluation only (weight
    0, its file as validation data), and Levanter's ``tags`` on each component."""
    mix = write_mixture(tmp_path, {"web": 0.5, "code": 0.5})
    raw = yaml.safe_load(mix.read_text(encoding="utf-8"))
    configs = raw["data"]["configs"]
    books = configs.pop("books")["train_urls"]
    configs["paloma/books"] = {"validation_urls": books, "tags": ["paloma"]}
    configs["web"]["tags"] = []
    raw["data"]["train_weights"]["paloma/books"] = 0.0
    raw["data"]["vocab_size"] = None
    mix.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return mix


def test_a_component_named_with_a_slash_evaluates_without_training(tmp_path, caplog):
    from lm_pipeline import levanter
    from lm_pipeline.data.mixture import mixture_source
    from lm_pipeline.steps.mixture import open_component_datasets, train_caches

    levanter._NOTED.clear()
    mix = levanter_mixture(tmp_path)
    with caplog.at_level(logging.INFO, logger="lm_pipeline.config"):
        cfg = load_config(mix)
    said = [r.getMessage() for r in caplog.records if "data.configs.<name>.tags" in r.getMessage()]
    assert len(said) == 1 and "has no effect here" in said[0]  # once for both components

    pipe = Pipeline(cfg, progress=False)
    cache = pipe.token_cache()
    assert set(cache.manifest["summary"]["splits"]) == {"web/train", "web/validation", "code/train",
                                                        "paloma/books/validation"}
    train, evals = open_component_datasets(cfg, cache)
    assert set(train) == {"web", "code"} and set(evals) == {"web/validation", "paloma/books/validation"}
    assert len(train_caches(cache)) == 2  # the unigram baseline reads training rows only

    # the evaluation set holds the books file, tokenized by the tokenizer itself, each record + EOS
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer" / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    shards = pipe.components()["paloma/books"].shards()
    assert list(shards) == ["validation"]
    expected = [t for text in iter_shard_texts(shards["validation"]) for t in [*tok.encode(text).ids, eos]]
    path = cache.manifest["components"]["paloma/books"]["path"]
    val = open_cache(f"{path}/validation")
    assert val.read_tokens(0, val.num_tokens).tolist() == expected

    # training draws from the weighted components only, half each per block
    source = mixture_source(cfg.data, train, 8, cfg.trainer.seed, process_index=0, process_count=1)
    assert source.names == ("web", "code")
    comps = np.concatenate([source.global_rows(k)[0] for k in range(4)])
    assert np.bincount(comps, minlength=2).tolist() == [16, 16]


def test_tags_enter_no_fingerprint_and_the_cli_reaches_a_slashed_component(tmp_path):
    mix = levanter_mixture(tmp_path)
    raw = yaml.safe_load(mix.read_text(encoding="utf-8"))
    for comp in raw["data"]["configs"].values():
        comp.pop("tags", None)
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    tagged, untagged = Pipeline(load_config(mix), progress=False), Pipeline(load_config(plain), progress=False)
    for stage in ("raw_shards", "token_cache", "train_ckpt"):
        assert tagged.config_version(stage) == untagged.config_version(stage), stage
    other = load_config(mix, ["--data.configs.paloma/books.validation_urls", '["v.jsonl"]'])
    assert other.data.configs["paloma/books"].validation_urls == ("v.jsonl",)
    raw["data"]["configs"]["c4.en"] = raw["data"]["configs"].pop("code")
    raw["data"]["train_weights"]["c4.en"] = raw["data"]["train_weights"].pop("code")
    plain.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    dotted = load_config(plain, ["--data.configs.c4.en.train_urls", '["c.jsonl"]']).data.configs
    assert list(dotted) == ["web", "paloma/books", "c4.en"] and dotted["c4.en"].train_urls == ("c.jsonl",)


def test_levanter_formats_and_vocab_size(tmp_path):
    base = {"data.configs": {"t": {"train_urls": ["a.jsonl"], "format": {"type": "text", "text_key": "body"}}},
            "data.train_weights": {"t": 1}}
    assert load_config(None, base).data.configs["t"].text_key == "body"
    chat = {**base, "data.configs": {"t": {"id": "org/chat", "format": {"type": "chat"}}}}
    with pytest.raises(ConfigError) as info:  # chat is trained (test_chat_format.py); a BPE has no template
        load_config(None, chat)
    assert str(info.value).startswith("config field 'data.configs.t.chat.chat_template': is needed")
    assert "\n" not in str(info.value)
    supervised = {**base, "data.configs": {"t": {"id": "org/sft", "format": {"type": "supervised"}}}}
    with pytest.raises(ConfigError) as info:
        load_config(None, supervised)
    assert str(info.value).startswith("config field 'data.configs.t.format': Levanter's `format: {type: supervised}`")
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"'data\.vocab_size': Levanter's `data\.vocab_size`"):
        load_config(None, {**base, "data.vocab_size": 50257})


@pytest.mark.filterwarnings("ignore::dagster.BetaWarning")
def test_a_slashed_component_has_its_dagster_assets(tmp_path):
    from assets.experiment import load_experiments
    from assets.pipeline import build_definitions

    folder = tmp_path / "experiments"
    folder.mkdir()
    (folder / "default.yaml").write_text(levanter_mixture(tmp_path).read_text(encoding="utf-8"), encoding="utf-8")
    graph = build_definitions(load_experiments(folder)).resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    for name in ("web", "code", "paloma_books"):
        assert {f"components/{name}/data_sources", f"components/{name}/token_cache"} <= keys, name
    assert not any("paloma/books" in k for k in keys)
