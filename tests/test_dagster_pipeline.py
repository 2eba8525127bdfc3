"""The six assets materialized through Dagster on a tiny experiment, checked through Dagster's own
instance: materialization records (data versions, ``cache_hit``), observations and the stale
status resolver -- not only through the store."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._core.loader import LoadingContextForTest
from helpers import pipeline as pt

from assets.checkpoints import find_checkpoint
from assets.deployment import Deployment
from assets.experiment import load_experiment
from assets.pipeline import (
    CHECKPOINT_TAG,
    LINEAGE,
    build_assets,
    build_definitions,
    checkpoint_key,
    checkpoint_requests,
    default_resources,
    lineage_selection,
)

NAME = "tiny"  # the experiment of pt.write_config (tiny.yaml), alone: the default, its keys the bare stage names
TRAIN_KEYS = {dg.AssetKey("train_ckpt"): [NAME]}


def K(stage: str) -> dg.AssetKey:
    return dg.AssetKey(stage)


def deployment(exp) -> Deployment:
    return Deployment([exp], default=exp.name)
from resources import TrainingLauncherResource  # noqa: E402


class Harness:
    """Materializes the experiment (as loaded with some overrides) into one Dagster instance."""

    def __init__(self, tmp: Path, instance: dg.DagsterInstance, mode: str = "in_process"):
        self.path = pt.write_config(tmp)
        self.instance = instance
        self.mode = mode

    def experiment(self, overrides: str = ""):
        return load_experiment(self.path, overrides=overrides)

    def materialize(self, overrides: str = "", selection=None, **kw) -> dg.ExecuteInMemoryResult:
        exp = self.experiment(overrides)
        dep = deployment(exp)
        resources = {**default_resources(exp), "training": TrainingLauncherResource(mode=self.mode, poll_seconds=0.2)}
        keys = [K(s) for s in selection] if selection else lineage_selection(dep)
        return dg.materialize(build_assets(dep), selection=keys, resources=resources, instance=self.instance, **kw)

    def latest(self, key: str) -> dg.AssetMaterialization:
        return self.instance.get_latest_materialization_event(K(key)).asset_materialization

    def hits(self) -> dict[str, bool]:
        return {k: self.latest(k).metadata["cache_hit"].value for k in LINEAGE}

    def data_versions(self) -> dict[str, str]:
        return {k: self.latest(k).tags["dagster/data_version"] for k in LINEAGE}

    def stale(self, overrides: str = "") -> dict[str, StaleStatus]:
        """Staleness as the UI shows it once the definitions reload with ``overrides``."""
        graph = build_definitions(self.experiment(overrides)).resolve_asset_graph()
        resolver = CachingStaleStatusResolver(self.instance, graph, LoadingContextForTest(self.instance))
        return {k: resolver.get_status(K(k)) for k in LINEAGE}

    def expected_fingerprints(self, overrides: str = "") -> dict[str, str]:
        p = self.experiment(overrides).pipeline()
        return {k: p.address(k).fingerprint for k in LINEAGE}


FRESH = dict.fromkeys(LINEAGE, StaleStatus.FRESH)


def _observed_checkpoints(instance: dg.DagsterInstance) -> list[str]:
    records = instance.fetch_observations(K("train_ckpt"), limit=100, ascending=True).records
    return [r.asset_observation.metadata["checkpoint_key"].value for r in records if r.asset_observation.metadata]


def test_materialize_everything_through_pipes_then_nothing_to_do(tmp_path):
    """All six assets (training in its own process through Pipes), then again with nothing changed:
    every asset a hit, no training, fast; a log-cadence edit changes nothing either."""
    h = Harness(tmp_path, dg.DagsterInstance.ephemeral(), mode="pipes")
    first = h.materialize()
    assert first.success
    fps = h.expected_fingerprints()
    assert h.data_versions() == fps  # data version = fingerprint
    assert h.hits() == dict.fromkeys(LINEAGE, False)
    assert h.stale() == FRESH

    # what each asset tells the user
    train = h.latest("train_ckpt").metadata
    assert train["final_step"].value == 6 and "train/loss" in train and "eval/loss" in train
    assert train["loss_curve"].value.startswith("![loss curve](data:image/png;base64,")
    assert Path(train["loss_curve_path"].value).is_file()
    for key in ("learning_rate_curve", "eval_bpb_curve", "throughput_curve"):  # the other plots, beside the run
        assert train[key].value.startswith("![") and "data:image/png;base64," in train[key].value
        assert Path(train[f"{key}_path"].value).parent == Path(train["run_dir"].value, "plots")
    assert train["path"].value == f"{tmp_path}/store/train_ckpt/{fps['train_ckpt']}"
    report = h.latest("eval_report").metadata["report"].value
    datasets = {r.data["dataset"] for r in report.records}
    assert {"validation", "_micro", "_macro"} <= datasets
    row = next(r.data for r in report.records if r.data["dataset"] == "validation")
    assert row["loss"] > 0 and row["bpb"] > 0 and row["unigram_loss"] > 0 and row["step"] == 6
    hf = h.latest("hf_export").metadata
    assert "config.json" in hf["files"].value and "model.safetensors" in hf["files"].value
    assert Path(hf["path"].value, "config.json").is_file()
    cache = h.latest("token_cache").metadata
    assert cache["shard_groups"].value == 5 and cache["groups_tokenized_in_this_run"].value == 5
    # each artifact's check ran after it: the cache's ids and counts and the export's logits pass;
    # a 6-step run is no better than unigram yet, which is a warning, never a blocked run
    checks = {e.asset_check_evaluation_data.asset_check_key.to_user_string(): e.asset_check_evaluation_data
              for e in first.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}
    assert set(checks) == {"token_cache:token_ids_and_counts", "train_ckpt:final_loss", "eval_report:bpb_vs_unigram",
                           "hf_export:loads_in_transformers"}
    assert checks["token_cache:token_ids_and_counts"].passed and checks["hf_export:loads_in_transformers"].passed
    assert checks["hf_export:loads_in_transformers"].metadata["relative_diff"].value <= 1e-4
    for name in ("train_ckpt:final_loss", "eval_report:bpb_vs_unigram"):
        assert checks[name].passed or checks[name].severity == dg.AssetCheckSeverity.WARN, checks[name]
    assert {r.data["split"] for r in cache["splits"].value.records} == {"train", "validation"}

    # the Pipes process reported its metrics (log lines as it trained, final values with its
    # materialization) and each checkpoint as it landed (observations of train_ckpt)
    assert train["reported_by"].value.startswith("pipes process")
    messages = [r.user_message for r in h.instance.all_logs(first.run_id)]
    assert any(m.startswith("step 2: train/loss=") for m in messages)
    assert any("checkpoint step 3 (permanent) complete" in m for m in messages)
    keys = [checkpoint_key(fps["train_ckpt"], s) for s in (3, 6)]
    assert sorted(set(_observed_checkpoints(h.instance))) == keys
    requests = checkpoint_requests(h.instance, None, train_keys=TRAIN_KEYS)
    assert [r.partition_key for r in requests.run_requests] == keys

    # again, nothing changed: no tokenizing or training, every asset a hit, same data versions
    steps = sorted(p.name for p in Path(train["path"].value).glob("step-*"))
    before = pt.store_files(tmp_path / "store")
    again = h.materialize()
    assert again.success and h.hits() == dict.fromkeys(LINEAGE, True)
    assert h.data_versions() == fps and h.stale() == FRESH
    after = pt.store_files(tmp_path / "store")  # not one artifact file written, added or removed
    assert after == before, sorted(set(after.items()) ^ set(before.items()))[:20]
    assert sorted(p.name for p in Path(train["path"].value).glob("step-*")) == steps
    assert not [e for e in again.all_events if e.event_type_value == "ASSET_OBSERVATION"
                and e.asset_key == K("train_ckpt")]  # no training ran (no checkpoint reported)

    # a log cadence is not semantic: nothing is stale, everything is a hit
    assert h.stale("trainer.log_every=1 trainer.steps_per_eval=2") == FRESH
    assert h.materialize("trainer.log_every=1 trainer.steps_per_eval=2").success
    assert h.hits() == dict.fromkeys(LINEAGE, True) and h.data_versions() == fps


@pytest.mark.slow
def test_config_edits_rerun_exactly_what_depends_on_them(tmp_path):
    """Vocab size: raw_shards a hit, the other five recomputed; reverting: all hits; learning rate:
    the data stages are hits. Checked through staleness and materialization records."""
    h = Harness(tmp_path, dg.DagsterInstance.ephemeral(), mode="in_process")
    assert h.materialize().success
    original = h.data_versions()

    vocab = "data.tokenizer.vocab_size=320"
    stale = h.stale(vocab)  # the UI after the edit, before anything re-runs
    assert stale == {**FRESH, **dict.fromkeys(set(LINEAGE) - {"raw_shards"}, StaleStatus.STALE)}
    assert h.materialize(vocab).success
    assert h.hits() == {**dict.fromkeys(LINEAGE, False), "raw_shards": True}
    changed = h.data_versions()
    assert changed["raw_shards"] == original["raw_shards"]
    assert all(changed[k] != original[k] for k in LINEAGE if k != "raw_shards")
    assert changed == h.expected_fingerprints(vocab)
    assert h.stale(vocab) == FRESH

    # revert: everything is a hit again, with the original data versions
    assert h.stale() == {**FRESH, **dict.fromkeys(set(LINEAGE) - {"raw_shards"}, StaleStatus.STALE)}
    assert h.materialize().success
    assert h.hits() == dict.fromkeys(LINEAGE, True) and h.data_versions() == original
    assert h.stale() == FRESH

    lr = "optimizer.learning_rate=2e-3"
    assert h.stale(lr) == {**FRESH, **dict.fromkeys(("train_ckpt", "eval_report", "hf_export"), StaleStatus.STALE)}
    assert h.materialize(lr).success
    assert h.hits() == {"raw_shards": True, "tokenizer": True, "token_cache": True,
                        "train_ckpt": False, "eval_report": False, "hf_export": False}
    assert h.stale(lr) == FRESH


def test_checkpoint_eval_partition_evaluates_one_checkpoint(tmp_path):
    """The sensor's request for an intermediate checkpoint materializes its evaluation."""
    h = Harness(tmp_path, dg.DagsterInstance.ephemeral(), mode="in_process")
    assert h.materialize(selection=["raw_shards", "tokenizer", "token_cache", "train_ckpt"]).success
    result = checkpoint_requests(h.instance, None, train_keys=TRAIN_KEYS)
    keys = [r.partition_key for r in result.run_requests]
    fp = h.expected_fingerprints()["train_ckpt"]
    assert keys == [checkpoint_key(fp, 3), checkpoint_key(fp, 6)]  # in-process runs report them too
    h.instance.add_dynamic_partitions(f"checkpoints_{NAME}", keys)
    req = result.run_requests[0]
    exp = h.experiment()
    run = dg.materialize(build_assets(deployment(exp)), selection=[K("checkpoint_eval")], partition_key=req.partition_key,
                         tags=req.tags, resources=default_resources(exp), instance=h.instance)
    assert run.success
    m = h.instance.get_latest_materialization_event(K("checkpoint_eval")).asset_materialization
    assert m.partition == keys[0]
    assert m.metadata["step"].value == 3 and m.metadata["checkpoint"].value == req.tags[CHECKPOINT_TAG]
    assert m.metadata["cache_hit"].value is False and m.metadata["loss"].value > 0
    # with neither the run's tag nor an observation, a key still finds its checkpoint in the run's directory
    store = default_resources(exp)["store"]
    assert find_checkpoint(dg.DagsterInstance.ephemeral(), keys[0], store) == f"{tmp_path}/store/train_ckpt/{fp}/step-3"
    # the final checkpoint's evaluation is the same artifact as eval_report's
    last = dg.materialize(build_assets(deployment(exp)), selection=[K("checkpoint_eval")], partition_key=keys[1],
                          resources=default_resources(exp), instance=h.instance)
    assert last.success
    m = h.instance.get_latest_materialization_event(K("checkpoint_eval")).asset_materialization
    assert m.tags["dagster/data_version"] == exp.pipeline().address("eval_report").fingerprint


