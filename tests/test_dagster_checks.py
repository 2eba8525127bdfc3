"""The asset checks (assets/checks.py) pass on good artifacts and fail on planted bad ones: a token
id past the vocabulary, counts that disagree with the ledger or with raw_shards, a diverged or
unigram-level training loss, an evaluation no better than unigram, an export that does not load in
transformers or whose logits differ from its model's; and through Dagster, a failing blocking
check on the token cache keeps the training from running."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil
from pathlib import Path

import dagster as dg
import pytest
from helpers import pipeline as pt

from assets.checks import (
    ERROR,
    WARN,
    eval_report_outcome,
    hf_export_outcome,
    token_cache_outcome,
    train_ckpt_outcome,
    unigram_loss,
)
from assets.deployment import Deployment
from assets.experiment import load_experiment
from assets.pipeline import build_assets, default_resources
from lm_pipeline.data.cache.storage import CacheRoot, open_array
from lm_pipeline.steps import Pipeline
from lm_pipeline.store import ArtifactStore

pytestmark = pytest.mark.filterwarnings("ignore::dagster.BetaWarning")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny experiment's raw shards, tokenizer and token cache, built by the core."""
    tmp = tmp_path_factory.mktemp("checks")
    exp = load_experiment(pt.write_config(tmp), overrides=[])
    pipe = Pipeline(exp.cfg, ArtifactStore(exp.store_root), progress=False)
    return {"tmp": tmp, "exp": exp, "raw": pipe.build("raw_shards"), "tokenizer": pipe.build("tokenizer"),
            "cache": pipe.build("token_cache")}


def _copy_cache(built, tmp_path) -> str:
    path = tmp_path / "token_cache"
    shutil.copytree(built["cache"].path, path)
    return str(path)


def _rewrite_ledger(split_dir: str, edit) -> None:
    """Edit a cache split's ledger and re-seal its completion marker (a consistent but lying ledger)."""
    ledger_path, marker_path = Path(split_dir, "ledger.json"), Path(split_dir, "COMPLETE")
    ledger = json.loads(ledger_path.read_text())
    edit(ledger)
    data = json.dumps(ledger, indent=1).encode()
    ledger_path.write_bytes(data)
    marker = json.loads(marker_path.read_text())
    marker["ledger_sha256"] = hashlib.sha256(data).hexdigest()
    marker_path.write_text(json.dumps(marker))


def test_token_cache_check_passes_on_the_built_cache(built):
    out = token_cache_outcome(built["cache"].path, built["cache"].manifest, built["raw"].manifest)
    assert out.passed, out.description
    train = out.metadata["splits"]["train"]
    assert train["max_token_id"] < train["vocab_size"] == 300
    assert train["docs"] == 12 and train["tokens"] == built["cache"].manifest["summary"]["splits"]["train"]["num_tokens"]
    assert set(out.result().metadata) == {"splits"}


def test_token_cache_check_fails_on_an_id_past_the_vocabulary(built, tmp_path):
    path = _copy_cache(built, tmp_path)
    open_array(CacheRoot(f"{path}/validation"), "tokens")[7].write(300 + 5).result()
    out = token_cache_outcome(path, built["cache"].manifest, built["raw"].manifest)
    assert not out.passed and out.severity == ERROR
    assert "validation: token id 305 is not below the vocabulary size 300" in out.description
    assert out.metadata["splits"]["validation"]["max_token_id"] == 305


def test_token_cache_check_fails_when_counts_disagree_with_the_ledger(built, tmp_path):
    # the ledger claims a token more than the documents hold
    path = _copy_cache(built, tmp_path)
    _rewrite_ledger(f"{path}/train", lambda led: led["committed"].update(tokens=led["committed"]["tokens"] - 1))
    out = token_cache_outcome(path, built["cache"].manifest, built["raw"].manifest)
    assert not out.passed and out.severity == ERROR
    assert "train: the document offsets do not cover the ledger's" in out.description
    # the materialization reports other counts than the ledger
    manifest = copy.deepcopy(built["cache"].manifest)
    manifest["summary"]["splits"]["validation"]["num_docs"] = 3
    out = token_cache_outcome(built["cache"].path, manifest, built["raw"].manifest)
    assert not out.passed and "validation: the materialization reports" in out.description
    # raw_shards kept another number of records than the cache has documents
    raw = copy.deepcopy(built["raw"].manifest)
    raw["shards"]["train"][0]["valid"] = 4
    out = token_cache_outcome(built["cache"].path, built["cache"].manifest, raw)
    assert not out.passed and "has 3 documents, raw_shards kept 4 records" in out.description


