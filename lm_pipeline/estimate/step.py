""":func:`estimate`: parameters, FLOPs and per-device memory of one train step of a run config,
from the config alone (no compilation, no device arrays).

It resolves the mesh (``data x model``) and the micro-batching, then adds up the
parameter-shaped state (:mod:`.parameters`), the traced activations with and without gradient
checkpointing (:mod:`.activations`) and the batch: the int32 tokens (and segment ids, and a chat
source's loss mask) of one step. With accumulation (``accum > 1``) the micro-batch scan carries a
second f32 gradient tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from lm_pipeline.estimate.activations import activations
from lm_pipeline.estimate.parameters import parameter_memory
from lm_pipeline.estimate.result import Estimate
from lm_pipeline.schema import ConfigError

if TYPE_CHECKING:
    from lm_pipeline.config import RunConfig


def estimate(
    cfg: RunConfig,
    *,
    num_devices: int,
    vocab_size: int | None = None,
    micro_batch_per_device: int | None = None,
    platform: str | None = None,
    segments: bool | None = None,
    loss_mask: bool | None = None,
) -> Estimate:
    """Estimate parameters, FLOPs and per-device memory of ``cfg`` (a :class:`RunConfig`) on
    ``num_devices`` devices, without compiling anything.

    vocab_size: default ``cfg.data.tokenizer.vocab_size``.
    micro_batch_per_device: sequences per device per micro-batch; default from
        ``trainer.per_device_parallelism`` (-1: the whole batch, ``train_batch_size / data``).
    platform: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (default: JAX's default backend); on CPU,
        most saved bf16 tensors are counted as f32 (``docs/benchmarks.md``, Estimator calibration).
    segments: whether batches carry segment ids (default: ``data.packing`` is not ``concat``).
    loss_mask: whether batches carry a loss mask (default: the data has a chat source, whose
        rows train on the assistant's tokens only; the train step then takes the mask too).
    """
    tc, mc = cfg.trainer, cfg.model
    data_size = _data_parallel_size(num_devices, tc.model_axis_size)
    vocab = int(vocab_size if vocab_size is not None else cfg.data.tokenizer.vocab_size)
    micro, accum = _micro_batching(tc, data_size, micro_batch_per_device)
    # The one default platform: JAX's default backend, the devices this process would train on
    # (``lm-pipeline estimate`` and ``per_device_parallelism: auto`` pass no platform).
    platform = (platform or jax.default_backend()).lower()
    if segments is None:
        segments = getattr(cfg.data, "packing", "concat") != "concat"
    if loss_mask is None:
        loss_mask = bool(getattr(cfg.data, "chat_sources", dict)())
    compute = jnp.dtype(tc.precision_for(platform).compute)  # `mp: auto` as a run on `platform` resolves it
    on_cpu = platform == "cpu"
    mem = parameter_memory(cfg, vocab, data_size=data_size, compute_dtype=compute, on_cpu=on_cpu)
    acts = {
        remat: activations(mc, vocab, micro, compute.name, segments, remat=remat, model_size=tc.model_axis_size,
                           platform=platform)
        for remat in (True, False)
    }
    return Estimate(
        model_type=getattr(mc, "type", type(mc).__name__),
        num_params=mem.num_params,
        flops_per_token=float(mc.flops_per_token(vocab)),
        vocab_size=vocab,
        seq_len=mc.seq_len,
        num_devices=num_devices,
        data_size=data_size,
        model_size=tc.model_axis_size,
        train_batch_size=tc.batch_schedule.max_size,  # a batch-size schedule: its largest batch, the peak
        micro_batch_per_device=micro,
        accum_steps=accum,
        param_dtype=mem.param_dtype,
        compute_dtype=compute.name,
        platform=platform,
        gradient_checkpointing=bool(getattr(mc, "gradient_checkpointing", False)),
        params=mem.params,
        optimizer=mem.optimizer,
        gradients=mem.gradients,
        grad_accumulator=mem.gradients if accum > 1 else 0,
        compute_copy=mem.compute_copy,
        backward_gradients=mem.backward_gradients,
        batch=_batch_bytes(tc.batch_schedule.max_size, data_size, mc.seq_len, segments, loss_mask),
        update_buffer=mem.gradients if on_cpu else 0,  # fused into the update on accelerators
        activations_remat=acts[True],
        activations_no_remat=acts[False],
    )


def _data_parallel_size(num_devices: int, model_axis_size: int) -> int:
    """Devices along the mesh's ``data`` axis: ``num_devices / model_axis_size``."""
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    if num_devices % model_axis_size:
        raise ConfigError(
            "trainer.model_axis_size",
            f"{model_axis_size} does not divide the {num_devices} devices; use a divisor of {num_devices}",
        )
    return num_devices // model_axis_size


def _micro_batching(trainer_cfg: Any, data_size: int, micro_batch_per_device: int | None) -> tuple[int, int]:
    """(sequences per device per micro-batch, micro-batches accumulated per step) of the largest
    batch (a batch-size schedule's peak)."""
    per = trainer_cfg.per_device_parallelism if micro_batch_per_device is None else micro_batch_per_device
    return trainer_cfg.micro_batching(data_size, per if isinstance(per, int) else None,
                                      trainer_cfg.batch_schedule.max_size)


def _batch_bytes(train_batch_size: int, data_size: int, seq_len: int, segments: bool, loss_mask: bool = False) -> int:
    """Bytes per device of one step's int32 tokens (and segment ids, and a chat source's loss mask)."""
    rows = -(-train_batch_size // data_size)
    return rows * seq_len * 4 * (1 + int(segments) + int(loss_mask))
