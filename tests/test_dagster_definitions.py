"""The Dagster definitions without running the pipeline: experiments from files, asset keys that
depend on nothing but the experiment's name (the default experiment's bare), artifacts shared by
address, lineage, code versions from the config, asset checks, jobs, the checkpoint sensor
(exactly once, cursor, per experiment) and the schedules evaluated by Dagster."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
import yaml
from helpers import pipeline as pt

from assets.deployment import Deployment
from assets.experiment import (
    DEFAULT_EXPERIMENT,
    EXPERIMENTS_DIR,
    default_experiment,
    load_experiment,
    load_experiments,
    parse_override_text,
)
from assets.pipeline import (
    CHECKPOINT_TAG,
    EVALUATION_POOL,
    LINEAGE,
    TRAINING_POOL,
    build_definitions,
    checkpoint_key,
    checkpoint_requests,
    latest_checkpoint_keys,
    parse_checkpoint_key,
)

EDGES = {
    "raw_shards": set(), "tokenizer": {"raw_shards"}, "token_cache": {"raw_shards", "tokenizer"},
    "train_ckpt": {"token_cache"}, "eval_report": {"train_ckpt", "token_cache"}, "hf_export": {"train_ckpt"},
}


@pytest.fixture
def experiment(tmp_path):
    return load_experiment(pt.write_config(tmp_path), overrides=[])


def _graph(defs: dg.Definitions):
    return defs.resolve_asset_graph()


def _keys(defs: dg.Definitions) -> set[str]:
    return {k.to_user_string() for k in _graph(defs).get_all_asset_keys()}


def _parents(graph, key: str) -> set[str]:
    return {p.to_user_string() for p in graph.get(dg.AssetKey.from_user_string(key)).parent_keys}


def test_one_experiment_is_its_lineage_its_evaluations_and_the_comparison(experiment):
    # one experiment alone is the deployment's default: its keys are the bare stage names
    defs = build_definitions(experiment)
    graph = _graph(defs)
    assert _keys(defs) == {*LINEAGE, "data_sources", "checkpoint_eval", "experiments/comparison"}
    for stage, parents in EDGES.items():
        # every stage reads its upstream stages and (its address covers it) the data's content
        assert _parents(graph, stage) == parents | {"data_sources"}, stage
    assert _parents(graph, "checkpoint_eval") == {"train_ckpt"}
    assert _parents(graph, "experiments/comparison") == {"train_ckpt", "eval_report"}
    assert graph.get(dg.AssetKey("data_sources")).is_observable
    assert {graph.get(dg.AssetKey(s)).group_name for s in LINEAGE} == {"tiny"}
    assert graph.get(dg.AssetKey("checkpoint_eval")).partitions_def.name == "checkpoints_tiny"
    # the partitioned evaluations in a group of their own: the lineage group's "Materialize all" is no backfill
    assert graph.get(dg.AssetKey("checkpoint_eval")).group_name == "tiny_checkpoints"
    assert all(graph.get(dg.AssetKey(k)).partitions_def is None for k in LINEAGE)
    # the main job: the data observed, the six, the comparison (never the partitioned evaluations)
    job = defs.resolve_job_def("pipeline")
    assert {k.to_user_string() for k in job.asset_layer.selected_asset_keys} == (
        {*LINEAGE, "data_sources", "experiments/comparison"})
    assert defs.resolve_sensor_def("new_checkpoint_sensor") is not None
    assert defs.resolve_schedule_def("reevaluate_tiny").default_status == dg.DefaultScheduleStatus.RUNNING
    train = graph.get(dg.AssetKey("train_ckpt")).assets_def
    assert train.op.retry_policy is not None and train.op.retry_policy.max_retries >= 1
    assert train.op.pool == TRAINING_POOL
    assert graph.get(dg.AssetKey("checkpoint_eval")).assets_def.op.pool == EVALUATION_POOL
    # every artifact a later stage reads is checked; the token cache and the training block what follows
    checks = {(k.asset_key.to_user_string(), k.name) for k in graph.asset_check_keys}
    assert checks == {("token_cache", "token_ids_and_counts"), ("train_ckpt", "final_loss"),
                      ("eval_report", "bpb_vs_unigram"), ("hf_export", "loads_in_transformers")}
    blocking = {k.asset_key.to_user_string() for k in graph.asset_check_keys if graph.get_check_spec(k).blocking}
    assert blocking == {"token_cache", "train_ckpt"}


STAGES = (*LINEAGE, "data_sources", "checkpoint_eval")


def _view(defs: dg.Definitions, names=("gpt", "llama")) -> dict[str, tuple]:
    """Per asset of the experiments: (code version, parents), what staleness is computed from."""
    graph = _graph(defs)
    return {f"{n}/{s}": (graph.get(dg.AssetKey([n, s])).code_version,
                         frozenset(_parents(graph, f"{n}/{s}"))) for n in names for s in STAGES}


def test_two_experiments_each_keep_their_own_keys_and_share_artifacts_by_address(tmp_path):
    exps = load_experiments(pt.write_experiments(tmp_path), overrides=[])
    defs = build_definitions(exps)
    graph = _graph(defs)
    # no experiment is named default: every key is <experiment>/<stage>
    assert _keys(defs) == {f"{e}/{s}" for e in ("gpt", "llama") for s in STAGES} | {"experiments/comparison"}
    for e in ("gpt", "llama"):
        for stage, parents in EDGES.items():
            assert _parents(graph, f"{e}/{stage}") == {f"{e}/{p}" for p in parents} | {f"{e}/data_sources"}
        assert {graph.get(dg.AssetKey([e, s])).group_name for s in STAGES if s != "checkpoint_eval"} == {e}
        assert graph.get(dg.AssetKey([e, "checkpoint_eval"])).group_name == f"{e}_checkpoints"
    # the data, tokenizer and cache are the same artifacts: same code version, shown as shared
    other = {"gpt": "llama", "llama": "gpt"}
    for stage in ("raw_shards", "tokenizer", "token_cache"):
        versions = {e.pipeline().config_version(stage) for e in exps}
        assert versions == {graph.get(dg.AssetKey([n, stage])).code_version for n in other}
        for n in other:
            node = graph.get(dg.AssetKey([n, stage]))
            assert node.metadata["shared_with"].value == f"{other[n]}/{stage}"
            assert f"shared_with/{other[n]}" in node.tags
    for n in other:
        assert graph.get(dg.AssetKey([n, "train_ckpt"])).metadata["shared_with"].value == "none"
    assert exps[0].pipeline().config_version("train_ckpt") != exps[1].pipeline().config_version("train_ckpt")
    assert _parents(graph, "experiments/comparison") == {f"{e}/{s}" for e in ("gpt", "llama") for s in ("train_ckpt", "eval_report")}
    jobs = {j.name: {k.to_user_string() for k in j.asset_layer.selected_asset_keys} for j in defs.resolve_all_job_defs()
            if not j.name.startswith("__")}
    assert jobs["pipeline_llama"] == {f"llama/{s}" for s in (*LINEAGE, "data_sources")}
    assert jobs["pipeline"] == (jobs["pipeline_gpt"] | jobs["pipeline_llama"] | {"experiments/comparison"})
    assert jobs["evaluate_gpt"] == {"gpt/checkpoint_eval"}
    assert jobs["observe_data_sources"] == {"gpt/data_sources", "llama/data_sources"}


def test_editing_one_experiment_changes_only_its_own_assets(tmp_path):
    """An asset's key, parents and code version never depend on another experiment: editing
    llama's tokenizer (it then shares nothing with gpt) changes llama's versions from the
    tokenizer down and nothing of gpt; reverting restores every version."""
    folder = pt.write_experiments(tmp_path)
    before = _view(build_definitions(load_experiments(folder, overrides=[])))
    llama = folder / "llama.yaml"
    text = llama.read_text()
    cfg = yaml.safe_load(text)
    cfg["data"]["tokenizer"]["vocab_size"] = 320
    llama.write_text(yaml.safe_dump(cfg))
    defs = build_definitions(load_experiments(folder, overrides=[]))
    after = _view(defs)
    assert set(after) == set(before)  # the same keys, and the same parents for every one
    assert {k: v[1] for k, v in after.items()} == {k: v[1] for k, v in before.items()}
    changed = {k for k in before if after[k][0] != before[k][0]}
    assert changed == {f"llama/{s}" for s in ("tokenizer", "token_cache", "train_ckpt", "eval_report", "hf_export")}
    graph = _graph(defs)
    assert graph.get(dg.AssetKey(["gpt", "tokenizer"])).metadata["shared_with"].value == "none"
    assert graph.get(dg.AssetKey(["gpt", "raw_shards"])).metadata["shared_with"].value == "llama/raw_shards"
    llama.write_text(text)
    assert _view(build_definitions(load_experiments(folder, overrides=[]))) == before


def test_the_default_experiment_keeps_the_bare_stage_names(tmp_path, monkeypatch):
    """``default.yaml`` of a folder (or the one file of $LM_PIPELINE_EXPERIMENT) is the default
    experiment: ``--select train_ckpt`` names its training; the others are prefixed."""
    folder = pt.write_experiments(tmp_path, {"default": {}, "llama": {"model": pt.TINY_LLAMA}})
    keys = _keys(build_definitions(load_experiments(folder, overrides=[])))
    assert {*LINEAGE, "data_sources", "checkpoint_eval"} <= keys
    assert {f"llama/{s}" for s in (*LINEAGE, "data_sources", "checkpoint_eval")} <= keys
    assert not [k for k in keys if k.startswith("default/")]
    monkeypatch.delenv("LM_PIPELINE_EXPERIMENTS_DIR", raising=False)
    monkeypatch.setenv("LM_PIPELINE_EXPERIMENT", str(folder / "llama.yaml"))
    monkeypatch.setenv("LM_PIPELINE_OVERRIDES", "")
    assert default_experiment(load_experiments()) == "llama"  # one file alone is the default
    assert "train_ckpt" in _keys(build_definitions())
    with pytest.raises(ValueError, match="default experiment 'nope'"):
        Deployment(load_experiments(folder, overrides=[]), default="nope")


def test_code_versions_follow_the_semantic_config(experiment, tmp_path):
    base = {k: _graph(build_definitions(experiment)).get(dg.AssetKey(k)).code_version for k in LINEAGE}
    assert base == experiment.pipeline().config_versions()

    def versions(overrides: str) -> dict[str, str]:
        exp = load_experiment(experiment.path, overrides=overrides)
        g = _graph(build_definitions(exp))
        return {k: g.get(dg.AssetKey(k)).code_version for k in LINEAGE}

    def changed(v):
        return {k for k in LINEAGE if v[k] != base[k]}

    assert changed(versions("data.tokenizer.vocab_size=320")) == set(LINEAGE) - {"raw_shards"}
    assert changed(versions("optimizer.learning_rate=2e-3")) == {"train_ckpt", "eval_report", "hf_export"}
    assert changed(versions("trainer.log_every=1 data.num_workers=2 trainer.tracker=[]")) == set()


def test_experiments_come_from_files_and_the_environment(tmp_path, monkeypatch):
    folder = pt.write_experiments(tmp_path)
    monkeypatch.setenv("LM_PIPELINE_EXPERIMENTS_DIR", str(folder))
    monkeypatch.setenv("LM_PIPELINE_OVERRIDES", "model.num_layers=2 optimizer.learning_rate=1e-3 'data.tokenizer.special_tokens=[\"<eos>\"]'")
    exps = load_experiments()
    assert [e.name for e in exps] == ["gpt", "llama"]
    for exp in exps:  # the overrides apply to every experiment
        assert exp.cfg.model.num_layers == 2 and exp.cfg.optimizer.learning_rate == 1e-3
        assert exp.cfg.data.tokenizer.special_tokens == ("<eos>",)
        assert exp.store_root == str(tmp_path / "store")
    single = pt.write_config(tmp_path)
    monkeypatch.setenv("LM_PIPELINE_EXPERIMENT", str(single))  # one file only
    assert [e.path for e in load_experiments()] == [str(single)]
    for var in ("LM_PIPELINE_EXPERIMENT", "LM_PIPELINE_OVERRIDES", "LM_PIPELINE_EXPERIMENTS_DIR"):
        monkeypatch.delenv(var)
    default = load_experiments()
    assert [e.name for e in default] == sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.yaml"))
    assert len(default) >= 2 and all(e.cfg.data.builtin == "python_stdlib" for e in default)
    assert all(Path(e.store_root).is_absolute() for e in default)
    # the default experiments share their data and tokenizer (the same artifacts), each with its own keys
    dep = Deployment(default)
    assert dep.key("default", "tokenizer").to_user_string() == "tokenizer"
    assert dep.key("llama", "tokenizer").to_user_string() == "llama/tokenizer"
    assert dep.shared_with("default", "tokenizer") == ["llama"]
    with pytest.raises(ValueError, match="section.field=value"):
        parse_override_text("model.num_layers")


def test_bad_experiment_files_fail_naming_the_file(tmp_path):
    folder = pt.write_experiments(tmp_path, {"gpt": {}})
    (folder / "gpt.yml").write_text((folder / "gpt.yaml").read_text())
    with pytest.raises(ValueError, match=r"two experiments are named 'gpt'.*gpt\.yml"):
        load_experiments(folder, overrides=[])
    (folder / "gpt.yml").unlink()
    (folder / "my-run.yaml").write_text((folder / "gpt.yaml").read_text())
    with pytest.raises(ValueError, match=r"my-run\.yaml.*rename the file, e\.g\. to my_run\.yaml"):
        load_experiments(folder, overrides=[])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_experiments(tmp_path / "nowhere", overrides=[])


def test_default_experiment_is_small_and_needs_no_download():
    cfg = load_experiment(DEFAULT_EXPERIMENT, overrides=[]).cfg
    assert cfg.data.builtin == "python_stdlib" and not cfg.data.train_urls and cfg.data.hf_id is None
    assert 200 <= cfg.trainer.num_train_steps <= 400
    assert cfg.model.num_layers <= 4 and cfg.model.hidden_dim <= 256
    assert cfg.data.shard_group_size == 1  # the fan-out has several groups to run in parallel


def test_a_new_experiment_file_shows_when_the_code_location_reloads(tmp_path, monkeypatch):
    import importlib

    folder = pt.write_experiments(tmp_path, {"gpt": {}})
    monkeypatch.delenv("LM_PIPELINE_EXPERIMENT", raising=False)
    monkeypatch.setenv("LM_PIPELINE_EXPERIMENTS_DIR", str(folder))
    monkeypatch.setenv("LM_PIPELINE_OVERRIDES", "trainer.num_train_steps=9")
    import assets.definitions as mod

    mod = importlib.reload(mod)
    assert "llama/train_ckpt" not in _keys(mod.defs)
    pt.write_experiments(tmp_path, {"llama": {"model": pt.TINY_LLAMA}})
    mod = importlib.reload(mod)  # what the UI's "Reload" does: the module is loaded again
    g = mod.defs.resolve_asset_graph()
    assert {"gpt/train_ckpt", "llama/train_ckpt", "llama/tokenizer", "gpt/tokenizer"} <= _keys(mod.defs)
    exp = {e.name: e for e in load_experiments()}["llama"]
    assert g.get(dg.AssetKey(["llama", "train_ckpt"])).code_version == exp.pipeline().config_version("train_ckpt")
    assert exp.cfg.trainer.num_train_steps == 9


# --------------------------------------------------------------------------------------------
# sensor and schedule
# --------------------------------------------------------------------------------------------


def _report_checkpoint(instance: dg.DagsterInstance, fp: str, step: int, kind: str = "permanent",
                       asset: str = "train_ckpt") -> str:
    from assets.metadata import checkpoint_observation

    key = checkpoint_key(fp, step)
    c = {"step": step, "path": f"/runs/{fp}/step-{step}", "kind": kind}
    instance.report_runless_asset_event(dg.AssetObservation(
        asset_key=dg.AssetKey.from_user_string(asset),
        metadata=checkpoint_observation(c, run_fingerprint=fp, partition_key=key)))
    return key


def _apply(instance: dg.DagsterInstance, result: dg.SensorResult) -> None:
    """What the daemon does with a sensor result's partition requests."""
    for req in result.dynamic_partitions_requests or []:
        instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))


