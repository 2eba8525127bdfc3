"""Two experiments in one deployment, through Dagster's instance: the artifacts they share
are built once (the second experiment's materialization a recorded cache hit); per kind of change (data content, tokenizer, model, optimizer, eval, log-only,
revert) the stale set is the expected one for both; a stage whose upstream is not what Dagster
recorded never records a false lineage; the comparison shows both; all of it on PostgreSQL too."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._core.loader import LoadingContextForTest
from helpers import pipeline as pt

from assets.deployment import Deployment
from assets.experiment import load_experiments
from assets.pipeline import (
    LINEAGE,
    OBSERVE_JOB,
    PIPELINE_JOB,
    build_definitions,
    checkpoint_key,
)
from resources import TrainingLauncherResource

pytestmark = pytest.mark.filterwarnings("ignore::dagster.BetaWarning")
NAMES = ("gpt", "llama")
SHARED = ("raw_shards", "tokenizer", "token_cache")
OWN = ("train_ckpt", "eval_report", "hf_export")


class Deployed:
    """The two tiny experiments of ``pt.write_experiments`` over one Dagster instance."""

    def __init__(self, tmp: Path, instance: dg.DagsterInstance):
        self.tmp = tmp
        self.folder = pt.write_experiments(tmp)
        self.instance = instance

    def defs(self, overrides: str = "") -> dg.Definitions:
        exps = load_experiments(self.folder, overrides=overrides)
        return build_definitions(exps, resources={"training": TrainingLauncherResource(mode="in_process", poll_seconds=0.2)},
                                 executor=dg.in_process_executor)

    def run(self, job: str = PIPELINE_JOB, overrides: str = "", **kw):
        return self.defs(overrides).resolve_job_def(job).execute_in_process(instance=self.instance, **kw)

    def dep(self, overrides: str = "") -> Deployment:
        return Deployment(load_experiments(self.folder, overrides=overrides))

    def stale(self, overrides: str = "") -> dict[str, StaleStatus]:
        """``<experiment>/<stage>`` -> the status the UI shows once the definitions reload."""
        dep = self.dep(overrides)
        graph = self.defs(overrides).resolve_asset_graph()
        resolver = CachingStaleStatusResolver(self.instance, graph, LoadingContextForTest(self.instance))
        return {f"{n}/{s}": resolver.get_status(dep.key(n, s)) for n in NAMES for s in LINEAGE}

    def misses(self, overrides: str = "") -> set[str]:
        """``<experiment>/<stage>`` that ``lm-pipeline plan`` reports as MISS (to be rebuilt)."""
        from lm_pipeline.store import ArtifactStore

        out = set()
        for exp in load_experiments(self.folder, overrides=overrides):
            rows = exp.fresh_pipeline(ArtifactStore(exp.store_root)).plan()
            out |= {f"{exp.name}/{r['stage']}" for r in rows if not r["hit"]}
        return out

    def agrees(self, overrides: str = "") -> dict[str, StaleStatus]:
        """The UI's stale set, after checking it is the plan's set of misses."""
        stale = self.stale(overrides)
        assert {k for k, v in stale.items() if v == StaleStatus.STALE} == self.misses(overrides)
        return stale

    def edit(self, name: str, section: str, **values) -> str:
        """Edit one experiment's file; returns its old text (to revert)."""
        path = self.folder / f"{name}.yaml"
        old = path.read_text()
        cfg = yaml.safe_load(old)
        cfg[section].update(values)
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return old


def _expect(stale: set[str]) -> dict[str, StaleStatus]:
    return {f"{n}/{s}": StaleStatus.STALE if f"{n}/{s}" in stale else StaleStatus.FRESH for n in NAMES for s in LINEAGE}


def _both(*stages: str) -> set[str]:
    return {f"{n}/{s}" for n in NAMES for s in stages}


def _materializations(result) -> dict[str, list]:
    out: dict[str, list] = {}
    for e in result.all_events:
        if e.event_type_value == "ASSET_MATERIALIZATION":
            out.setdefault(e.asset_key.to_user_string(), []).append(e.event_specific_data.materialization)
    return out


