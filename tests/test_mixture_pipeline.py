"""Data mixtures through the pipeline: one token cache per component, shared and rebuilt alone;
a mixed run that resumes bitwise.

References: a single-source experiment over a component's files (the pipeline's ordinary token
cache, whose address and bytes a component's cache must have), the tokenizer run by
``tokenizers`` itself over the component's records, and an uninterrupted run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers.mixture import COMPONENTS, write_mixture
from helpers.resume import assert_resumed_to, crash_after_step

from lm_pipeline.batch import ArrayDataset
from lm_pipeline.config import load_config
from lm_pipeline.data.cache import open_cache
from lm_pipeline.data.sources import iter_shard_texts
from lm_pipeline.data.validation import DataValidationError
from lm_pipeline.schema import ConfigError
from lm_pipeline.steps import Pipeline
from lm_pipeline.train.run import train


def single_source(tmp: Path, mix: Path, component: str) -> Pipeline:
    """The experiment that trains on one component's files alone, everything else the same."""
    raw = yaml.safe_load(mix.read_text(encoding="utf-8"))
    comp = raw["data"].pop("configs")[component]
    for key in ("train_weights", "mixture_block_size"):
        raw["data"].pop(key)
    raw["data"].update(comp)
    path = tmp / f"single-{component}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return Pipeline(load_config(path), progress=False)


def plan_status(pipe: Pipeline) -> dict[str, bool]:
    return {row["stage"]: row["hit"] for row in pipe.plan()}


def test_each_source_is_cached_once_shared_and_rebuilt_alone(tmp_path):
    mix = write_mixture(tmp_path, {"web": 0.8, "code": 0.2})
    pipe = Pipeline(load_config(mix), progress=False)
    built = pipe.token_cache()
    index = built.manifest["components"]
    assert list(index) == list(COMPONENTS)

    # each component's cache is the token cache a single-source experiment over its files has
    for name in COMPONENTS:
        alone = single_source(tmp_path, mix, name)
        assert index[name]["fingerprint"] == alone.address("token_cache").fingerprint, name
        assert plan_status(alone)["token_cache"], f"{name}: the single-source experiment's cache is a hit"

    # and holds that source's records, tokenized by the tokenizer itself, each ending with EOS
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "tokenizer" / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    books = pipe.components()["books"].shards()["train"]
    expected = [t for text in iter_shard_texts(books) for t in [*tok.encode(text).ids, eos]]
    cache = open_cache(f"{index['books']['path']}/train")
    assert cache.read_tokens(0, cache.num_tokens).tolist() == expected

    # its lineage follows each component's cache back to that component's own raw shards
    from lm_pipeline.steps.lineage import lineage

    chain = {(step["stage"], step["fingerprint"]): step for step in lineage(pipe.store, "token_cache", built.fingerprint)}
    for name in COMPONENTS:
        sub = pipe.components()[name]
        step = chain[("token_cache", index[name]["fingerprint"])]
        assert step["read_by"] == [f"token_cache/{built.fingerprint}"]
        assert step["upstream"]["raw_shards"] == sub.address("raw_shards").fingerprint
        assert ("raw_shards", sub.address("raw_shards").fingerprint) in chain

    # another experiment mixing the same sources at other weights builds no cache
    other = Pipeline(load_config(write_mixture(tmp_path, [[0, {"web": 1}], [2, {"code": 1, "books": 3}]],
                                               "other.yaml")), progress=False)
    status = plan_status(other)
    assert all(status[f"{stage}[{c}]"] for c in COMPONENTS for stage in ("raw_shards", "token_cache"))
    assert status["token_cache"] and not status["train_ckpt"]

    # one source's file edited: its cache and the mixture's index rebuild, the others are hits
    stamps = {n: (Path(index[n]["path"]) / "manifest.json").stat().st_mtime_ns for n in COMPONENTS}
    books_file = Path(pipe.cfg.data.configs["books"].train_urls[0])
    with books_file.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "def appended():\n    return 1\n"}) + "\n")
    edited = Pipeline(load_config(mix), progress=False)
    status = plan_status(edited)
    assert {s for s, hit in status.items() if not hit} == {
        "raw_shards", "raw_shards[books]", "token_cache[books]", "token_cache", "train_ckpt", "eval_report",
        "hf_export"}
    cli = subprocess.run([sys.executable, "-m", "lm_pipeline.cli", "plan", "--config_path", str(mix)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr
    said = {line.split()[1]: line.split()[0] == "hit" for line in cli.stdout.splitlines()
            if line.split() and line.split()[0] in ("hit", "MISS")}
    assert said == status
    rebuilt = edited.token_cache().manifest["components"]
    assert [n for n in COMPONENTS if rebuilt[n]["fingerprint"] != index[n]["fingerprint"]] == ["books"]
    assert [n for n in COMPONENTS if rebuilt[n]["hit"]] == ["web", "code"]
    for name in ("web", "code"):
        assert (Path(rebuilt[name]["path"]) / "manifest.json").stat().st_mtime_ns == stamps[name]


def test_a_bpe_trained_here_is_trained_on_every_component(tmp_path):
    mix = write_mixture(tmp_path, {"web": 1, "code": 1}, tokenizer={"kind": "bpe", "vocab_size": 300})
    pipe = Pipeline(load_config(mix), progress=False)
    assert set(pipe.address("tokenizer").inputs) == {"raw_shards"}  # the mixture's: every component's shards
    books_file = Path(pipe.cfg.data.configs["books"].train_urls[0])  # weight 0, still in the tokenizer's text
    fp = pipe.address("tokenizer").fingerprint
    with books_file.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "x = 1\n"}) + "\n")
    assert Pipeline(load_config(mix), progress=False).address("tokenizer").fingerprint != fp


