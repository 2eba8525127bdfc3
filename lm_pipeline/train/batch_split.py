"""How a step's batch is split: ``train_batch_size = per-device micro-batch x data-parallel devices
x accumulated micro-batches``. :func:`batch_split_problem` is the one place that decides whether a
split works: the config's validation (devices not known yet), the trainer and the estimator on a
known mesh, and the choice of ``per_device_parallelism: auto`` all ask it."""

from __future__ import annotations


def batch_split_problem(batch: int, *, per_device: int | None = None, accumulation: int | None = None,
                        data_size: int | None = None) -> tuple[str, str] | None:
    """(trainer field, why) when ``batch`` rows cannot be cut into ``accumulation`` micro-batches of
    ``per_device`` rows on each of ``data_size`` data-parallel devices, else None.

    What is not given is whatever makes the split work: ``per_device`` None or <= 0 is the whole
    batch at once, ``accumulation`` None as many micro-batches as needed, and ``data_size`` None
    (a config checked before its devices are known) any device count, so then only
    ``per_device x accumulation`` must divide the batch."""
    per = per_device if per_device is not None and per_device > 0 else None
    if data_size is None:
        return _any_devices(batch, per, accumulation)
    if accumulation is not None:
        return _accumulated(batch, per, accumulation, data_size)
    rows = (per or max(1, batch // data_size)) * data_size
    if batch % rows or batch < data_size:
        hint = (f"per_device_parallelism ({per}) x data-parallel devices ({data_size}) = {rows}" if per else
                f"the {data_size} data-parallel devices; use a multiple of {data_size}")
        return "train_batch_size", f"{batch} is not divisible by {hint}"
    return None


def _any_devices(batch: int, per: int | None, gas: int | None) -> tuple[str, str] | None:
    if gas is not None and batch % gas:
        return "gradient_accumulation_steps", (
            f"{gas} does not divide train_batch_size ({batch}, the global batch); e.g. train_batch_size "
            f"{max(gas, batch // gas * gas)} or {batch // gas * gas + gas}")
    if gas is not None and per is not None and batch % (per * gas):
        return "gradient_accumulation_steps", (
            f"train_batch_size ({batch}) must be per_device_parallelism ({per}) x gradient_accumulation_steps "
            f"({gas}) x data-parallel devices, but {per * gas} does not divide it")
    if per is not None and batch % per:
        return "train_batch_size", f"{batch} is not divisible by per_device_parallelism={per}"
    return None


def _accumulated(batch: int, per: int | None, gas: int, data_size: int) -> tuple[str, str] | None:
    rows = batch // gas
    if batch % gas or rows % data_size:
        return "gradient_accumulation_steps", (
            f"train_batch_size {batch} / gradient_accumulation_steps {gas} = {batch / gas:g} rows per micro-batch, "
            f"not divisible by the {data_size} data-parallel devices; use train_batch_size = per-device batch x "
            f"{data_size} x {gas}")
    if per is not None and per != rows // data_size:
        return "gradient_accumulation_steps", (
            f"{gas} micro-batches of {rows} rows over {data_size} data-parallel devices are {rows // data_size} per "
            f"device, but per_device_parallelism is {per}; drop one of them or set train_batch_size = {per} x "
            f"{data_size} x {gas} = {per * data_size * gas}")
    return None
