"""Modules the multiprocess executor's forkserver imports once, so that each step process (a fork
of it) starts in a fraction of a second instead of importing Dagster's storage layer, pandas and
the data path again (~2-3 s per step on a busy 2-core machine).

Only import-time work belongs here: nothing that starts threads (no JAX backend, no TensorStore
context), since the forkserver forks every step process from this state.
"""

import dagster  # noqa: F401

# Private modules, deliberately: Dagster has no public module for its instance factory or its
# SQLite storages (nothing in `dagster`'s public API imports them); an instance loads them at run
# time by these dotted names (the defaults when dagster.yaml has no `storage:` section), so
# preloading them means naming them. A rename in Dagster fails loudly here, at import.
import dagster._core.instance.factory  # noqa: F401
import dagster._core.storage.event_log.sqlite.sqlite_event_log  # noqa: F401
import dagster._core.storage.runs.sqlite.sqlite_run_storage  # noqa: F401
import dagster._core.storage.schedules.sqlite.sqlite_schedule_storage  # noqa: F401
import dagster._core.storage.sqlite_storage  # noqa: F401
import pandas  # noqa: F401
import pandera.pandas  # noqa: F401

import lm_pipeline.config  # noqa: F401
import lm_pipeline.data.sources  # noqa: F401
import lm_pipeline.steps  # noqa: F401