def test_checkpoint_key_roundtrip():
    key = checkpoint_key("0123abcd0123abcd", 200)
    assert key == "0123abcd0123abcd-step0000200"
    assert parse_checkpoint_key(key) == ("0123abcd0123abcd", 200)
    with pytest.raises(ValueError):
        parse_checkpoint_key("nope")


def test_sensor_requests_each_new_checkpoint_exactly_once():
    instance = dg.DagsterInstance.ephemeral()
    # a run still training: two checkpoints reported, no materialization of train_ckpt yet
    k100 = _report_checkpoint(instance, "aaaa", 100)
    k200 = _report_checkpoint(instance, "aaaa", 200)
    _report_checkpoint(instance, "aaaa", 250, kind="temporary")  # pruned once a newer one lands
    first = checkpoint_requests(instance, None)
    assert [r.partition_key for r in first.run_requests] == [k100, k200]
    assert [r.run_key for r in first.run_requests] == [k100, k200]
    assert first.run_requests[0].tags[CHECKPOINT_TAG] == "/runs/aaaa/step-100"
    assert list(first.dynamic_partitions_requests[0].partition_keys) == [k100, k200]
    _apply(instance, first)

    # nothing new: nothing requested, even from the start (the partitions exist) or a stale cursor
    assert checkpoint_requests(instance, first.cursor).run_requests == []
    assert checkpoint_requests(instance, None).run_requests == []

    # the same checkpoint reported again (e.g. by a retried run) and a new one
    _report_checkpoint(instance, "aaaa", 200)
    k300 = _report_checkpoint(instance, "aaaa", 300)
    kb = _report_checkpoint(instance, "bbbb", 100)
    second = checkpoint_requests(instance, first.cursor)
    assert [r.partition_key for r in second.run_requests] == [k300, kb]
    _apply(instance, second)
    assert checkpoint_requests(instance, second.cursor).run_requests == []
    assert set(instance.get_dynamic_partitions("checkpoints")) == {k100, k200, k300, kb}