def test_train_ckpt_check_fails_on_a_diverged_run_and_warns_at_the_unigram_level(built):
    train_cache = f"{built['cache'].path}/train"
    baseline, counted = unigram_loss(train_cache)
    assert 0 < baseline < math.log(300) and counted == built["cache"].manifest["summary"]["splits"]["train"]["num_tokens"]
    good = train_ckpt_outcome({"summary": {"train/loss": baseline - 1.0, "final_step": 6}}, train_cache)
    assert good.passed and good.metadata["unigram_loss"] == baseline
    nan = train_ckpt_outcome({"summary": {"train/loss": float("nan"), "final_step": 6}}, train_cache)
    assert not nan.passed and nan.severity == ERROR and "not finite" in nan.description
    high = train_ckpt_outcome({"summary": {"train/loss": baseline + 0.5, "final_step": 6}}, train_cache)
    assert not high.passed and high.severity == WARN and "is not below the unigram baseline" in high.description
    assert high.metadata["loss_vs_unigram"] > 1


def _report(bpb: float, unigram_bpb: float) -> dict:
    return {"rows": [{"kind": "micro", "dataset": "_micro", "bpb": bpb, "unigram_bpb": unigram_bpb, "loss": 1.0,
                      "unigram_loss": 2.0, "step": 6}]}


def test_eval_report_check_compares_bits_per_byte_with_the_unigram_baseline():
    assert eval_report_outcome(_report(2.0, 4.4)).passed
    worse = eval_report_outcome(_report(5.9, 4.4))
    assert not worse.passed and worse.severity == WARN and worse.metadata["bpb_vs_unigram"] > 1
    broken = eval_report_outcome(_report(float("inf"), 4.4))
    assert not broken.passed and broken.severity == ERROR