def test_checkpoint_readers_never_train(tmp_path):
    """eval_report / hf_export on a run that is not trained fail clearly instead of training."""
    h = Harness(tmp_path, dg.DagsterInstance.ephemeral())
    for key in ("eval_report", "hf_export"):
        result = h.materialize(selection=[key], raise_on_error=False)
        assert not result.success
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        message = failure.step_failure_data.user_failure_data.description
        assert message.startswith(f"{key} reads train_ckpt ") and "which is not built: materialize train_ckpt first" in message
    assert not (tmp_path / "store" / "train_ckpt").exists()


@pytest.mark.faults
def test_failed_training_is_retried_and_resumes_from_its_latest_checkpoint(tmp_path, monkeypatch):
    """The Pipes training process dies after its first checkpoint; the RetryPolicy re-runs the
    step, which resumes from that checkpoint instead of starting over."""
    marker = tmp_path / "fault-happened"
    monkeypatch.setenv("LM_PIPELINE_FAULTPOINT", "train_ckpt.after_step:5:kill")  # dies at step 5, after step-3 is saved
    monkeypatch.setenv("LM_PIPELINE_FAULTPOINT_ONCE", str(marker))  # the retry gets past it
    h = Harness(tmp_path, dg.DagsterInstance.ephemeral(), mode="pipes")
    result = h.materialize(selection=["raw_shards", "tokenizer", "token_cache", "train_ckpt"])
    assert result.success and marker.exists()
    retries = [e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
    assert len(retries) == 1
    meta = h.latest("train_ckpt").metadata
    fp = h.expected_fingerprints()["train_ckpt"]
    assert meta["final_step"].value == 6
    assert meta["resumed_from"].value == f"{tmp_path}/store/train_ckpt/{fp}/step-3"
    assert sorted(set(_observed_checkpoints(h.instance))) == [checkpoint_key(fp, 3), checkpoint_key(fp, 6)]
