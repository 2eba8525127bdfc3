"""The production Dagster instance on PostgreSQL (docs/production.md), against a real server.

Each test module gets a throwaway PostgreSQL server on 127.0.0.1 (tests/helpers/postgres.py: the
machine's own ``initdb`` / ``pg_ctl``, started and stopped by the fixture) and each test a fresh
database on it. The instance is built from a ``dagster.yaml`` with ``storage: postgres:`` as a
deployment would write it, the password passed through an environment variable; what Dagster
stores is then read back both through Dagster and straight from the tables with psycopg2.
Missing binaries: skipped outside CI, installed (scripts/install_postgres.sh) or failed under CI=true.
"""

from pathlib import Path

import pytest

dg = pytest.importorskip("dagster")
pytest.importorskip("dagster_postgres")
psycopg2 = pytest.importorskip("psycopg2")

from helpers.postgres import (  # noqa: E402
    PostgresServer,
    pg_database,  # noqa: F401  (fixture)
    pg_server,  # noqa: F401  (fixture)
    postgres_dagster_home,
)

# Output(data_version=...) is a beta parameter of Dagster's; the pipeline's assets set data versions too
pytestmark = pytest.mark.filterwarnings("ignore::dagster.BetaWarning")

PASSWORD_ENV = "LM_PIPELINE_TEST_PG_PASSWORD"
DATA_VERSION_TAG = "dagster/data_version"


@pytest.fixture
def instance(pg_database: PostgresServer, tmp_path: Path, monkeypatch):  # noqa: F811
    """A DagsterInstance from ``$DAGSTER_HOME/dagster.yaml`` with Postgres storage (``env:`` password)."""
    home = postgres_dagster_home(tmp_path, pg_database, password_env=PASSWORD_ENV)
    monkeypatch.setenv(PASSWORD_ENV, pg_database.password)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    inst = dg.DagsterInstance.get()
    yield inst
    inst.dispose()  # close the storages' connection pools before the database goes


# --------------------------------------------------------------------------------------------
# a tiny, self-contained asset graph and a sensor over it
# --------------------------------------------------------------------------------------------


@dg.asset(code_version="1", config_schema={"value": int})
def numbers(context: dg.AssetExecutionContext) -> dg.Output[list[int]]:
    value = context.op_execution_context.op_config["value"]
    return dg.Output(list(range(value)), data_version=dg.DataVersion(f"n{value}"),
                     metadata={"count": value})


@dg.asset(code_version="1")
def total(numbers: list[int]) -> dg.MaterializeResult:
    return dg.MaterializeResult(metadata={"sum": sum(numbers)})


ASSETS = [numbers, total]


def _materialize(instance: dg.DagsterInstance, value: int) -> dg.ExecuteInProcessResult:
    return dg.materialize(ASSETS, instance=instance, run_config={"ops": {"numbers": {"config": {"value": value}}}},
                          resources={"io_manager": dg.mem_io_manager})


@dg.sensor(target=[total], minimum_interval_seconds=30)
def new_numbers_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
    """One run request (and one dynamic partition) per new materialization of ``numbers`` and per new
    observation of it, after the cursor: ``"<last materialization storage id>,<last observation id>"``.
    The shape of the pipeline's checkpoint sensor (observations of checkpoints -> partitions)."""
    last_mat, last_obs = (int(x) for x in (context.cursor or "0,0").split(","))
    requests, keys = [], []
    mats = context.instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=numbers.key, after_storage_id=last_mat), limit=100, ascending=True).records
    obs = context.instance.fetch_observations(
        dg.AssetRecordsFilter(asset_key=numbers.key, after_storage_id=last_obs), limit=100, ascending=True).records
    for kind, records in (("mat", mats), ("obs", obs)):
        for rec in records:
            version = rec.asset_event.tags.get(DATA_VERSION_TAG) if rec.asset_event.tags else None
            key = f"{kind}-{rec.storage_id}-{version}"
            keys.append(key)
            requests.append(dg.RunRequest(run_key=key, tags={"numbers_version": str(version)}))
    cursor = f"{mats[-1].storage_id if mats else last_mat},{obs[-1].storage_id if obs else last_obs}"
    return dg.SensorResult(run_requests=requests, cursor=cursor,
                           dynamic_partitions_requests=[dg.AddDynamicPartitionsRequest("seen", keys)] if keys else [])


