"""A stage is one declaration: an extra leaf stage declared in its own module
(``tests/helpers/token_stats_stage.py``) and added to the table with one entry is built by the
command line, shown by the plan, followed by lineage and made an asset by the Dagster factory,
with no other edit. Its numbers are checked against the corpus tokenized by ``tokenizers`` itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from helpers import pipeline as pt
from helpers import token_stats_stage as ts

from lm_pipeline.steps import stages

TESTS = Path(__file__).parent
CLI = ("import sys; from helpers import token_stats_stage as t; t.add_to_table(); from lm_pipeline.cli import main; "
       "sys.exit(main(sys.argv[1:]))")


@pytest.fixture
def with_token_stats(monkeypatch):
    """The table with the extra entry, as ``stages.py`` would declare it."""
    monkeypatch.setattr(stages, "STAGES", (*stages.STAGES, ts.TOKEN_STATS))


def _reference(tmp: Path, tokenizer_dir: str) -> dict[str, dict[str, int]]:
    """Each split of the corpus tokenized by ``tokenizers`` (one EOS after every document), counted by hand."""
    from collections import Counter

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    eos_token = json.loads(Path(tokenizer_dir, "tokenizer_config.json").read_text())["eos_token"]
    eos = tok.token_to_id(eos_token if isinstance(eos_token, str) else eos_token["content"])
    out = {}
    for split, pattern in (("train", "train-*.jsonl"), ("validation", "validation-*.jsonl")):
        docs = [json.loads(line)["text"] for p in sorted((tmp / "data").glob(pattern)) for line in p.open()]
        counts: Counter[int] = Counter()
        for text in docs:
            counts.update([*tok.encode(text).ids, eos])
        top_count = max(counts.values())
        out[split] = {"docs": len(docs), "tokens": sum(counts.values()), "distinct": len(counts),
                      "top_id": min(i for i, n in counts.items() if n == top_count), "top_count": top_count}
    return out


def test_a_leaf_stage_declared_in_its_own_module_reaches_cli_plan_lineage_and_dagster(tmp_path, with_token_stats):
    from assets.deployment import Deployment
    from assets.experiment import load_experiment
    from assets.pipeline import build_assets, default_resources
    from lm_pipeline.config import load_config
    from lm_pipeline.steps import Pipeline
    from lm_pipeline.steps.lineage import lineage

    path = pt.write_config(tmp_path)
    cfg = load_config(str(path))
    before = Pipeline(cfg).plan()
    assert [r["stage"] for r in before][-1] == "token_stats" and not before[-1]["hit"]

    # the command line: its subcommand comes from the declaration (in a fresh process whose table has the entry)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(pt.REPO)]), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", CLI, "token-stats", "--config_path", str(path)], env=env,
                         capture_output=True, text=True, timeout=300, cwd=str(pt.REPO))
    assert run.returncode == 0, run.stderr[-3000:]
    printed = json.loads(run.stdout)
    assert printed["hit"] is False

    pipe = Pipeline(cfg)
    reference = _reference(tmp_path, pipe.cached("tokenizer").path)
    assert printed["splits"] == reference

    # the plan: every stage a hit now, the new one included
    assert [(r["stage"], r["hit"]) for r in pipe.plan()][-2:] == [("hf_export", False), ("token_stats", True)]
    assert [(r["stage"], r["hit"]) for r in pipe.plan()][:3] == [("raw_shards", True), ("tokenizer", True),
                                                                 ("token_cache", True)]

    # lineage: from the new artifact back to the raw shards, by its manifest
    fp = pipe.address("token_stats").fingerprint
    chain = [s["stage"] for s in lineage(pipe.store, "token_stats", fp)]
    assert chain == ["token_stats", "token_cache", "tokenizer", "raw_shards"]

    # the Dagster asset factory: an asset with its upstream and data source, materialized (a cache hit)
    exp = load_experiment(path)
    assets = build_assets(Deployment([exp], default=exp.name), checks=False)
    graph = dg.Definitions(assets=assets, resources=default_resources(exp)).resolve_asset_graph()
    assert graph.get(dg.AssetKey("token_stats")).parent_keys == {dg.AssetKey("token_cache"),
                                                                 dg.AssetKey("data_sources")}
    keys = [dg.AssetKey(k) for k in ("data_sources", "raw_shards", "tokenizer", "token_cache", "token_stats")]
    result = dg.materialize(assets, selection=keys, resources=default_resources(exp))  # each a cache hit
    meta = result.asset_materializations_for_node("token_stats")[0].metadata
    assert meta["cache_hit"].value is True and meta["fingerprint"].value == fp
    rows = {r.data["split"]: {k: v for k, v in r.data.items() if k != "split"} for r in meta["stats"].value.records}
    assert rows == reference


def test_the_architecture_page_lists_the_stage_table_as_declared():
    """docs/architecture.md's table of stages (what each reads, its pool, its subcommand) is the table."""
    import re

    text = (TESTS.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = {}
    for m in re.finditer(r"^\| `(\w+)` \| (.+?) \| (.+?) \| (.+?) \|$", text, re.M):
        reads = () if m.group(2) == "the data's shards" else tuple(re.findall(r"`(\w+)`", m.group(2)))
        pool = None if m.group(3) == "—" else m.group(3)
        command = None if m.group(4) == "—" else m.group(4).strip("`")
        rows[m.group(1)] = (reads, pool, command)
    table = stages.stage_table()
    assert rows == {s.name: (s.upstream, s.pool, s.command[0] if s.command else None) for s in table.values()}


def test_a_builder_reads_only_the_stages_upstream_of_it(tmp_path, monkeypatch):
    """A builder that reads a stage its declaration does not name fails naming both, before any work."""
    from lm_pipeline.config import load_config
    from lm_pipeline.steps import Pipeline
    from lm_pipeline.steps.stage import Stage

    def build(ctx, inputs):
        assert list(inputs) == ["raw_shards", "tokenizer"]  # upstream, and upstream of those
        return inputs["train_ckpt"]

    sneaky = Stage("sneaky", 1, ("tokenizer",), lambda pipe: {}, build, description="reads too much", kind="python")
    monkeypatch.setattr(stages, "STAGES", (*stages.STAGES, sneaky))
    pipe = Pipeline(load_config(str(pt.write_config(tmp_path))))
    with pytest.raises(KeyError, match="'sneaky' reads 'train_ckpt', which is not upstream of it"):
        pipe.build("sneaky")
    assert not (tmp_path / "store" / "train_ckpt").exists() and not (tmp_path / "store" / "sneaky").exists()
