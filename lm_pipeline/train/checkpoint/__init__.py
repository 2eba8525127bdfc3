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
"""

from lm_pipeline.train.checkpoint.checkpointer import Checkpointer, ExtraFile
from lm_pipeline.train.checkpoint.discovery import latest_checkpoint, read_metadata
from lm_pipeline.train.checkpoint.marker import (
    BEST_DIR,
    MARKER,
    STATE_DIR,
    IncompleteCheckpointError,
    Kind,
    step_dir_name,
)
from lm_pipeline.train.checkpoint.policy import CheckpointerConfig, KeepPolicy, parse_duration
from lm_pipeline.train.checkpoint.restore import load

__all__ = [
    "BEST_DIR",
    "MARKER",
    "STATE_DIR",
    "Checkpointer",
    "CheckpointerConfig",
    "ExtraFile",
    "IncompleteCheckpointError",
    "KeepPolicy",
    "Kind",
    "latest_checkpoint",
    "load",
    "parse_duration",
    "read_metadata",
    "step_dir_name",
]
