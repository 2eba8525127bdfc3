"""Parameters, FLOPs and per-device memory of a training run, estimated before anything runs.

:func:`estimate` answers "how big is this model, and does one train step fit on my devices?"
from the config alone: no compilation and no device arrays. Shapes come from tracing with
``jax.eval_shape`` (the model's parameters and logical axes, the optimizer state, and the
tensors autodiff saves for the backward pass); everything else is arithmetic.
:func:`auto_micro_batch` picks the largest per-device micro-batch that divides the batch and
fits a memory budget (for ``trainer.per_device_parallelism: auto``).

Modules, one job each: :mod:`.parameters` (parameter count; parameter, gradient and optimizer
bytes), :mod:`.activations` (traced saved tensors and backward working sets), :mod:`.step`
(:func:`estimate`), :mod:`.result` (:class:`Estimate`, its peak and table),
:mod:`.auto_parallelism` (``per_device_parallelism: auto``) and :mod:`.xla_plan` (XLA's plan of
the compiled step, the reference). The memory model's constants and their calibration against
XLA are in ``docs/benchmarks.md``, section "Estimator calibration".
"""

from lm_pipeline.estimate.activations import (
    ACCELERATOR_SAVED_FACTOR,
    ATTN_BWD_FACTOR,
    CPU_ACTIVATION_BYTES,
    HEAD_GRAD_BUFFERS,
    saved_activations,
)
from lm_pipeline.estimate.auto_parallelism import (
    auto_micro_batch,
    default_memory_budget,
    device_memory_bytes,
    micro_batch_candidates,
    resolve_auto_parallelism,
)
from lm_pipeline.estimate.result import GIB, MIB, Activations, Estimate
from lm_pipeline.estimate.step import estimate
from lm_pipeline.estimate.xla_plan import compiled_step_bytes, planned_bytes

__all__ = [
    "ACCELERATOR_SAVED_FACTOR",
    "ATTN_BWD_FACTOR",
    "CPU_ACTIVATION_BYTES",
    "GIB",
    "HEAD_GRAD_BUFFERS",
    "MIB",
    "Activations",
    "Estimate",
    "auto_micro_batch",
    "compiled_step_bytes",
    "default_memory_budget",
    "device_memory_bytes",
    "estimate",
    "micro_batch_candidates",
    "planned_bytes",
    "resolve_auto_parallelism",
    "saved_activations",
]
