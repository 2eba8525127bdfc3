"""Training checkpoints: Orbax/TensorStore array storage, a completion marker, a keep policy.

On-disk layout (``base_path`` is a local path or any URL TensorStore/fsspec can write)::

    <base_path>/
      step-<N>/            # one checkpoint: state/, extra files, checkpoint.json (written last)
      best/                # keep_best: a complete copy of the best step dir (its own marker)

The state is any pytree of arrays (e.g. ``eqx.filter(train_state, eqx.is_array)``), stored as a
flat mapping ``dotted.key.path -> array``; :func:`load` restores it onto any sharding (elastic).

Modules, one job each:

* :mod:`.policy`: :class:`CheckpointerConfig`, the keep rules, duration strings.
* :mod:`.marker`: the completion marker ``checkpoint.json`` and the step-dir layout.
* :mod:`.flatten`: state pytree <-> flat dotted keys.
* :mod:`.checkpointer`: :class:`Checkpointer`, the (asynchronous) save.
* :mod:`.commit`: the multi-process commit (marker after every process's part).
* :mod:`.retention`: pruning by the keep policy and the ``best/`` copy.
* :mod:`.discovery`: :func:`latest_checkpoint`, :func:`read_metadata`.
* :mod:`.restore`: :func:`load` (elastic restore).
* :mod:`.integrity`: the files a checkpoint holds (sizes, sha256), verified before resuming;
  damaged checkpoints moved aside to ``.damaged/``.

Every public name is importable from ``lm_pipeline.train.checkpoint``; the submodules load on
first use, so the run config (which needs only :class:`CheckpointerConfig`) stays free of JAX.
"""

from __future__ import annotations

from lm_pipeline.lazy import lazy_exports

# Public name -> its submodule, loaded on first access (PEP 562).
_EXPORTS = {
    "CheckpointerConfig": "policy",
    "DAMAGED_DIR": "integrity",
    "file_digests": "integrity",
    "move_aside": "integrity",
    "verify": "integrity",
    "KeepPolicy": "policy",
    "parse_duration": "policy",
    "BEST_DIR": "marker",
    "MARKER": "marker",
    "STATE_DIR": "marker",
    "IncompleteCheckpointError": "marker",
    "Kind": "marker",
    "step_dir_name": "marker",
    "Checkpointer": "checkpointer",
    "ExtraFile": "checkpointer",
    "latest_checkpoint": "discovery",
    "read_metadata": "discovery",
    "load": "restore",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
