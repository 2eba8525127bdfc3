"""Levanter's ``trainer.quantization`` (haliax's QuantizationConfig): fp8 / int8 training, checked
against the device before any compute.

``fp8: true`` trains with fp8 projections (:mod:`lm_pipeline.fp8`: e4m3 operands, e5m2 gradients,
per-tensor current scaling) on a GPU with fp8 matmuls (compute capability 8.9 or newer); on any
other device it is refused in one line naming the field and the device. int8 and ``targets`` (a
choice of layers) are refused in one line."""

from __future__ import annotations

from dataclasses import dataclass

from lm_pipeline.schema import ConfigError, field


@dataclass(frozen=True)
class QuantizationConfig:
    """Quantized training (Levanter's ``trainer.quantization``, haliax's QuantizationConfig)."""

    fp8: bool = field(False, help="fp8 projections (e4m3 operands, e5m2 output gradients, per-tensor current scaling) on a GPU with fp8 matmuls (compute capability >= 8.9); refused before any compute on other devices, naming the device.")
    int8: bool = field(False, help="int8 matmuls. Refused before any compute (not implemented here).")
    targets: tuple[str, ...] | str | None = field(None, help="Which linear layers are quantized (Levanter's module name patterns); only null (every projection of the blocks, not the LM head) is supported.")

    def device_problem(self, device: str, has_fp8: bool) -> ConfigError | None:
        """Why this quantization cannot run on ``device`` (its name, e.g. 'cpu' or 'NVIDIA H100'), or None."""
        if self.fp8 and not has_fp8:
            return ConfigError("trainer.quantization.fp8", f"true, but this run's device is {device}: needs a GPU "
                               "with fp8 matmuls (compute capability 8.9 or newer: H100, H200, L4, ...); remove "
                               "trainer.quantization to train in trainer.mp")
        if self.fp8 and self.targets is not None:
            return ConfigError("trainer.quantization.targets", f"{self.targets!r}: choosing the quantized layers is not "
                               "supported here; remove targets (every projection of the blocks is fp8, the LM head "
                               "is not)")
        if self.int8:
            return ConfigError("trainer.quantization.int8", f"true on {device}: int8 training is not implemented "
                               "here; remove trainer.quantization")
        return None


def device_fp8() -> tuple[str, bool]:
    """(the first device's name, whether it has fp8 matmuls: a CUDA GPU of compute capability >= 8.9)."""
    import jax

    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return dev.platform, False
    try:
        major, minor = (int(x) for x in str(getattr(dev, "compute_capability", "0.0")).split(".")[:2])
    except ValueError:
        major, minor = 0, 0
    return str(getattr(dev, "device_kind", "gpu")), (major, minor) >= (8, 9)
