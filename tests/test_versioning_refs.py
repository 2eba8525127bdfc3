"""Content addressing, versions and staleness against references written down here.

Each test states what an edit must change (an artifact's address, a stage's config version, a
Dagster code version or data version, what the plan reports) and what it must leave alone, as
sets and values the test writes itself; the edits are made to a tiny config over a corpus of a
few JSONL lines, and nothing is trained: addresses are computed, and artifacts are committed
by trivial writers where a test needs some in the store.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from lm_pipeline.config import load_config
from lm_pipeline.fingerprint import canonical_json, hash_json
from lm_pipeline.steps import Pipeline, diff_fields

#: The stages of an experiment without downstream tasks, in table order.
LINEAGE = ("raw_shards", "tokenizer", "token_cache", "train_ckpt", "eval_report", "hf_export")
#: Every stage that reads raw_shards' artifact when the tokenizer is given (not trained here).
ALL_BUT_TOKENIZER = {"raw_shards", "token_cache", "train_ckpt", "eval_report", "hf_export"}

CORPUS = {
    "train-0.jsonl": ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n"],
    "train-1.jsonl": ["for i in range(10):\n    print(i * i)\n", "import os\nprint(os.getcwd())\n"],
    "validation.jsonl": ["while True:\n    break\n"],
    "extra.jsonl": ["x = [n for n in range(3)]\n", "y = {k: k for k in 'ab'}\n"],
}


def _write_corpus(root: Path) -> dict[str, str]:
    root.mkdir(parents=True, exist_ok=True)
    for name, texts in CORPUS.items():
        (root / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return {name: str(root / name) for name in CORPUS}


@pytest.fixture
def corpus(tmp_path) -> dict[str, str]:
    return _write_corpus(tmp_path / "data")


def _base(tmp_path: Path, files: dict[str, str]) -> dict[str, Any]:
    return {
        "data.train_urls": [files["train-0.jsonl"], files["train-1.jsonl"]],
        "data.validation_urls": [files["validation.jsonl"]],
        "data.tokenizer.kind": "bpe", "data.tokenizer.vocab_size": 300,
        "model.type": "gpt2", "model.seq_len": 32, "model.hidden_dim": 32, "model.num_heads": 2,
        "model.num_layers": 1, "trainer.num_train_steps": 6, "trainer.train_batch_size": 4,
        "optimizer.learning_rate": 1.0e-3, "store.root": str(tmp_path / "store"),
    }


def _mixture(tmp_path: Path, files: dict[str, str], **web: Any) -> dict[str, Any]:
    """One component ``web`` over the training and validation files (``web``: its extra fields)."""
    return {**_base(tmp_path, files), "data.train_urls": [], "data.validation_urls": [],
            "data.configs": {"web": {"train_urls": [files["train-0.jsonl"], files["train-1.jsonl"]],
                                     "validation_urls": [files["validation.jsonl"]], **web}},
            "data.train_weights": {"web": 1.0}}


def _two_sources(tmp_path: Path, files: dict[str, str], **code: Any) -> dict[str, Any]:
    """A mixture of ``web`` (the training files) and ``code`` (``extra.jsonl``; ``code``: its extra fields)."""
    raw = _mixture(tmp_path, files)
    raw["data.configs"] = {**raw["data.configs"], "code": {"train_urls": [files["extra.jsonl"]], **code}}
    raw["data.train_weights"] = {"web": 0.5, "code": 0.5}
    return raw


def _pipe(raw: dict[str, Any], **kw: Any) -> Pipeline:
    return Pipeline(load_config(None, raw), progress=False, **kw)


def _addresses(pipe: Pipeline) -> dict[str, str]:
    return {s: pipe.address(s).fingerprint for s in pipe.stages}


def _changed(a: dict[str, str], b: dict[str, str]) -> set[str]:
    assert set(a) == set(b)
    return {k for k in a if a[k] != b[k]}


def _writer(calls: list[str], payload: str = "payload", **extra: Any):
    """A stage writer that records where it was asked to write and writes one file there
    (``extra``: what it adds to the manifest)."""

    def write(path: str):
        calls.append(path)
        Path(path).mkdir(parents=True, exist_ok=True)
        Path(path, "payload.txt").write_text(payload, encoding="utf-8")
        return {"written": payload}, dict(extra)

    return write


# -- the hash itself ------------------------------------------------------------------------------


def test_non_finite_floats_hash_apart_from_each_other_and_from_null():
    """inf, -inf and nan are different settings (a disabled clip vs no value): they hash apart,
    and apart from null and from a large finite number; the canonical text stays strict JSON."""
    values = [math.inf, -math.inf, math.nan, None, 1e308, 0.0]
    hashes = [hash_json({"x": v}) for v in values]
    assert len(set(hashes)) == len(values), dict(zip(map(repr, values), hashes, strict=True))

    def refuse(name: str):
        raise AssertionError(f"non-standard JSON constant {name} in the canonical text")

    for v in values:
        json.loads(canonical_json({"x": v}), parse_constant=refuse)
    # nested the same way: inside lists and mappings
    assert hash_json({"a": [math.inf]}) != hash_json({"a": [None]})
    assert hash_json({"a": {"b": math.nan}}) != hash_json({"a": {"b": None}})


def test_diff_fields_lists_keys_added_removed_and_changed():
    """A key present on one side only is a difference too (a stage config losing a section)."""
    old = {"config": {"keep": 1, "gone": {"deep": 2}, "same": "x"}, "code_version": 1}
    new = {"config": {"keep": 3, "added": True, "same": "x"}, "code_version": 1}
    lines = diff_fields(old, new)
    keys = sorted(line.split(":", 1)[0] for line in lines)
    assert keys == ["config.added", "config.gone.deep", "config.keep"]
    by_key = {line.split(":", 1)[0]: line for line in lines}
    assert by_key["config.keep"] == "config.keep: 1 -> 3"
    assert "2" in by_key["config.gone.deep"]
    assert "true" in by_key["config.added"]
    assert diff_fields(old, old) == []


# -- which stages an edit re-versions -------------------------------------------------------------


def test_a_given_tokenizer_is_versioned_without_the_shards_config(tmp_path, corpus):
    """A hub tokenizer reads no shards: a data edit re-addresses and re-versions every stage but
    the tokenizer, and the config versions (Dagster's code versions) flag exactly what the
    addresses do. A BPE trained here is re-versioned by the same edit."""
    hub = {**_base(tmp_path, corpus), "data.tokenizer.kind": "hf",
           "data.tokenizer.name_or_path": "some-org/some-tokenizer"}
    for tokenizer, expected in ((hub, ALL_BUT_TOKENIZER), (_base(tmp_path, corpus), set(LINEAGE))):
        before, after = _pipe(tokenizer), _pipe({**tokenizer, "data.min_length": 5})
        assert _changed(_addresses(before), _addresses(after)) == expected
        assert _changed(before.config_versions(), after.config_versions()) == expected
    # the hub tokenizer's own revision: the tokenizer and what reads it, not the shards
    before, after = _pipe(hub), _pipe({**hub, "data.tokenizer.revision": "v2"})
    expected = set(LINEAGE) - {"raw_shards"}
    assert _changed(_addresses(before), _addresses(after)) == expected
    assert _changed(before.config_versions(), after.config_versions()) == expected


def test_a_mixture_components_cache_dir_moves_no_address(tmp_path, corpus):
    """Where a component's caches are kept is no part of any address or version (the mixture's
    nor the component's); a component's semantic field re-addresses every stage."""
    base = _pipe(_mixture(tmp_path, corpus))
    moved = _pipe(_mixture(tmp_path, corpus, cache_dir=str(tmp_path / "elsewhere")))
    assert _changed(_addresses(base), _addresses(moved)) == set()
    assert _changed(base.config_versions(), moved.config_versions()) == set()
    for own in ("raw_shards", "token_cache"):
        assert moved.components()["web"].address(own).fingerprint == base.components()["web"].address(own).fingerprint
        assert moved.components()["web"].config_version(own) == base.components()["web"].config_version(own)
    # the component's caches are kept where it says, at the same address
    fp = moved.components()["web"].address("token_cache").fingerprint
    assert moved.components()["web"].store.artifact("token_cache", fp).path == f"{tmp_path / 'elsewhere'}/{fp}"
    # a semantic field of the component: the BPE (trained on its text) and everything re-addressed
    stricter = _pipe(_mixture(tmp_path, corpus, min_length=5))
    assert _changed(_addresses(base), _addresses(stricter)) == set(LINEAGE)
    assert _changed(base.config_versions(), stricter.config_versions()) == set(LINEAGE)


def test_editing_one_source_of_a_mixture_re_versions_what_reads_it(tmp_path, corpus):
    """A BPE trained here is trained on every component's text: editing the ``code`` source
    changes the tokenizer, so the other component's cache (same shards, new tokenizer) is
    re-addressed and re-versioned, its shards are not; the addresses and the config versions
    (the component assets' code versions) agree."""
    base = _pipe(_two_sources(tmp_path, corpus))
    edited = _pipe(_two_sources(tmp_path, corpus, min_length=5))
    assert _changed(_addresses(base), _addresses(edited)) == set(LINEAGE)
    assert _changed(base.config_versions(), edited.config_versions()) == set(LINEAGE)
    expected = {"web": {"token_cache"}, "code": {"raw_shards", "token_cache"}}
    for name, stages in expected.items():
        a, b = base.components()[name], edited.components()[name]
        got_addr = {s for s in ("raw_shards", "token_cache") if a.address(s).fingerprint != b.address(s).fingerprint}
        got_version = {s for s in ("raw_shards", "token_cache") if a.config_version(s) != b.config_version(s)}
        assert got_addr == stages, name
        assert got_version == stages, name


def test_a_checkpoint_evaluations_own_version_covers_its_task_files_not_its_inputs(tmp_path, corpus):
    """``own_version`` (the code version of a per-checkpoint evaluation asset) covers the stage's
    own settings and its local task files by content, never the run it reads."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mine.yaml").write_text("task: mine\n", encoding="utf-8")
    raw = {**_base(tmp_path, corpus), "eval_harness.task_spec": ["hellaswag"],
           "eval_harness.include_path": [str(tasks)]}
    base = _pipe(raw)
    assert "task_eval" in base.stages
    v0, c0 = base.own_version("task_eval"), base.config_version("task_eval")
    # a run setting: the task evaluation of another run, the same own version
    other_run = _pipe({**raw, "optimizer.learning_rate": 2.0e-3})
    assert other_run.own_version("task_eval") == v0
    assert other_run.config_version("task_eval") != c0
    # a task setting: both
    fewshot = _pipe({**raw, "eval_harness.task_spec": [{"task": "hellaswag", "num_fewshot": 3}]})
    assert fewshot.own_version("task_eval") != v0 and fewshot.config_version("task_eval") != c0
    # the task file's content: both; the eval_report's own version is untouched
    (tasks / "mine.yaml").write_text("task: mine\nnum_fewshot: 1\n", encoding="utf-8")
    edited = _pipe(raw)
    assert edited.own_version("task_eval") != v0
    assert edited.config_version("task_eval") != c0
    assert edited.own_version("eval_report") == base.own_version("eval_report")
    # the same files elsewhere: named by content and place within the entry, not by the path
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "mine.yaml").write_text("task: mine\nnum_fewshot: 1\n", encoding="utf-8")
    elsewhere = _pipe({**raw, "eval_harness.include_path": [str(moved)]})
    assert elsewhere.own_version("task_eval") == edited.own_version("task_eval")
    assert elsewhere.address("task_eval").fingerprint == edited.address("task_eval").fingerprint


def test_the_evaluations_read_the_step_the_run_finished_at(tmp_path, corpus):
    """Before training, the checkpoint evaluations read the step the config names; once the run
    is complete, the step it finished at (it may stop early), and their addresses follow it."""
    raw = _base(tmp_path, corpus)
    pipe = _pipe(raw)
    assert pipe.address("eval_report").inputs["step"] == 6
    assert pipe.address("hf_export").inputs["step"] == 6
    planned, early = pipe.address("eval_report").fingerprint, pipe.address("eval_report", 4).fingerprint
    assert planned != early
    run = _pipe(raw)
    run.run("train_ckpt", lambda path: ({"final_step": 4}, {}))
    finished = _pipe(raw)
    assert finished.address("eval_report").inputs["step"] == 4
    assert finished.address("hf_export").inputs["step"] == 4
    assert finished.address("eval_report").fingerprint == early


def test_a_stage_reading_a_stage_that_does_not_apply_does_not_apply_either(tmp_path, corpus):
    """A stage declared after ``task_eval`` and reading it is one of an experiment's stages only
    where ``task_eval`` is; where it is not, it has no address and says why."""
    from lm_pipeline.schema import ConfigError
    from lm_pipeline.steps import STAGES, Stage

    summary = Stage("task_summary", 1, ("task_eval",), lambda pipe: {}, lambda ctx, inputs: None,
                    description="A summary of the task scores.", kind="python")
    table = (*STAGES, summary)
    without = _pipe(_base(tmp_path, corpus), stages=table)
    assert "task_summary" not in without.stages and "task_eval" not in without.stages
    assert "task_eval" in without.skipped["task_summary"]
    with pytest.raises(ConfigError, match="does not apply"):
        without.address("task_summary")
    assert [r["stage"] for r in without.plan()] == list(LINEAGE)
    with_tasks = _pipe({**_base(tmp_path, corpus), "eval_harness.task_spec": ["hellaswag"]}, stages=table)
    assert list(with_tasks.stages)[-2:] == ["task_eval", "task_summary"]
    assert with_tasks.address("task_summary").inputs == {"task_eval": with_tasks.address("task_eval").fingerprint}


# -- with_config: runtime settings only -------------------------------------------------------------


def test_with_config_takes_runtime_settings_and_refuses_semantic_ones(tmp_path, corpus):
    """A pipeline takes another config that differs in runtime settings only (same addresses);
    one that differs in a semantic field is refused, and the pipeline's addresses are untouched."""
    raw = _base(tmp_path, corpus)
    pipe = _pipe(raw)
    before = _addresses(pipe)
    runtime = pipe.with_config(load_config(None, {**raw, "trainer.log_every": 1, "data.num_workers": 3}))
    assert runtime.cfg.trainer.log_every == 1
    assert _addresses(runtime) == before
    for edit in ({"optimizer.learning_rate": 2.0e-3}, {"data.min_length": 5}, {"data.tokenizer.vocab_size": 320}):
        with pytest.raises(ValueError, match="semantic"):
            pipe.with_config(load_config(None, {**raw, **edit}))
    assert _addresses(pipe) == before


# -- completion: the manifest, and nothing else -----------------------------------------------------


def test_an_artifact_directory_without_its_manifest_is_built_again(tmp_path, corpus):
    """Files at an address without its manifest (an interrupted build) are no cache hit: the
    writer runs, the manifest is committed; the next run is a hit and writes nothing."""
    pipe = _pipe(_base(tmp_path, corpus))
    fp = pipe.address("tokenizer").fingerprint
    path = Path(pipe.store.artifact("tokenizer", fp).path)
    path.mkdir(parents=True)
    (path / "tokenizer.json").write_text("{half", encoding="utf-8")
    assert pipe.cached("tokenizer") is None
    assert not pipe.store.is_complete("tokenizer", fp)
    assert [r["hit"] for r in pipe.plan() if r["stage"] == "tokenizer"] == [False]
    calls: list[str] = []
    res = pipe.run("tokenizer", _writer(calls))
    assert calls == [str(path)] and res.hit is False
    manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    assert (manifest["stage"], manifest["fingerprint"]) == ("tokenizer", fp)
    assert manifest["summary"] == {"written": "payload"}
    again = pipe.run("tokenizer", _writer(calls, "other"))
    assert again.hit is True and calls == [str(path)]
    assert (path / "payload.txt").read_text(encoding="utf-8") == "payload"


def test_complete_artifacts_are_listed_in_the_order_they_were_committed(tmp_path):
    """Oldest first, whatever their names (fingerprints sort in no particular order)."""
    from lm_pipeline.store import ArtifactStore

    store = ArtifactStore(str(tmp_path / "store"))
    order = ["c3c3c3", "a1a1a1", "e5e5e5", "b2b2b2", "f6f6f6", "d4d4d4"]
    for fp in order:
        store.commit(store.artifact("tokenizer", fp), {"config": {"fp": fp}})
    assert [m["fingerprint"] for m in store.complete("tokenizer")] == order


# -- the plan: what changed since the latest artifact -----------------------------------------------


def test_the_plan_compares_a_miss_with_the_latest_complete_artifact(tmp_path, corpus):
    """Of two earlier artifacts of a stage, a miss is explained against the one committed last."""
    raw = _base(tmp_path, corpus)
    first = _pipe({**raw, "data.tokenizer.vocab_size": 300})
    second = _pipe({**raw, "data.tokenizer.vocab_size": 320})
    first.run("tokenizer", _writer([]))
    second.run("tokenizer", _writer([]))  # committed after the first
    now = _pipe({**raw, "data.tokenizer.vocab_size": 340})
    row = next(r for r in now.plan() if r["stage"] == "tokenizer")
    assert row["hit"] is False
    assert row["compared_with"] == second.address("tokenizer").fingerprint
    assert row["changes"] == ["config.vocab_size: 320 -> 340"]
    # the second's own address is a hit with nothing to compare
    row = next(r for r in second.plan() if r["stage"] == "tokenizer")
    assert row["hit"] is True and row["changes"] == []


def test_the_plan_names_a_config_key_the_new_config_no_longer_has(tmp_path, corpus):
    """The run's config names its row order only when it is not the default: back to the default,
    the plan lists the keys that are gone (else a miss would show no reason)."""
    raw = _base(tmp_path, corpus)
    era = _pipe({**raw, "data.shuffle": "era", "data.era_length": 64})
    era.run("train_ckpt", _writer([]))
    now = _pipe(raw)
    row = next(r for r in now.plan() if r["stage"] == "train_ckpt")
    assert row["hit"] is False and row["compared_with"] == era.address("train_ckpt").fingerprint
    changed = {line.split(":", 1)[0] for line in row["changes"]}
    assert {"config.shuffle.order", "config.shuffle.era_length"} <= changed, row["changes"]


def test_the_task_scores_over_steps_are_those_of_one_run_with_the_same_settings(tmp_path, corpus):
    """The history a task evaluation shows: the same run's evaluations with the same settings,
    by step; never another run's, nor other settings' on the same run."""
    from lm_pipeline.steps.task_eval import history

    tasks = {"eval_harness.task_spec": ["hellaswag"]}
    raw = {**_base(tmp_path, corpus), **tasks}
    run_a, run_b = _pipe(raw), _pipe({**raw, "optimizer.learning_rate": 2.0e-3})
    fewshot = _pipe({**raw, "eval_harness.task_spec": [{"task": "hellaswag", "num_fewshot": 2}]})
    results = {}
    for name, pipe, step in (("a4", run_a, 4), ("b3", run_b, 3), ("a2", run_a, 2), ("f2", fewshot, 2),
                             ("b5", run_b, 5)):
        results[name] = pipe.run("task_eval", _writer([], step=step), step=step)
    assert len({r.fingerprint for r in results.values()}) == 5
    steps = [(m["inputs"]["train_ckpt"], m["step"]) for m in history(results["a4"])]
    train_a = run_a.address("train_ckpt").fingerprint
    assert steps == [(train_a, 2), (train_a, 4)]
    assert [m["step"] for m in history(results["b3"])] == [3, 5]
    assert [m["step"] for m in history(results["f2"])] == [2]


def test_the_reevaluation_picks_each_runs_latest_checkpoint_of_the_most_recent_runs():
    """A run that reports a new checkpoint is recent again: of runs reported a, b, a, c the two most
    recent are a (its latest step) and c."""
    from assets.pipeline import checkpoint_key, latest_checkpoint_keys

    keys = [checkpoint_key("aaaa", 100), checkpoint_key("bbbb", 50), checkpoint_key("aaaa", 200),
            checkpoint_key("cccc", 10)]
    assert latest_checkpoint_keys(keys, max_runs=2) == [checkpoint_key("aaaa", 200), checkpoint_key("cccc", 10)]
    assert latest_checkpoint_keys(keys, max_runs=3) == [checkpoint_key("bbbb", 50), checkpoint_key("aaaa", 200),
                                                        checkpoint_key("cccc", 10)]


# -- Dagster: which experiments share an artifact ----------------------------------------------------


def _deployment(tmp_path: Path, corpus: dict[str, str], experiments: dict[str, dict[str, Any]]):
    """A deployment of experiments ``name -> edits of the base config``."""
    from assets.deployment import Deployment
    from assets.experiment import Experiment

    exps = [Experiment(str(tmp_path / f"{name}.yaml"), (), load_config(None, {**_base(tmp_path, corpus), **edits}))
            for name, edits in experiments.items()]
    return Deployment(exps)


def _sharing(dep, name: str = "a") -> dict[str, list[str]]:
    """Stage -> the other experiments whose artifact experiment ``name``'s is (shared stages only)."""
    return {s: sorted(dep.shared_with(name, s)) for s in LINEAGE if dep.shared_with(name, s)}


def test_experiments_share_exactly_the_stages_whose_whole_chain_is_the_same(tmp_path, corpus):
    """Sharing follows everything an artifact is made from, not the stage's own settings only:
    another vocabulary shares the shards only (the token cache reads the other tokenizer, though
    its own config is the same); another learning rate shares the data stages, not the
    evaluations of the other run (the same evaluation settings)."""
    vocab = _deployment(tmp_path, corpus, {"a": {}, "b": {"data.tokenizer.vocab_size": 320}})
    assert _sharing(vocab) == {"raw_shards": ["b"]}
    lr = _deployment(tmp_path, corpus, {"a": {}, "b": {"optimizer.learning_rate": 2.0e-3}})
    assert _sharing(lr) == {"raw_shards": ["b"], "tokenizer": ["b"], "token_cache": ["b"]}
    # each node's code version is its experiment's config version of the stage
    for n, exp in lr.experiments.items():
        assert {s: lr.node(n, s).version for s in LINEAGE} == exp.pipeline().config_versions()


def test_experiments_over_different_stores_share_nothing(tmp_path, corpus):
    """The same config over another store names other artifacts: nothing is shared."""
    same = _deployment(tmp_path, corpus, {"a": {}, "b": {}})
    assert _sharing(same) == {s: ["b"] for s in LINEAGE}
    apart = _deployment(tmp_path, corpus, {"a": {}, "b": {"store.root": str(tmp_path / "other-store")}})
    assert _sharing(apart) == {}
    assert all(apart.shared_with(n, s) == [] for n in apart.experiments for s in LINEAGE)


# -- Dagster: the data version of the data sources --------------------------------------------------


def test_the_data_sources_version_follows_the_shards_bytes(tmp_path, corpus):
    """The observable data source's version changes when a shard's bytes change (same names),
    and is the same for the same bytes."""
    from assets.provenance import source_version

    raw = _base(tmp_path, corpus)
    v0, shards0 = source_version(_pipe(raw))
    assert sorted(k.split("/", 1)[0] for k in shards0) == ["train", "train", "validation"]
    assert source_version(_pipe({**raw, "trainer.log_every": 1}))[0] == v0
    with open(corpus["train-1.jsonl"], "a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "x = 1\n"}) + "\n")
    v1, shards1 = source_version(_pipe(raw))
    assert set(shards1) == set(shards0)
    assert v1 != v0


def test_bytecode_and_hidden_folders_under_the_task_files_are_not_part_of_the_version(tmp_path, corpus):
    """The harness imports a task's ``!function`` module, and Python writes its bytecode into
    ``__pycache__`` beside it: the evaluation's version stays what it was before the first
    evaluation (a ``.git`` folder likewise), while an edit of the module itself re-versions it."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mine.yaml").write_text("task: mine\nprocess_docs: !function utils.process\n", encoding="utf-8")
    (tasks / "utils.py").write_text("def process(docs):\n    return docs\n", encoding="utf-8")
    raw = {**_base(tmp_path, corpus), "eval_harness.task_spec": ["mine"], "eval_harness.include_path": [str(tasks)]}
    before = _pipe(raw)
    v0, a0 = before.own_version("task_eval"), before.address("task_eval").fingerprint
    (tasks / "__pycache__").mkdir()
    (tasks / "__pycache__" / "utils.cpython-311.pyc").write_bytes(b"\x00compiled")
    (tasks / ".git").mkdir()
    (tasks / ".git" / "HEAD").write_text("ref: refs/heads/main\n", encoding="utf-8")
    after = _pipe(raw)
    assert after.own_version("task_eval") == v0
    assert after.address("task_eval").fingerprint == a0
    (tasks / "utils.py").write_text("def process(docs):\n    return list(docs)[:10]\n", encoding="utf-8")
    assert _pipe(raw).own_version("task_eval") != v0
