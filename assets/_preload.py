"""Modules the multiprocess executor's forkserver imports once, so that each step process (a fork
of it) starts in a fraction of a second instead of importing Dagster's storage layer, pandas and
the data path again (~2-3 s per step on a busy 2-core machine).

Only import-time work belongs here: nothing that starts threads (no JAX backend, no TensorStore
context), since the forkserver forks every step process from this state.
"""

import importlib

import dagster
import pandas  # noqa: F401
import pandera.pandas  # noqa: F401

import lm_pipeline.config  # noqa: F401
import lm_pipeline.data.sources  # noqa: F401
import lm_pipeline.steps  # noqa: F401

# Private modules, deliberately: Dagster has no public module for its instance factory or its
# SQLite storages (nothing in `dagster`'s public API imports them); an instance loads them at run
# time by these dotted names (the defaults when dagster.yaml has no `storage:` section), so
# preloading them means naming them. tests/test_private_apis.py checks that an instance's storages come
# from these modules.
DAGSTER_PRIVATE_MODULES = (
    "dagster._core.instance.factory",
    "dagster._core.storage.event_log.sqlite.sqlite_event_log",
    "dagster._core.storage.runs.sqlite.sqlite_run_storage",
    "dagster._core.storage.schedules.sqlite.sqlite_schedule_storage",
    "dagster._core.storage.sqlite_storage",
)


def _import_private() -> None:
    """Import :data:`DAGSTER_PRIVATE_MODULES`; a module Dagster renamed fails here, naming it."""
    for name in DAGSTER_PRIVATE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ImportError(f"Dagster {dagster.__version__} has no module {name} ({e}); update "
                              "DAGSTER_PRIVATE_MODULES in assets/_preload.py to where it moved") from e


_import_private()