def test_a_tick_past_the_limit_advances_its_cursor_and_the_next_requests_the_rest():
    """More new checkpoints than one tick reads (``limit``): the tick requests the first ones and
    its cursor stops at the last one it read, so the next tick requests exactly the rest (a
    cursor that did not advance would re-read the same page forever and never evaluate them)."""
    instance = dg.DagsterInstance.ephemeral()
    keys = [_report_checkpoint(instance, "aaaa", step) for step in (10, 20, 30, 40, 50)]
    first = checkpoint_requests(instance, None, limit=3)
    assert [r.partition_key for r in first.run_requests] == keys[:3]
    read = instance.fetch_observations(dg.AssetRecordsFilter(asset_key=dg.AssetKey("train_ckpt")), limit=3,
                                       ascending=True).records
    assert json.loads(first.cursor) == {"train_ckpt": read[-1].storage_id}
    _apply(instance, first)
    second = checkpoint_requests(instance, first.cursor, limit=3)
    assert [r.partition_key for r in second.run_requests] == keys[3:]
    _apply(instance, second)
    third = checkpoint_requests(instance, second.cursor, limit=3)
    assert third.run_requests == [] and third.cursor == second.cursor


def test_sensor_requests_per_experiment_including_a_shared_training(tmp_path):
    instance = dg.DagsterInstance.ephemeral()
    keys = {dg.AssetKey(["a", "train_ckpt"]): ["a"], dg.AssetKey(["s", "train_ckpt"]): ["b", "c"]}
    ka = _report_checkpoint(instance, "aaaa", 10, asset="a/train_ckpt")
    ks = _report_checkpoint(instance, "ssss", 10, asset="s/train_ckpt")
    _report_checkpoint(instance, "zzzz", 10, asset="z/train_ckpt")  # not a training asset of this deployment
    first = checkpoint_requests(instance, None, train_keys=keys)
    got = sorted((r.job_name, r.partition_key, r.run_key, r.tags["lm_pipeline/experiment"]) for r in first.run_requests)
    assert got == [("evaluate_a", ka, f"a:{ka}", "a"), ("evaluate_b", ks, f"b:{ks}", "b"),
                   ("evaluate_c", ks, f"c:{ks}", "c")]
    assert {r.partitions_def_name: list(r.partition_keys) for r in first.dynamic_partitions_requests} == {
        "checkpoints_a": [ka], "checkpoints_b": [ks], "checkpoints_c": [ks]}
    _apply(instance, first)
    assert checkpoint_requests(instance, first.cursor, train_keys=keys).run_requests == []
    assert checkpoint_requests(instance, None, train_keys=keys).run_requests == []  # the partitions exist
    k2 = _report_checkpoint(instance, "aaaa", 20, asset="a/train_ckpt")
    assert [r.partition_key for r in checkpoint_requests(instance, first.cursor, train_keys=keys).run_requests] == [k2]