@pytest.mark.slow  # two experiments through Dagster, several materializations: ~25 s
def test_two_experiments_share_stages_and_go_stale_exactly_as_the_plan_says(tmp_path):
    d = Deployed(tmp_path, dg.DagsterInstance.ephemeral())
    first = d.run()
    assert first.success
    mats = _materializations(first)
    # the shared artifacts are built once: each experiment's asset materializes once, one a build,
    # the other a cache hit with the same data version, each saying whom it shares with
    for stage in SHARED:
        hits = sorted(mats[f"{n}/{stage}"][0].metadata["cache_hit"].value for n in NAMES)
        assert [len(mats[f"{n}/{stage}"]) for n in NAMES] == [1, 1] and hits == [False, True], stage
        assert len({mats[f"{n}/{stage}"][0].tags["dagster/data_version"] for n in NAMES}) == 1
        assert mats[f"gpt/{stage}"][0].metadata["shared_with"].value == f"llama/{stage}"
        assert mats[f"llama/{stage}"][0].metadata["experiment"].value == "llama"
    raw = mats["gpt/raw_shards"][0].metadata
    assert raw["data_summary"].value == (f"kept {raw['valid'].value} of {raw['records'].value} records "
                                         f"(train {raw['valid'].value - 2}, validation 2); skipped 0")
    for n in NAMES:
        for stage in OWN:
            assert [m.metadata["cache_hit"].value for m in mats[f"{n}/{stage}"]] == [False]
    assert mats["gpt/train_ckpt"][0].tags["dagster/data_version"] != mats["llama/train_ckpt"][0].tags["dagster/data_version"]
    # provenance: the config of *that* artifact and the inputs it read, as Dagster recorded them
    llama_train = mats["llama/train_ckpt"][0]
    assert llama_train.metadata["semantic_config"].value["model"]["type"] == "llama"
    assert llama_train.metadata["shared_with"].value == "none"
    cache_fp = mats["llama/token_cache"][0].tags["dagster/data_version"]
    assert llama_train.metadata["input_fingerprints"].value["token_cache"] == cache_fp
    assert llama_train.tags["dagster/input_data_version/llama/token_cache"] == cache_fp
    chain = llama_train.metadata["lineage"].value  # the chain back to the shards, on the asset's page
    for stage in ("train_ckpt", "token_cache", "tokenizer", "raw_shards"):
        fp = mats[f"llama/{stage}"][0].tags["dagster/data_version"]
        assert f"{stage} {fp}" in chain or (stage in chain and fp in chain), (stage, chain[:2000])
    assert chain.index("token_cache") < chain.index("raw_shards")
    # the comparison holds both experiments, each beside its unigram baseline
    comp = mats["experiments/comparison"][0].metadata
    rows = {r.data["experiment"]: r.data for r in comp["comparison"].value.records}
    assert set(rows) == set(NAMES)
    for n in NAMES:
        assert rows[n]["bpb"] > 0 and rows[n]["unigram_bpb"] > 0 and rows[n]["params"] > 0
        assert comp["input_fingerprints"].value[f"{n}/eval_report"] == mats[f"{n}/eval_report"][0].tags["dagster/data_version"]
    assert rows["gpt"]["model"] == "gpt2" and rows["llama"]["model"] == "llama"
    assert comp["plot"].value.startswith("![")
    assert d.stale() == _expect(set())

    # per change kind, the stale set equals what `lm-pipeline plan` would re-run, for both
    assert d.agrees("data.tokenizer.vocab_size=320") == _expect(_both("tokenizer", "token_cache", *OWN))
    assert d.agrees("trainer.log_every=1") == _expect(set())  # log-only: nothing
    old = d.edit("gpt", "model", num_layers=2)  # one experiment's model
    assert d.agrees() == _expect({"gpt/train_ckpt", "gpt/eval_report", "gpt/hf_export"})
    (d.folder / "gpt.yaml").write_text(old)
    old = d.edit("llama", "optimizer", learning_rate=2e-3)  # the other's optimizer
    assert d.agrees() == _expect({"llama/train_ckpt", "llama/eval_report", "llama/hf_export"})
    (d.folder / "llama.yaml").write_text(old)
    cfg = yaml.safe_load((d.folder / "gpt.yaml").read_text())
    cfg["eval"] = {"batch_size": 2}  # evaluation settings: only the evaluation
    (d.folder / "gpt.yaml").write_text(yaml.safe_dump(cfg))
    assert d.agrees() == _expect({"gpt/eval_report"})
    (d.folder / "gpt.yaml").write_text(yaml.safe_dump({k: v for k, v in cfg.items() if k != "eval"}))
    assert d.agrees() == _expect(set())  # reverted

    # the data's content: a document appended to a training shard, seen once the source is observed
    shard = Path(yaml.safe_load((d.folder / "gpt.yaml").read_text())["data"]["train_urls"][0])
    text = shard.read_text()
    shard.write_text(text + json.dumps({"text": "def appended():\n    return 1\n"}) + "\n")
    assert d.stale() == _expect(set())  # not observed yet (the plan, which reads the data, already sees it)
    assert d.misses() == _both(*LINEAGE)
    assert d.run(OBSERVE_JOB).success
    assert d.agrees() == _expect(_both(*LINEAGE))
    shard.write_text(text)  # revert the data
    assert d.run(OBSERVE_JOB).success
    assert d.agrees() == _expect(set())

    # again with nothing changed: every stage a hit
    again = _materializations(d.run())
    assert all(m.metadata["cache_hit"].value for k, ms in again.items() if k != "experiments/comparison" for m in ms)


