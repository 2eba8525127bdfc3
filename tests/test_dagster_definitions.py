"""The Dagster definitions without running the pipeline: assets and lineage, code versions from
the experiment (env vars), jobs, the checkpoint sensor (exactly once, cursor) and the schedule."""

from __future__ import annotations

import sys
from pathlib import Path

import dagster as dg
import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import pipeline_testing as pt  # noqa: E402

from assets.experiment import DEFAULT_EXPERIMENT, load_experiment, parse_override_text  # noqa: E402
from assets.pipeline import (  # noqa: E402
    CHECKPOINT_TAG,
    CHECKPOINTS,
    LINEAGE,
    build_definitions,
    checkpoint_key,
    checkpoint_requests,
    latest_checkpoint_keys,
    parse_checkpoint_key,
)

EDGES = {
    "raw_shards": set(), "tokenizer": {"raw_shards"}, "token_cache": {"raw_shards", "tokenizer"},
    "train_ckpt": {"token_cache"}, "eval_report": {"train_ckpt", "token_cache"}, "hf_export": {"train_ckpt"},
    "checkpoint_eval": {"train_ckpt"},
}


@pytest.fixture
def experiment(tmp_path):
    return load_experiment(pt.write_config(tmp_path), overrides=[])


def _graph(defs: dg.Definitions):
    return defs.resolve_asset_graph()


def test_six_lineage_assets_and_checkpoint_evals(experiment):
    defs = build_definitions(experiment)
    graph = _graph(defs)
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert keys == set(LINEAGE) | {"checkpoint_eval"}
    for key, parents in EDGES.items():
        assert {p.to_user_string() for p in graph.get(dg.AssetKey(key)).parent_keys} == parents, key
    assert {graph.get(dg.AssetKey(k)).group_name for k in LINEAGE} == {"pipeline"}
    assert graph.get(dg.AssetKey("checkpoint_eval")).partitions_def == CHECKPOINTS
    assert all(graph.get(dg.AssetKey(k)).partitions_def is None for k in LINEAGE)
    # the named job holds exactly the six (the CLI cannot mix in the partitioned asset)
    job = defs.resolve_job_def("pipeline")
    assert {k.to_user_string() for k in job.asset_layer.selected_asset_keys} == set(LINEAGE)
    assert defs.resolve_sensor_def("new_checkpoint_sensor") is not None
    assert defs.resolve_schedule_def("reevaluate_latest_checkpoints") is not None
    retry = graph.get(dg.AssetKey("train_ckpt")).assets_def.op.retry_policy
    assert retry is not None and retry.max_retries >= 1


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


def test_experiment_and_overrides_come_from_the_environment(tmp_path, monkeypatch):
    path = pt.write_config(tmp_path)
    monkeypatch.setenv("LM_PIPELINE_EXPERIMENT", str(path))
    monkeypatch.setenv("LM_PIPELINE_OVERRIDES", "model.num_layers=2 optimizer.learning_rate=1e-3 'data.tokenizer.special_tokens=[\"<eos>\"]'")
    exp = load_experiment()
    assert exp.path == str(path)
    assert exp.cfg.model.num_layers == 2 and exp.cfg.optimizer.learning_rate == 1e-3
    assert exp.cfg.data.tokenizer.special_tokens == ("<eos>",)
    assert exp.store_root == str(tmp_path / "store")
    monkeypatch.delenv("LM_PIPELINE_EXPERIMENT")
    monkeypatch.delenv("LM_PIPELINE_OVERRIDES")
    default = load_experiment()
    assert default.path == str(DEFAULT_EXPERIMENT) and default.cfg.data.builtin == "python_stdlib"
    assert Path(default.store_root).is_absolute()
    with pytest.raises(ValueError, match="section.field=value"):
        parse_override_text("model.num_layers")


def test_default_experiment_is_small_and_needs_no_download():
    cfg = load_experiment(DEFAULT_EXPERIMENT, overrides=[]).cfg
    assert cfg.data.builtin == "python_stdlib" and not cfg.data.train_urls and cfg.data.hf_id is None
    assert 200 <= cfg.trainer.num_train_steps <= 400
    assert cfg.model.num_layers <= 4 and cfg.model.hidden_dim <= 256
    assert cfg.data.shard_group_size == 1  # the fan-out has several groups to run in parallel


def test_definitions_module_loads_the_env_experiment(tmp_path, monkeypatch):
    import importlib

    monkeypatch.setenv("LM_PIPELINE_EXPERIMENT", str(pt.write_config(tmp_path)))
    monkeypatch.setenv("LM_PIPELINE_OVERRIDES", "trainer.num_train_steps=9")
    import assets.definitions as mod

    mod = importlib.reload(mod)
    g = mod.defs.resolve_asset_graph()
    exp = load_experiment()
    assert g.get(dg.AssetKey("train_ckpt")).code_version == exp.pipeline().config_version("train_ckpt")
    assert exp.cfg.trainer.num_train_steps == 9


# --------------------------------------------------------------------------------------------
# sensor and schedule
# --------------------------------------------------------------------------------------------


def _report_checkpoint(instance: dg.DagsterInstance, fp: str, step: int, kind: str = "permanent") -> str:
    from assets.metadata import checkpoint_observation

    key = checkpoint_key(fp, step)
    c = {"step": step, "path": f"/runs/{fp}/step-{step}", "kind": kind}
    instance.report_runless_asset_event(dg.AssetObservation(
        asset_key="train_ckpt", metadata=checkpoint_observation(c, run_fingerprint=fp, partition_key=key)))
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


def test_sensor_definition_evaluates_with_a_cursor(experiment):
    defs = build_definitions(experiment)
    sensor = defs.resolve_sensor_def("new_checkpoint_sensor")
    instance = dg.DagsterInstance.ephemeral()
    key = _report_checkpoint(instance, "cccc", 3)
    ctx = dg.build_sensor_context(instance=instance, definitions=defs)
    result = sensor(ctx)
    assert [r.partition_key for r in result.run_requests] == [key]
    _apply(instance, result)
    ctx = dg.build_sensor_context(instance=instance, cursor=result.cursor, definitions=defs)
    assert sensor(ctx).run_requests == []


def test_schedule_reevaluates_the_latest_checkpoint_of_each_run(experiment):
    keys = [checkpoint_key("aaaa", 100), checkpoint_key("aaaa", 300), checkpoint_key("aaaa", 200),
            checkpoint_key("bbbb", 50)]
    assert latest_checkpoint_keys(keys) == [checkpoint_key("aaaa", 300), checkpoint_key("bbbb", 50)]
    defs = build_definitions(experiment)
    schedule = defs.resolve_schedule_def("reevaluate_latest_checkpoints")
    with dg.instance_for_test() as instance:
        empty = schedule(dg.build_schedule_context(instance=instance))
        assert isinstance(empty, dg.SkipReason)
        instance.add_dynamic_partitions("checkpoints", keys)
        requests = schedule(dg.build_schedule_context(instance=instance))
    assert sorted(r.partition_key for r in requests) == sorted([checkpoint_key("aaaa", 300), checkpoint_key("bbbb", 50)])
    assert all(r.run_key is None for r in requests)  # re-evaluation: runs every time (a cache hit if unchanged)


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