def test_sensor_definition_evaluates_with_a_cursor(experiment):
    defs = build_definitions(experiment)
    sensor = defs.resolve_sensor_def("new_checkpoint_sensor")
    instance = dg.DagsterInstance.ephemeral()
    key = _report_checkpoint(instance, "cccc", 3, asset="train_ckpt")  # the one experiment's: bare keys
    ctx = dg.build_sensor_context(instance=instance, definitions=defs)
    result = sensor(ctx)
    assert [(r.partition_key, r.job_name) for r in result.run_requests] == [(key, "evaluate_tiny")]
    _apply(instance, result)
    ctx = dg.build_sensor_context(instance=instance, cursor=result.cursor, definitions=defs)
    assert sensor(ctx).run_requests == []


def test_the_comparison_refreshes_by_declarative_automation_once_per_input_update(tmp_path):
    """The comparison's AutomationCondition as Dagster evaluates it: nothing before any input is
    materialized; one request after an evaluation report, a training run or a task evaluation it
    reads is; none again until another is; none for assets it does not read (a checkpoint's
    evaluation, a token cache)."""
    defs = build_definitions(load_experiments(pt.write_experiments(tmp_path), overrides=[]))
    sensor = defs.resolve_sensor_def("comparison_automation")
    assert isinstance(sensor, dg.AutomationConditionSensorDefinition)
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    instance = dg.DagsterInstance.ephemeral()
    comparison = dg.AssetKey(["experiments", "comparison"])

    def tick(cursor):
        result = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor)
        return result.get_num_requested(comparison), result.cursor

    requested, cursor = tick(None)
    assert requested == 0  # nothing evaluated yet
    instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=["llama", "eval_report"]))
    requested, cursor = tick(cursor)
    assert requested == 1
    assert tick(cursor)[0] == 0  # handled: no second request for the same update
    for key in (["gpt", "checkpoint_eval"], ["gpt", "token_cache"]):  # not read by the comparison
        instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=key))
    requested, cursor = tick(cursor)
    assert requested == 0
    instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=["gpt", "train_ckpt"]))
    assert tick(cursor)[0] == 1