# --- training: resume --------------------------------------------------------------------------

CFG = {
    "model.type": "gpt2", "model.seq_len": 16, "model.hidden_dim": 16, "model.num_heads": 2, "model.num_layers": 2,
    "model.gradient_checkpointing": False, "trainer.mp": "f32", "trainer.train_batch_size": 4,
    "trainer.num_train_steps": 9, "trainer.progress": False, "trainer.steps_per_eval": 1000,
    "trainer.checkpointer.keep": [{"every": 4}], "trainer.id": "mixed", "optimizer.learning_rate": 1e-2,
    "optimizer.warmup": 0,
    "data.configs": {"a": {"train_urls": ["a.jsonl"]}, "b": {"train_urls": ["b.jsonl"]}},
    "data.train_weights": [[0, {"a": 3, "b": 1}], [5, {"a": 1, "b": 1}]], "data.mixture_block_size": 8,
}


class Recording(ArrayDataset):
    def __init__(self, seed: int, rows: int):
        super().__init__(np.random.default_rng(seed).integers(0, 50, rows * 16), 16)
        self.reads: list[list[int]] = []

    def get_many(self, indices):
        self.reads.append([int(i) for i in indices])
        return super().get_many(indices)


def components() -> dict[str, Recording]:
    return {"a": Recording(0, 13), "b": Recording(1, 7)}  # both wrap within 9 steps of 4 rows


@pytest.mark.slow
def test_an_interrupted_mixed_run_resumes_to_the_uninterrupted_parameters(tmp_path, monkeypatch):
    cfg = load_config(None, CFG)
    clean = train(cfg, train_data=components(), vocab_size=50, run_dir=str(tmp_path / "clean"))
    assert clean.final_step == 9
    run_dir = str(tmp_path / "cut")
    cut = crash_after_step(monkeypatch, 6, lambda: train(cfg, train_data=components(), vocab_size=50, run_dir=run_dir),
                           run_dir)  # past the phase change at 5
    assert cut.endswith("step-4")
    resumed = train(cfg, train_data=components(), vocab_size=50, run_dir=run_dir)
    assert resumed.resumed_from.endswith("step-4") and resumed.final_step == 9
    assert_resumed_to(clean.state, resumed.state, run_dir, "step-4")


