"""``trainer.per_device_parallelism: auto``: the largest per-device micro-batch that divides the
batch and whose estimated peak fits the device's memory budget (bytes per device)."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any

import jax

from lm_pipeline.estimate.result import format_size
from lm_pipeline.estimate.step import estimate
from lm_pipeline.schema import ConfigError

if TYPE_CHECKING:
    from lm_pipeline.config import RunConfig

log = logging.getLogger(__name__)


def micro_batch_candidates(train_batch_size: int, data_size: int) -> list[int]:
    """Per-device micro-batches ``m`` the trainer accepts: ``m * data_size`` divides the batch."""
    from lm_pipeline.train.batch_split import batch_split_problem

    return [m for m in range(1, train_batch_size // data_size + 1)
            if batch_split_problem(train_batch_size, per_device=m, data_size=data_size) is None]


def auto_micro_batch(
    cfg: RunConfig,
    num_devices: int,
    budget_bytes: float,
    vocab_size: int | None = None,
    *,
    platform: str | None = None,
    segments: bool | None = None,
) -> int:
    """The largest per-device micro-batch that divides the batch and whose estimated peak fits
    ``budget_bytes`` per device (for ``trainer.per_device_parallelism: auto``).

    Raises :class:`ConfigError` when the batch cannot be split over the data-parallel devices
    or even a micro-batch of 1 does not fit.
    """
    data_size = num_devices // cfg.trainer.model_axis_size
    sizes = cfg.trainer.batch_schedule.distinct_sizes  # a batch-size schedule: a micro-batch that splits each size
    candidates = sorted(set.intersection(*(set(micro_batch_candidates(b, data_size)) for b in sizes)))
    if not candidates:
        from lm_pipeline.train.batch_split import batch_split_problem

        where, why = next((p for b in sizes if (p := batch_split_problem(b, data_size=data_size))),
                          ("train_batch_size", f"no micro-batch per device splits every batch size of {sizes} over "
                           f"{data_size} data-parallel devices; give per_device_parallelism"))
        raise ConfigError(f"trainer.{where}", why)
    smallest = None
    for m in reversed(candidates):
        est = estimate(cfg, num_devices=num_devices, vocab_size=vocab_size, micro_batch_per_device=m,
                       platform=platform, segments=segments)
        if est.fits(budget_bytes):
            return m
        smallest = est
    assert smallest is not None
    raise ConfigError(
        "trainer.per_device_parallelism",
        f"even a micro-batch of 1 sequence per device needs about {format_size(smallest.total)} per device, "
        f"more than the budget of {format_size(budget_bytes)}; use more devices (FSDP shards parameters and "
        "optimizer state), gradient checkpointing, bf16 compute or a smaller model",
    )


def default_memory_budget(trainer_cfg: Any, device: Any = None) -> int:
    """Bytes per device that ``per_device_parallelism: auto`` plans for: ``device_memory_gib``
    when set, else what the accelerator reports, else (CPU) 80% of RAM over the local devices."""
    if getattr(trainer_cfg, "device_memory_gib", None):
        return int(trainer_cfg.device_memory_gib * 2**30)
    reported = device_memory_bytes(device)
    if reported:
        return reported
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(0.8 * ram / max(1, jax.local_device_count()))


def resolve_auto_parallelism(cfg: RunConfig, num_devices: int, vocab_size: int, *, segments: bool | None = None) -> RunConfig:
    """``cfg`` with ``trainer.per_device_parallelism: auto`` replaced by the micro-batch
    :func:`auto_micro_batch` picks for :func:`default_memory_budget` (unchanged otherwise)."""
    tc = cfg.trainer
    if tc.per_device_parallelism != "auto":
        return cfg
    budget = default_memory_budget(tc)
    per = auto_micro_batch(cfg, num_devices, budget, vocab_size, segments=segments)
    log.info("per_device_parallelism: auto -> %d sequences per device (budget %s per device)", per, format_size(budget))
    return dataclasses.replace(cfg, trainer=dataclasses.replace(tc, per_device_parallelism=per))


def device_memory_bytes(device: Any = None) -> int | None:
    """The memory an accelerator lets XLA use (``memory_stats()["bytes_limit"]``), or None where
    the backend does not say (CPU): a default budget for :func:`auto_micro_batch`."""
    device = device if device is not None else jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # pragma: no cover - backends without memory stats
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None
