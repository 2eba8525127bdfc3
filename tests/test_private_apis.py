"""The private library APIs the pipeline relies on (where no public one exists) are still there,
and still what the pipeline uses them for: a library release that changes one fails here, naming
the name and the module to update, instead of quietly changing behaviour."""

from __future__ import annotations

import importlib

import jax

from lm_pipeline import jax_private

UPDATE = "update lm_pipeline/jax_private.py (or move to a public API if this JAX has one)"


def test_every_private_jax_name_exists():
    missing = jax_private.problems()
    assert not missing, f"JAX {jax.__version__} lacks private names the pipeline uses: {missing}; {UPDATE}"


def test_a_planted_missing_name_is_reported(monkeypatch):
    monkeypatch.setitem(jax_private.NAMES, "jax._src.lru_cache", ("LRUCache", "NoSuchCacheClass"))
    monkeypatch.setitem(jax_private.NAMES, "jax._src.no_such_module", ("x",))
    found = jax_private.problems()
    assert "jax._src.lru_cache.NoSuchCacheClass: missing" in found
    assert any(p.startswith("jax._src.no_such_module: cannot be imported") for p in found)
    assert len(found) == 2


def test_backends_initialized_tracks_jax_without_initializing():
    jax.devices()  # initializes them (the public way)
    assert jax_private.backends_initialized(), f"JAX {jax.__version__}: xla_bridge._backends is empty; {UPDATE}"


def test_no_coordination_client_without_jax_distributed():
    assert not jax.distributed.is_initialized()
    assert jax_private.coordination_client() is None, f"JAX {jax.__version__}: global_state.client; {UPDATE}"


def test_the_file_cache_class_writes_and_reads_entries(tmp_path):
    cache = jax_private.file_cache_class()(str(tmp_path), max_size=-1)
    cache.put("k", b"compiled")
    assert cache.get("k") == b"compiled", f"JAX {jax.__version__}: LRUCache put/get; {UPDATE}"
    assert (tmp_path / "k-cache").read_bytes() == b"compiled"  # the file name lm_pipeline.xla_cache writes


def test_install_compilation_cache_keeps_an_open_one_and_fills_an_empty_slot(tmp_path):
    from jax.experimental.compilation_cache import compilation_cache as cc

    jax.jit(lambda x: x + 1)(1.0)  # a compile opens JAX's cache (conftest sets its directory)
    current = jax_private.open_compilation_cache()
    assert current is not None, f"JAX {jax.__version__}: compilation_cache._cache stays empty; {UPDATE}"
    assert jax_private.install_compilation_cache(lambda: object()) is current  # an open cache is kept
    ours = jax_private.file_cache_class()(str(tmp_path), max_size=-1)
    cc.reset_cache()  # the public way to close it
    try:
        assert jax_private.open_compilation_cache() is None
        assert jax_private.install_compilation_cache(lambda: ours) is ours
        assert jax_private.open_compilation_cache() is ours
    finally:
        cc.reset_cache()
        jax_private.install_compilation_cache(lambda: current)  # as it was, for the tests after this one


def test_dagster_instance_storages_come_from_the_preloaded_private_modules(tmp_path, monkeypatch):
    from dagster import DagsterInstance

    preload = importlib.import_module("assets._preload")
    (tmp_path / "dagster.yaml").write_text("")  # no storage: section: the SQLite defaults
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    with DagsterInstance.get() as instance:
        used = {type(getattr(instance, n)).__module__ for n in ("run_storage", "event_log_storage", "schedule_storage")}
    missing = used - set(preload.DAGSTER_PRIVATE_MODULES)
    assert not missing, (f"this Dagster's instance storages live in {sorted(missing)}, not preloaded: update "
                         "DAGSTER_PRIVATE_MODULES in assets/_preload.py")