@pytest.mark.slow
def test_the_run_ends_where_the_stop_strategy_says(tmp_path):
    """first_exhausted: the first step that would need a row a component does not have is never
    run. Reference: walking the rows the restart run reads, component by component."""
    from lm_pipeline.data.mixture import mixture_source

    cfg = load_config(None, {**CFG, "trainer.num_train_steps": 50, "data.stop_strategy": "first_exhausted"})
    sizes = {"a": 13, "b": 7}
    restart = mixture_source(load_config(None, CFG).data, components(), 4, cfg.trainer.seed, process_index=0,
                             process_count=1)
    seen = {"a": 0, "b": 0}
    step = 0
    while True:
        comp, _ = restart.global_rows(step)
        counts = {n: int((comp == restart.names.index(n)).sum()) for n in seen}
        if any(seen[n] + counts[n] > sizes[n] for n in seen):
            break
        seen = {n: seen[n] + counts[n] for n in seen}
        step += 1
    res = train(cfg, train_data=components(), vocab_size=50, run_dir=str(tmp_path / "run"))
    assert res.final_step == step and 0 < step < 50


def test_a_weighted_component_without_training_data_is_refused_before_any_work(tmp_path):
    mix = write_mixture(tmp_path, {"web": 1, "books": 1})
    raw = yaml.safe_load(mix.read_text(encoding="utf-8"))
    raw["data"]["configs"]["books"] = {"validation_urls": raw["data"]["configs"]["books"].pop("train_urls")}
    mix.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"data\.configs\.books.*has a weight in train_weights but no training data"):
        load_config(mix)
    assert not (tmp_path / "store").exists()


def test_a_mixture_run_length_in_epochs_is_refused_when_the_config_loads(tmp_path):
    mix = write_mixture(tmp_path, {"web": 1})
    with pytest.raises(ConfigError) as info:
        load_config(mix, ["--trainer.num_train_steps", "null", "--trainer.num_epochs", "2", "--trainer.max_epochs", "3"])
    found = {p.path for p in getattr(info.value, "problems", (info.value,))}
    assert found == {"trainer.num_epochs", "trainer.max_epochs"}


def test_a_components_data_problem_names_the_components_field(tmp_path):
    mix = write_mixture(tmp_path, {"web": 1, "books": 1})
    raw = yaml.safe_load(mix.read_text(encoding="utf-8"))
    books = tmp_path / "books-untexted.jsonl"
    books.write_text(json.dumps({"content": "no text key"}) + "\n", encoding="utf-8")
    raw["data"]["configs"]["books"] = {"train_urls": [str(books)], "on_invalid": "skip"}
    mix.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    with pytest.raises(DataValidationError) as info:
        Pipeline(load_config(mix), progress=False).token_cache()
    assert info.value.source == "data.configs.books.train_urls"
    assert "point data.configs.books.train_urls at data" in str(info.value)


def test_a_library_run_id_names_the_mixture_as_the_pipeline_does():
    """``train()`` without an id names its run by the mixture's draw too: two mixtures of the same
    data that differ in weights, stop strategy, block size or component order get different ids
    (else the second would resume the first's checkpoints); a single-source config keeps its id
    (no mixture key), and the pipeline's train_ckpt config carries the same draw."""
    from lm_pipeline.train.run import run_id_for

    def cfg(**over):
        return load_config(None, {**CFG, "trainer.id": None, **over})

    base = cfg()
    variants = [cfg(**{"data.train_weights": {"a": 1, "b": 1}}), cfg(**{"data.stop_strategy": "first_exhausted"}),
                cfg(**{"data.mixture_block_size": 16}),
                cfg(**{"data.configs": {"b": {"train_urls": ["b.jsonl"]}, "a": {"train_urls": ["a.jsonl"]}}})]
    ids = {run_id_for(c, "same-data") for c in [base, *variants]}
    assert len(ids) == 1 + len(variants)
    assert run_id_for(cfg(), "same-data") == run_id_for(base, "same-data")
    single = {k: v for k, v in CFG.items() if not k.startswith("data.")}
    plain = load_config(None, {**single, "trainer.id": None})
    from lm_pipeline.train.run_identity import run_semantics

    assert "mixture" not in run_semantics(plain)
    # the draw fields that are set (stop_strategy at its default is not, so existing ids stay)
    assert run_semantics(base)["mixture"] == {"components": ["a", "b"], "train_weights": CFG["data.train_weights"],
                                              "mixture_block_size": 8}