def test_latest_checkpoint_of_each_run():
    keys = [checkpoint_key("aaaa", 100), checkpoint_key("aaaa", 300), checkpoint_key("aaaa", 200),
            checkpoint_key("bbbb", 50)]
    assert latest_checkpoint_keys(keys) == [checkpoint_key("aaaa", 300), checkpoint_key("bbbb", 50)]


def test_reevaluation_schedule_ticks_green_in_dagsters_scheduler_with_three_runs(tmp_path, monkeypatch):
    """The schedules as the scheduler daemon runs them: the code location loaded in its own code
    server, a tick before and one after 03:00, runs created through the instance's queue (queued,
    not launched: no run is executed here). Dagster checks the run keys of a tick itself."""
    import datetime
    import logging

    from dagster._core.scheduler.instigation import TickStatus
    from dagster._core.test_utils import create_test_daemon_workspace_context, freeze_time, instance_for_test
    from dagster._core.workspace.load_target import ModuleTarget
    from dagster._scheduler.scheduler import launch_scheduled_runs

    folder = pt.write_experiments(tmp_path, {"gpt": {}})
    monkeypatch.setenv("LM_PIPELINE_EXPERIMENTS_DIR", str(folder))
    monkeypatch.delenv("LM_PIPELINE_EXPERIMENT", raising=False)
    monkeypatch.setenv("LM_PIPELINE_OVERRIDES", "")
    runs = {fp: [checkpoint_key(fp, s) for s in (3, 6)] for fp in ("aaaa", "bbbb", "cccc")}
    queued = {"run_coordinator": {"module": "dagster._core.run_coordinator", "class": "QueuedRunCoordinator"}}
    with instance_for_test(overrides=queued) as instance:
        instance.add_dynamic_partitions("checkpoints_gpt", [k for ks in runs.values() for k in ks])
        target = ModuleTarget(module_name="assets.definitions", attribute=None, working_directory=str(pt.REPO),
                              location_name="lm_pipeline")
        with create_test_daemon_workspace_context(target, instance) as ctx:
            for t in (datetime.datetime(2026, 11, 24, 2, 59, tzinfo=datetime.UTC),
                      datetime.datetime(2026, 11, 24, 3, 0, 30, tzinfo=datetime.UTC)):
                with freeze_time(t):
                    list(launch_scheduled_runs(ctx, logging.getLogger("scheduler"), t, {}))
            ticks = {st.instigator_name: instance.get_ticks(st.instigator_origin_id, st.selector_id)
                     for st in instance.all_instigator_state()}
            got = sorted((r.job_name, r.tags.get("dagster/partition")) for r in instance.get_runs())
    reeval = ticks["reevaluate_gpt"]
    assert [t.status for t in reeval] == [TickStatus.SUCCESS], [t.error for t in reeval]
    assert sorted(reeval[0].run_keys) == [f"gpt:{checkpoint_key(fp, 6)}@2026-11-24T03:00" for fp in runs]
    assert ("evaluate_gpt", checkpoint_key("aaaa", 3)) not in got  # the latest checkpoint of each run only
    assert [g for g in got if g[0] == "evaluate_gpt"] == [("evaluate_gpt", checkpoint_key(fp, 6)) for fp in runs]
    assert [t.status for t in ticks["observe_data_sources"]] == [TickStatus.SUCCESS]
    assert ("observe_data_sources", None) in got