def test_hf_export_check_loads_the_export_and_compares_logits(built, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import jax
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from lm_pipeline.hf import export_hf
    from lm_pipeline.models import Gpt2Config
    from lm_pipeline.models.layers import named_params, replace_params

    model = Gpt2Config(seq_len=32, hidden_dim=32, num_heads=2, num_layers=1).build(300, key=jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)  # weights of a trained size (fresh ones give near-zero logits)
    model = replace_params(model, {n: (1.0 if n.endswith(".weight") else 0.0) + 0.2 * rng.standard_normal(
        leaf.shape, np.float32) for n, leaf in named_params(model).items()})
    out = str(tmp_path / "export")
    export_hf(model, out, tokenizer_dir=built["tokenizer"].path, progress=False)
    good = hf_export_outcome(out, None, model=model)
    assert good.passed, good.description
    assert good.metadata["relative_diff"] <= 1e-4 and good.metadata["model_type"] == "gpt2"
    assert good.metadata["max_abs_logit"] > 1

    bad = str(tmp_path / "perturbed")  # one weight changed after the export
    shutil.copytree(out, bad)
    weights = load_file(f"{bad}/model.safetensors")
    name = next(k for k in sorted(weights) if k.endswith("c_fc.weight"))
    weights[name] = (weights[name] + np.float32(0.01)).astype(weights[name].dtype)
    save_file(weights, f"{bad}/model.safetensors", metadata={"format": "pt"})
    out_bad = hf_export_outcome(bad, None, model=model)
    assert not out_bad.passed and out_bad.severity == ERROR and "logits differ" in out_bad.description
    assert out_bad.metadata["relative_diff"] > 1e-4

    broken = str(tmp_path / "broken")  # a config transformers cannot read
    shutil.copytree(out, broken)
    cfg = json.loads(Path(broken, "config.json").read_text())
    cfg["model_type"] = "no_such_model"
    Path(broken, "config.json").write_text(json.dumps(cfg))
    out_broken = hf_export_outcome(broken, None, model=model)
    assert not out_broken.passed and out_broken.severity == ERROR
    assert out_broken.description.startswith("the export does not load in transformers")


def test_a_failing_blocking_check_keeps_the_training_from_running(tmp_path):
    """Through Dagster: a token id past the vocabulary planted in the store's cache; materializing
    token_cache (a cache hit) and train_ckpt records the check's failure with what it measured,
    and train_ckpt is skipped: nothing trains on the bad cache."""
    exp = load_experiment(pt.write_config(tmp_path), overrides=[])
    dep = Deployment([exp], default=exp.name)
    instance = dg.DagsterInstance.ephemeral()
    resources = default_resources(exp)
    keys = [dg.AssetKey(s) for s in ("raw_shards", "tokenizer", "token_cache")]
    first = dg.materialize(build_assets(dep), selection=keys, resources=resources, instance=instance)
    assert first.success
    check = dg.AssetCheckKey(dg.AssetKey("token_cache"), "token_ids_and_counts")
    evaluation = next(e.asset_check_evaluation_data for e in first.all_events
                      if e.event_type_value == "ASSET_CHECK_EVALUATION")
    assert evaluation.asset_check_key == check and evaluation.passed

    cache = exp.pipeline().cached("token_cache")
    open_array(CacheRoot(f"{cache.path}/train"), "tokens")[0].write(999).result()
    result = dg.materialize(build_assets(dep), selection=[dg.AssetKey("token_cache"), dg.AssetKey("train_ckpt")],
                            resources=resources, instance=instance, raise_on_error=False)
    evaluation = next(e.asset_check_evaluation_data for e in result.all_events
                      if e.event_type_value == "ASSET_CHECK_EVALUATION")
    assert not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.ERROR
    assert "token id 999 is not below the vocabulary size 300" in evaluation.description
    assert evaluation.metadata["splits"].value["train"]["max_token_id"] == 999
    assert instance.get_latest_materialization_event(dg.AssetKey("train_ckpt")) is None
    assert "train_ckpt" not in {e.step_key for e in result.all_events if e.event_type_value == "STEP_START"}
    assert not (tmp_path / "store" / "train_ckpt").exists()


def test_the_mixture_index_check_fails_when_a_component_cache_is_not_complete(built):
    """A mixture's token_cache index names its components' caches: complete in the store passes;
    one never built (or removed) fails, named."""
    from assets.checks import mixture_index_outcome

    store = ArtifactStore(built["exp"].store_root)
    complete = {"web": {"fingerprint": built["cache"].fingerprint, "path": built["cache"].path}}
    good = mixture_index_outcome(store, {"components": complete})
    assert good.passed and "the 1 component caches are complete" in good.description
    missing = {**complete, "code": {"fingerprint": "0123456789abcdef", "path": "/nowhere"}}
    bad = mixture_index_outcome(store, {"components": missing})
    assert not bad.passed and bad.severity == ERROR and "component caches ['code'] are not complete" in bad.description


def _plant(path: Path, edit) -> None:
    """Rewrite an artifact's manifest in the store (a bad artifact where Dagster recorded a good one)."""
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.slow  # one experiment's lineage through Dagster, then its checks alone: ~40 s
def test_each_check_fails_through_dagster_on_a_planted_bad_artifact(tmp_path):
    """The lineage materialized (every check passes or warns), then bad artifacts planted where
    Dagster's materializations point: a diverged training loss, an evaluation with infinite bits
    per byte, an export whose weights were changed after it was written. Running the checks alone
    (no asset re-materialized) records each one's failure with what it measured."""
    from assets.pipeline import lineage_selection
    from resources import TrainingLauncherResource

    exp = load_experiment(pt.write_config(tmp_path), overrides=[])
    dep = Deployment([exp], default=exp.name)
    instance = dg.DagsterInstance.ephemeral()
    resources = {**default_resources(exp), "training": TrainingLauncherResource(mode="in_process", poll_seconds=0.2)}
    assert dg.materialize(build_assets(dep), selection=lineage_selection(dep), resources=resources,
                          instance=instance).success
    pipe = exp.fresh_pipeline(ArtifactStore(exp.store_root))
    train, report, export = (Path(pipe.cached(s).path) for s in ("train_ckpt", "eval_report", "hf_export"))
    _plant(train / "manifest.json", lambda m: m["summary"].update({"train/loss": float("nan")}))
    _plant(report / "manifest.json", lambda m: [r.update(bpb=float("inf")) for r in m["rows"] if r.get("kind") == "micro"])
    from safetensors.numpy import load_file, save_file

    weights = load_file(export / "model.safetensors")
    name = next(k for k in sorted(weights) if k.endswith("c_fc.weight"))
    weights[name] = (weights[name] + 0.5).astype(weights[name].dtype)
    save_file(weights, export / "model.safetensors", metadata={"format": "pt"})

    checks = [dg.AssetCheckKey(dg.AssetKey(s), n) for s, n in
              (("train_ckpt", "final_loss"), ("eval_report", "bpb_vs_unigram"), ("hf_export", "loads_in_transformers"))]
    result = dg.materialize(build_assets(dep), selection=dg.AssetSelection.checks(*checks), resources=resources,
                            instance=instance, raise_on_error=False)
    assert not [e for e in result.all_events if e.event_type_value == "ASSET_MATERIALIZATION"]  # the checks alone
    evaluations = {e.asset_check_evaluation_data.asset_check_key: e.asset_check_evaluation_data
                   for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}
    assert set(evaluations) == set(checks)
    assert all(not e.passed and e.severity == dg.AssetCheckSeverity.ERROR for e in evaluations.values())
    loss, bpb, logits = (evaluations[k] for k in checks)
    assert "the final training loss is nan (not finite): the run diverged" in loss.description
    assert "bits per byte is inf (not finite)" in bpb.description
    assert "logits differ" in logits.description and logits.metadata["relative_diff"].value > 1e-4