def _tick(instance: dg.DagsterInstance, cursor: str | None) -> dg.SensorResult:
    """Evaluate the sensor once, as the daemon would, and apply its partition requests to the instance."""
    result = new_numbers_sensor(dg.build_sensor_context(instance=instance, cursor=cursor))
    for req in result.dynamic_partitions_requests or []:
        instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
    return result


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------


def test_instance_from_dagster_yaml_uses_postgres_for_every_storage(instance, pg_database):  # noqa: F811
    assert type(instance.run_storage).__name__ == "PostgresRunStorage"
    assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
    assert type(instance.schedule_storage).__name__ == "PostgresScheduleStorage"
    assert instance.is_persistent
    # Dagster created its schema in our database
    tables = {r[0] for r in pg_database.query("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert {"runs", "event_logs", "asset_keys", "dynamic_partitions", "jobs", "job_ticks"} <= tables, tables
    # and the server really checks the password that the config took from the environment
    with pytest.raises(psycopg2.OperationalError, match="password authentication failed"):
        pg_database.connect(password="wrong").close()


def test_materializations_and_data_versions_round_trip_through_postgres(instance, pg_database):  # noqa: F811
    first = _materialize(instance, 4)
    second = _materialize(instance, 5)
    assert first.success and second.success

    # runs: in Postgres' `runs` table, and back through Dagster
    rows = dict(pg_database.query("SELECT run_id, status FROM runs"))
    assert rows == {first.run_id: "SUCCESS", second.run_id: "SUCCESS"}
    assert {r.run_id for r in instance.get_runs()} == {first.run_id, second.run_id}

    # materializations: two of each asset in `event_logs`, the latest with its metadata
    counts = dict(pg_database.query(
        "SELECT asset_key, count(*) FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION' "
        "GROUP BY asset_key"))
    assert counts == {'["numbers"]': 2, '["total"]': 2}
    latest_total = instance.get_latest_materialization_event(total.key).asset_materialization
    assert latest_total.metadata["sum"].value == sum(range(5))
    assert instance.get_latest_materialization_event(numbers.key).run_id == second.run_id

    # data versions: the one the asset set, and the downstream one Dagster derived from its input's
    latest_numbers = instance.get_latest_materialization_event(numbers.key).asset_materialization
    assert latest_numbers.tags[DATA_VERSION_TAG] == "n5"
    assert latest_numbers.tags["dagster/code_version"] == "1"
    assert latest_total.tags["dagster/input_data_version/numbers"] == "n5"
    v_total = latest_total.tags[DATA_VERSION_TAG]
    first_total = instance.fetch_materializations(total.key, limit=2, ascending=True).records[0]
    assert first_total.asset_materialization.tags["dagster/input_data_version/numbers"] == "n4"
    assert first_total.asset_materialization.tags[DATA_VERSION_TAG] != v_total  # new input, new version
    record = instance.get_latest_data_version_record(total.key)
    assert record is not None and record.asset_materialization.tags[DATA_VERSION_TAG] == v_total


def test_sensor_ticks_read_and_write_through_postgres(instance, pg_database):  # noqa: F811
    _materialize(instance, 2)
    _materialize(instance, 3)
    first = _tick(instance, None)
    assert [r.tags["numbers_version"] for r in first.run_requests] == ["n2", "n3"]
    assert len({r.run_key for r in first.run_requests}) == 2

    # nothing new: nothing requested from the cursor
    again = _tick(instance, first.cursor)
    assert again.run_requests == [] and again.cursor == first.cursor

    # an observation reported outside any run (as training reports checkpoints) and one more materialization
    instance.report_runless_asset_event(dg.AssetObservation(asset_key=numbers.key, tags={DATA_VERSION_TAG: "ext"}))
    _materialize(instance, 7)
    second = _tick(instance, first.cursor)
    assert sorted(r.tags["numbers_version"] for r in second.run_requests) == ["ext", "n7"]
    assert _tick(instance, second.cursor).run_requests == []

    # the partitions the ticks added are rows of Postgres' `dynamic_partitions`, and read back by Dagster
    stored = {r[0] for r in pg_database.query("SELECT partition FROM dynamic_partitions WHERE partitions_def_name = 'seen'")}
    requested = {r.run_key for r in [*first.run_requests, *second.run_requests]}
    assert stored == requested == set(instance.get_dynamic_partitions("seen"))
    assert len(stored) == 4
