"""The estimate's result: :class:`Estimate` (size, FLOPs and per-device bytes of one train step)
and :class:`Activations`, with the peak arithmetic and the rendered table.

* **total** (the peak) = parameters + optimizer state + batch (the step's arguments, alive
  throughout) + the larger of the *backward* phase (compute copy + backward gradients +
  accumulator + activations) and the *update* phase (gradients + one f32 parameter-sized
  update buffer, read by ``optax.apply_updates`` and the ``update_norm`` metric).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class Activations:
    """Activation memory of one micro-batch on one device, in bytes."""

    saved: int  # tensors autodiff keeps for the backward pass (all layers + head)
    saved_per_layer: int  # of which one layer's share
    attention: int  # of ``saved``: the materialised [.., T, T] attention tensors (all layers)
    logits: int  # of ``saved``: residuals with a vocab dimension (logits / cross-entropy)
    head_backward: int  # phase 1: saved + logits cotangent buffers
    layer_backward: int  # phase 2: saved - logits + one layer's recomputation / backward

    @property
    def peak(self) -> int:
        return max(self.head_backward, self.layer_backward)


@dataclass(frozen=True)
class Estimate:
    """Size, FLOPs and per-device memory of one training step (bytes unless noted)."""

    model_type: str
    num_params: int
    flops_per_token: float  # training FLOPs (forward + backward) per token
    vocab_size: int
    seq_len: int
    num_devices: int
    data_size: int
    model_size: int
    train_batch_size: int
    micro_batch_per_device: int
    accum_steps: int
    param_dtype: str
    compute_dtype: str
    platform: str
    gradient_checkpointing: bool
    params: int
    optimizer: int
    gradients: int
    grad_accumulator: int
    compute_copy: int  # parameters in the compute dtype as the step uses them (gathered under FSDP)
    backward_gradients: int  # f32 gradients while the backward pass runs (unsharded under FSDP)
    batch: int
    update_buffer: int
    activations_remat: Activations
    activations_no_remat: Activations

    @property
    def activations_detail(self) -> Activations:
        return self.activations_remat if self.gradient_checkpointing else self.activations_no_remat

    @property
    def activations(self) -> int:
        """Peak activation bytes with the configured ``gradient_checkpointing``."""
        return self.activations_detail.peak

    def total_for(self, gradient_checkpointing: bool) -> int:
        act = (self.activations_remat if gradient_checkpointing else self.activations_no_remat).peak
        backward = self.compute_copy + self.backward_gradients + self.grad_accumulator + act
        return self.persistent + max(backward, self.gradients + self.update_buffer)

    @property
    def persistent(self) -> int:
        """Bytes alive for the whole step (the step's arguments): parameters, optimizer state, batch."""
        return self.params + self.optimizer + self.batch

    @property
    def fsdp(self) -> bool:
        """Whether parameters are sharded over the data axis (gathered for compute)."""
        return self.backward_gradients > self.gradients

    @property
    def total(self) -> int:
        """Estimated peak bytes per device of one train step (comparable to XLA's
        ``argument + output - alias + temp``)."""
        return self.total_for(self.gradient_checkpointing)

    @property
    def tokens_per_step(self) -> int:
        return self.train_batch_size * self.seq_len

    @property
    def flops_per_step(self) -> float:
        return self.flops_per_token * self.tokens_per_step

    def fits(self, budget_bytes: float) -> bool:
        """Whether the estimated peak fits ``budget_bytes`` per device."""
        return self.total <= budget_bytes

    def render(self) -> str:
        """A human-readable table."""
        remat = "on" if self.gradient_checkpointing else "off"
        act = self.activations_detail
        lines = [
            f"model: {self.model_type}, {_count(self.num_params)} parameters, "
            f"vocab {self.vocab_size}, seq_len {self.seq_len}",
            f"compute: {_flops(self.flops_per_token)} FLOPs/token, {_flops(self.flops_per_step)} FLOPs/step "
            f"({self.train_batch_size} x {self.seq_len} tokens)",
            f"mesh: {self.num_devices} device(s) = data {self.data_size} x model {self.model_size}; "
            f"micro-batch {self.micro_batch_per_device}/device x {self.accum_steps} accumulation step(s); "
            f"params {self.param_dtype}, compute {self.compute_dtype}; platform {self.platform}",
            "",
            f"{'memory per device':<44}{'bytes':>16}{'':>4}{'size':>11}",
        ]

        def row(name: str, n: int, note: str = "") -> None:
            lines.append(f"{name:<44}{n:>16,}{'':>4}{format_size(n):>11}{('  ' + note) if note else ''}")

        row("parameters", self.params)
        row("optimizer state", self.optimizer)
        row("gradients (f32)", self.gradients)
        if self.grad_accumulator:
            row("gradient accumulator (f32)", self.grad_accumulator)
        if self.compute_copy:
            gathered = ", gathered" if self.fsdp else ""
            row(f"params in compute dtype ({self.compute_dtype}{gathered})", self.compute_copy)
        if self.fsdp:
            row("gradients in backward (f32, unsharded)", self.backward_gradients)
        row("batch (token ids)", self.batch)
        row(f"activations (checkpointing {remat}), peak", self.activations)
        row("  saved for backward", act.saved)
        row("    per layer", act.saved_per_layer)
        if act.attention:
            row("    attention scores/probabilities", act.attention)
        row("    logits / cross-entropy", act.logits)
        row("  loss/head backward working set", act.head_backward)
        row("  layer backward working set", act.layer_backward)
        backward = self.compute_copy + self.backward_gradients + self.grad_accumulator + self.activations
        if self.gradients + self.update_buffer > backward:
            row("optimizer update buffer (the larger phase)", self.update_buffer)
        lines.append("-" * 75)
        row("total (estimated peak)", self.total)
        lines.append("(peak = parameters + optimizer + batch + the larger of the backward phase: compute-dtype")
        lines.append(" params + gradients in backward + accumulator + activations, and the update phase:")
        lines.append(" gradients + an update buffer of the same size)")
        other = not self.gradient_checkpointing
        lines.append(
            f"(with gradient_checkpointing {'on' if other else 'off'}: total {format_size(self.total_for(other))}, "
            f"activations {format_size((self.activations_remat if other else self.activations_no_remat).peak)})"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(total=self.total, activations=self.activations,
                   total_remat=self.total_for(True), total_no_remat=self.total_for(False))
        return out


def format_size(n: float) -> str:
    """``n`` bytes as text in KiB, MiB or GiB (binary units)."""
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    if n >= MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit} ({n:,})"
    return str(n)


def _flops(x: float) -> str:
    for unit, div in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if x >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f}"