def test_python_m_assets_maps_to_dagster_commands(tmp_path, monkeypatch):
    from assets import __main__ as cli

    assert cli.dagster_args(["materialize"]) == ["job", "execute", "-m", "assets.definitions", "-j", "pipeline"]
    assert cli.dagster_args(["materialize", "--select", "train_ckpt"]) == [
        "asset", "materialize", "-m", "assets.definitions", "--select", "train_ckpt"]
    assert cli.dagster_args(["dev", "-p", "3001"]) == ["dev", "-m", "assets.definitions", "-p", "3001"]
    env = {"DAGSTER_HOME": str(tmp_path / "home")}
    home = cli.ensure_home(env)
    assert home == tmp_path / "home" and (home / "dagster.yaml").is_file()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    instance = dg.DagsterInstance.get()  # the template is a valid SQLite instance config
    try:
        assert type(instance.run_storage).__name__ == "SqliteRunStorage"
        # one training step and one evaluation step at a time (pools), two runs at a time (queue)
        conf = instance.get_concurrency_config()
        assert conf.pool_config.default_pool_limit == 1 and conf.run_queue_config.max_concurrent_runs == 2
        for pool in (TRAINING_POOL, EVALUATION_POOL):
            assert instance.event_log_storage.get_concurrency_info(pool).limit == 1
    finally:
        instance.dispose()
    monkeypatch.setattr(cli, "DEFAULT_HOME", tmp_path / "repo_home")  # stands in for <repo>/.dagster_home
    env = {}
    assert cli.ensure_home(env) == tmp_path / "repo_home" and env["DAGSTER_HOME"] == str(tmp_path / "repo_home")
    assert (tmp_path / "repo_home" / "dagster.yaml").is_file()