@pytest.mark.slow  # several Dagster materializations: ~35 s
def test_a_stage_never_records_a_lineage_it_did_not_use(tmp_path):
    """``--select gpt/train_ckpt`` after a tokenizer change: it fails naming what to materialize
    first, and records nothing -- also once the new token cache exists outside Dagster (built by
    the command line); materializing the cache (a hit) then lets the training record it."""
    d = Deployed(tmp_path, dg.DagsterInstance.ephemeral())
    assert d.run().success
    old_cache = d.instance.get_latest_materialization_event(dg.AssetKey(["gpt", "token_cache"]))
    vocab = "data.tokenizer.vocab_size=320"
    defs = d.defs(vocab)
    train = dg.AssetKey(["gpt", "train_ckpt"])
    job = defs.resolve_implicit_global_asset_job_def()
    before = d.instance.get_latest_materialization_event(train).timestamp
    result = job.execute_in_process(instance=d.instance, asset_selection=[train], raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    message = str(failure.step_failure_data.error.message)
    assert "materialize gpt/token_cache first" in message and "\n" not in message.strip()
    assert "python -m assets materialize" in message and "--select '*gpt/train_ckpt'" in message
    assert d.instance.get_latest_materialization_event(train).timestamp == before  # nothing recorded
    exp = {e.name: e for e in load_experiments(d.folder, overrides=vocab)}["gpt"]
    pipe = exp.fresh_pipeline(exp.pipeline().store)
    assert pipe.cached("train_ckpt") is None  # and nothing trained

    built = pipe.build("token_cache")  # outside Dagster (the command line's `lm-pipeline cache`)
    assert built.fingerprint != old_cache.asset_materialization.tags["dagster/data_version"]
    result = job.execute_in_process(instance=d.instance, asset_selection=[train], raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "complete in the store (a cache hit) but not recorded by Dagster: materialize gpt/token_cache first" in str(
        failure.step_failure_data.error.message)
    cache = dg.AssetKey(["gpt", "token_cache"])
    tok = dg.AssetKey(["gpt", "tokenizer"])
    assert job.execute_in_process(instance=d.instance, asset_selection=[tok, cache]).success
    result = job.execute_in_process(instance=d.instance, asset_selection=[train])
    assert result.success
    m = d.instance.get_latest_materialization_event(train).asset_materialization
    assert m.tags["dagster/input_data_version/gpt/token_cache"] == built.fingerprint
    assert m.metadata["input_fingerprints"].value["token_cache"] == built.fingerprint
    assert m.tags["dagster/data_version"] == pipe.address("train_ckpt").fingerprint
    recorded = d.instance.get_latest_materialization_event(cache).asset_materialization
    assert recorded.tags["dagster/data_version"] == built.fingerprint and recorded.metadata["cache_hit"].value is True


@pytest.mark.slow
def test_pipeline_and_checkpoint_sensor_on_postgresql(tmp_path, monkeypatch):
    from helpers.postgres import postgres_dagster_home, postgres_server

    with postgres_server() as server:
        home = postgres_dagster_home(tmp_path, server, template=pt.REPO / "assets" / "dagster.yaml")
        monkeypatch.setenv("DAGSTER_HOME", str(home))
        instance = dg.DagsterInstance.get()
        try:
            assert type(instance.run_storage).__name__ == "PostgresRunStorage"
            d = Deployed(tmp_path, instance)
            assert d.run().success
            defs = d.defs()
            sensor = defs.resolve_sensor_def("new_checkpoint_sensor")
            result = sensor(dg.build_sensor_context(instance=instance, definitions=defs))
            want = set()
            for n in NAMES:
                fp = instance.get_latest_materialization_event(dg.AssetKey([n, "train_ckpt"])).asset_materialization.tags[
                    "dagster/data_version"]
                want |= {(f"evaluate_{n}", checkpoint_key(fp, s)) for s in (3, 6)}
            assert {(r.job_name, r.partition_key) for r in result.run_requests} == want
            for req in result.dynamic_partitions_requests:
                instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
            again = sensor(dg.build_sensor_context(instance=instance, cursor=result.cursor, definitions=defs))
            assert again.run_requests == []
            # one requested evaluation runs against the Postgres instance
            req = sorted(result.run_requests, key=lambda r: r.partition_key)[0]
            run = defs.resolve_job_def(req.job_name).execute_in_process(
                instance=instance, partition_key=req.partition_key, tags=req.tags)
            assert run.success
            rows = server.query("select count(*) from runs")
            assert rows[0][0] >= 2
        finally:
            instance.dispose()


@pytest.mark.slow
def test_an_eval_settings_change_marks_every_checkpoint_evaluation_stale_and_a_backfill_reevaluates(tmp_path, monkeypatch):
    """Checkpoint evaluations of both checkpoints, then an edit to the experiment's eval settings:
    both partitions stale; ``dagster job backfill`` (runs launched by the instance, each in its
    own process) re-evaluates them and they are fresh again, with new reports."""
    import subprocess
    import time

    home = tmp_path / "home"
    home.mkdir()
    # runs are launched as they are submitted (no queue: no daemon runs in this test)
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\nrun_coordinator:\n"
                                       "  module: dagster._core.run_coordinator\n  class: DefaultRunCoordinator\n")
    folder = pt.write_experiments(tmp_path, {"gpt": {}})
    env = {**pt.subprocess_env(tmp_path, folder / "gpt.yaml", dagster_home=home), "LM_PIPELINE_EXPERIMENTS_DIR": str(folder)}
    env.pop("LM_PIPELINE_EXPERIMENT")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    instance = dg.DagsterInstance.get()
    try:
        d = Deployed.__new__(Deployed)
        d.tmp, d.folder, d.instance = tmp_path, folder, instance
        assert d.run("pipeline_gpt").success
        defs = d.defs()
        result = defs.resolve_sensor_def("new_checkpoint_sensor")(dg.build_sensor_context(instance=instance, definitions=defs))
        for req in result.dynamic_partitions_requests:
            instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
        keys = sorted(r.partition_key for r in result.run_requests)
        assert len(keys) == 2
        for req in result.run_requests:
            assert defs.resolve_job_def(req.job_name).execute_in_process(
                instance=instance, partition_key=req.partition_key, tags=req.tags).success
        evals = dg.AssetKey(["gpt", "checkpoint_eval"])

        def status() -> dict[str, StaleStatus]:
            graph = d.defs().resolve_asset_graph()
            resolver = CachingStaleStatusResolver(instance, graph, LoadingContextForTest(instance))
            return {k: resolver.get_status(evals, k) for k in keys}

        def versions() -> dict[str, str]:
            return {k: instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=evals, asset_partitions=[k]),
                                                    limit=1).records[0].asset_materialization.tags["dagster/data_version"]
                    for k in keys}

        assert status() == dict.fromkeys(keys, StaleStatus.FRESH)
        before = versions()
        cfg = yaml.safe_load((folder / "gpt.yaml").read_text())
        cfg["eval"] = {"batch_size": 2}
        (folder / "gpt.yaml").write_text(yaml.safe_dump(cfg))
        assert status() == dict.fromkeys(keys, StaleStatus.STALE)

        out = subprocess.run([pt.python(), "-m", "dagster", "job", "backfill", "-m", "assets.definitions",
                              "-j", "evaluate_gpt", "--partitions", ",".join(keys), "--noprompt"],
                             env=env, cwd=pt.REPO, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and "Launched backfill" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            runs = [r for r in instance.get_runs() if r.tags.get("dagster/backfill")]
            if len(runs) == 2 and all(r.is_finished for r in runs):
                break
            time.sleep(1)
        assert sorted(r.tags.get("dagster/partition") for r in runs) == keys
        assert all(r.is_success for r in runs), [(r.run_id, r.status) for r in runs]
        assert status() == dict.fromkeys(keys, StaleStatus.FRESH)
        after = versions()
        assert all(after[k] != before[k] for k in keys)  # new reports, not the old ones again
    finally:
        instance.dispose()


STALE_QUERY = """{ assetNodes { assetKey { path } staleStatus staleCauses { key { path } reason } } }"""


class UI:
    """The UI's view of the deployment in ``folder``: its GraphQL API over the code location as
    ``dagster dev`` loads it (``assets.definitions`` in its own code server), reloaded like the UI's
    **Reload** button after an experiment file changes."""

    def __init__(self, instance: dg.DagsterInstance):
        from dagster._core.workspace.context import WorkspaceProcessContext
        from dagster._core.workspace.load_target import ModuleTarget

        self.context = WorkspaceProcessContext(instance, ModuleTarget(
            module_name="assets.definitions", attribute=None, working_directory=str(pt.REPO), location_name="lm_pipeline"))

    def status(self) -> dict[str, tuple[str, list[str]]]:
        """Asset key -> (staleStatus, the reasons of its staleCauses)."""
        from dagster_graphql.test.utils import execute_dagster_graphql

        result = execute_dagster_graphql(self.context.create_request_context(), STALE_QUERY)
        return {"/".join(n["assetKey"]["path"]): (n["staleStatus"], [c["reason"] for c in n["staleCauses"]])
                for n in result.data["assetNodes"]}

    def reload(self) -> None:
        self.context.reload_code_location("lm_pipeline")

    def close(self) -> None:
        self.context.__exit__(None, None, None)  # stops the code server


@pytest.mark.slow  # two experiments trained and exported through Dagster, a code server reloaded: ~90 s
def test_a_tokenizer_edit_marks_only_its_experiments_stages_stale_in_the_ui(tmp_path, monkeypatch):
    """``default`` and ``llama`` share their data and tokenizer (the same artifacts, built once). As
    the UI's GraphQL API reports staleness: editing llama's tokenizer marks llama's stages from the
    tokenizer down STALE and nothing else -- every asset of ``default`` keeps its key and stays
    FRESH; reverting makes nothing stale; materializing the edit (llama alone) leaves ``default``
    untouched, and its tokenizer says it no longer shares it."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    folder = pt.write_experiments(tmp_path, {"default": {}, "llama": {"model": pt.TINY_LLAMA}})
    for var, value in {"DAGSTER_HOME": str(home), "LM_PIPELINE_EXPERIMENTS_DIR": str(folder),
                       "LM_PIPELINE_OVERRIDES": "", "LM_PIPELINE_TRAIN_MODE": "in_process"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("LM_PIPELINE_EXPERIMENT", raising=False)
    lineage = {f"{p}{s}" for p in ("", "llama/") for s in (*LINEAGE, "data_sources")}
    mine = {f"llama/{s}" for s in ("tokenizer", "token_cache", "train_ckpt", "eval_report", "hf_export")}
    with dg.DagsterInstance.get() as instance:
        d = Deployed.__new__(Deployed)
        d.tmp, d.folder, d.instance = tmp_path, folder, instance
        first = d.run()
        assert first.success
        mats = _materializations(first)
        for stage in SHARED:  # built once: one experiment's materialization is the other's cache hit
            assert sorted(mats[k][0].metadata["cache_hit"].value for k in (stage, f"llama/{stage}")) == [False, True]
            assert mats[stage][0].tags["dagster/data_version"] == mats[f"llama/{stage}"][0].tags["dagster/data_version"]
        assert mats["tokenizer"][0].metadata["shared_with"].value == "llama/tokenizer"
        checks = {e.asset_check_evaluation_data.asset_check_key.to_user_string(): e.asset_check_evaluation_data.passed
                  for e in first.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}
        assert checks["token_cache:token_ids_and_counts"] and checks["llama/token_cache:token_ids_and_counts"]
        assert checks["hf_export:loads_in_transformers"] and checks["llama/hf_export:loads_in_transformers"]

        ui = UI(instance)
        try:
            _walk(d, ui, instance, lineage, mine)
        finally:
            ui.close()


def _walk(d: Deployed, ui: UI, instance: dg.DagsterInstance, lineage: set[str], mine: set[str]) -> None:
    folder = d.folder
    before = ui.status()
    assert {k for k in before if k in lineage} == lineage
    assert {k: before[k][0] for k in lineage} == dict.fromkeys(lineage, "FRESH")

    llama = folder / "llama.yaml"
    text = llama.read_text()
    d.edit("llama", "data", tokenizer={"kind": "bpe", "vocab_size": 320})
    ui.reload()
    edited = ui.status()
    assert set(edited) == set(before)  # no key appears or vanishes
    assert {k for k in lineage if edited[k][0] == "STALE"} == mine
    assert {k: edited[k][0] for k in lineage - mine} == dict.fromkeys(lineage - mine, "FRESH")
    assert edited["llama/tokenizer"][1] == ["has a new code version"], edited["llama/tokenizer"]
    assert all(not causes for k, (_, causes) in edited.items() if not k.startswith(("llama/", "experiments/")))

    llama.write_text(text)  # revert
    ui.reload()
    assert {k: v[0] for k, v in ui.status().items() if k in lineage} == dict.fromkeys(lineage, "FRESH")

    # the edit materialized: llama's own stages rebuilt, default's neither run nor stale
    d.edit("llama", "data", tokenizer={"kind": "bpe", "vocab_size": 320})
    ui.reload()
    default_before = {s: instance.get_latest_materialization_event(dg.AssetKey(s)).timestamp for s in LINEAGE}
    assert d.run("pipeline_llama").success
    assert {s: instance.get_latest_materialization_event(dg.AssetKey(s)).timestamp for s in LINEAGE} == default_before
    after = ui.status()
    assert set(after) == set(before)
    assert {k: after[k][0] for k in lineage} == dict.fromkeys(lineage, "FRESH")
    graph = d.defs().resolve_asset_graph()
    assert graph.get(dg.AssetKey("tokenizer")).metadata["shared_with"].value == "none"
    assert graph.get(dg.AssetKey("raw_shards")).metadata["shared_with"].value == "llama/raw_shards"