# --------------------------------------------------------------------------------------------
# resources
# --------------------------------------------------------------------------------------------


def test_runtime_resources_change_only_non_semantic_fields(experiment, monkeypatch):
    from lm_pipeline.launch import find_tcmalloc
    from resources import (
        JaxRuntimeResource,
        TrackingResource,
        TrainingLauncherResource,
        apply_runtime_overrides,
    )

    jax_rt = JaxRuntimeResource(platforms="cpu", model_axis_size=1, coordinator_address="10.0.0.1:1234",
                                num_processes=2, process_id=1)
    tracking = TrackingResource(wandb_project="lm", wandb_mode="offline", tensorboard=True)
    cfg = apply_runtime_overrides(experiment.cfg, jax_rt, tracking)
    assert cfg.trainer.distributed.coordinator_address == "10.0.0.1:1234" and cfg.trainer.distributed.num_processes == 2
    assert [t.type for t in cfg.trainer.tracker] == ["wandb", "tensorboard"]
    assert cfg.trainer.tracker[0].project == "lm" and cfg.trainer.tracker[0].mode == "offline"
    assert jax_rt.env() == {"JAX_PLATFORMS": "cpu"}
    from lm_pipeline.steps import Pipeline

    assert Pipeline(cfg).config_versions() == Pipeline(experiment.cfg).config_versions()
    assert apply_runtime_overrides(experiment.cfg, JaxRuntimeResource(), TrackingResource()) is experiment.cfg

    launcher = TrainingLauncherResource(extra_env={"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"})
    env = launcher.child_env()
    assert env["XLA_FLAGS"] == "--xla_cpu_multi_thread_eigen=false"
    lib = find_tcmalloc()
    assert env.get("LD_PRELOAD") == lib if lib else "LD_PRELOAD" not in env
    assert "LD_PRELOAD" not in TrainingLauncherResource(preload_tcmalloc=False).child_env()
    assert launcher.command()[1:] == ["-m", "lm_pipeline.pipes_train"]
    monkeypatch.setenv("LM_PIPELINE_TRAIN_MODE", "in_process")
    assert TrainingLauncherResource.from_env().mode == "in_process"
    with pytest.raises(dg.Failure):
        TrainingLauncherResource(mode="ssh").validate_mode()


def test_training_plots_are_written_beside_the_run(tmp_path):
    import json

    from lm_pipeline.plots import write_eval_plot, write_training_plots

    assert write_training_plots(str(tmp_path)) == []  # no metrics: no plots, no error
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": s, "train/loss": 5.0 - s / 10, "optim/learning_rate": 1e-3 * s / 10,
         "throughput/tokens_per_second": 1000.0 + s, "throughput/step_seconds": 0.1} for s in range(2, 12, 2)] + [
        {"step": s, "eval/loss": 4.0 - s / 10, "eval/a/bpb": 3.0 - s / 10, "eval/b/bpb": 3.5 - s / 10} for s in (5, 10)])
        + "{torn")
    paths = write_training_plots(str(tmp_path))
    assert sorted(Path(p).name for p in paths) == ["eval_bpb.png", "learning_rate.png", "loss.png",
                                                     "tokens_per_second.png"]
    for p in paths:
        assert Path(p).parent == tmp_path / "plots" and Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [{"dataset": d, "step": s, "bpb": 2.0} for d in ("a", "b", "_macro") for s in (3, 6)]
    out = write_eval_plot(rows, str(tmp_path / "eval" / "bpb.png"))
    assert out and Path(out).stat().st_size > 1000
    assert write_eval_plot([], str(tmp_path / "none.png")) is None
