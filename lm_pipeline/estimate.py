"""Parameters, FLOPs and per-device memory of a training run, estimated before anything runs.

:func:`estimate` answers "how big is this model, and does one train step fit on my devices?"
from the config alone: no compilation and no device arrays. Shapes come from tracing with
``jax.eval_shape`` (the model's parameters and logical axes, the optimizer state, and the
tensors autodiff saves for the backward pass); everything else is arithmetic.
:func:`auto_micro_batch` picks the largest per-device micro-batch that divides the batch and
fits a memory budget (for ``trainer.per_device_parallelism: auto``).

What is counted
---------------
Bytes per device. "Sharded" = divided by the mesh axes the parameter axis mapping
(:func:`~lm_pipeline.train.sharding.axis_mappings`) puts on each logical axis, on a mesh
``data = num_devices / model_axis_size`` x ``model = model_axis_size``, and only where the
axis size divides evenly, exactly as :meth:`MeshPlan.param_shardings` decides.

* **parameters**: every leaf in its dtype (f32: the trainer keeps master weights in f32 and
  ignores ``mp``'s ``p=``), sharded.
* **optimizer state**: as ``OptimizerConfig.build(...).init`` shapes it (AdamW: ``mu`` and
  ``nu`` in f32 plus a few replicated scalars), parameter-shaped leaves sharded like them.
* **gradients**: f32, sharded like the parameters. Under FSDP (parameters sharded over
  ``data``) the backward pass produces them unsharded over ``data`` before the reduce-scatter
  (``backward_gradients``).
* **gradient accumulator**: with accumulation (``accum > 1``) the micro-batch scan carries a
  second f32 gradient tree.
* **compute copy**: ``cast_floating`` copies every parameter into the compute dtype when it
  differs (``mp: p=f32,c=bf16``); under FSDP the copy used by the compute is the gathered
  (unsharded over ``data``) one, whatever the dtype.
* **batch**: the int32 tokens (and segment ids) of one step.
* **activations** of one micro-batch (``micro_batch_per_device`` sequences), with gradient
  checkpointing on and off. The saved tensors are *traced*, not hand-counted:
  :func:`saved_activations` runs ``jax.vjp`` of the trainer's own loss (compute-dtype
  parameters -> model -> :func:`~lm_pipeline.train.trainer.next_token_loss_sums`, custom
  VJPs included) under ``jax.eval_shape`` for a 1-layer and a 2-layer copy of the model. The
  difference is one layer's saved tensors (without checkpointing: norms, q/k/v, MLP
  intermediates, and the ``[B, N, T, T]`` attention scores/probabilities whenever the
  attention implementation materialises them, as ``jax.nn.dot_product_attention``'s XLA path
  and the dropout softmax path do; the CPU's causal attention, native or blocked, saves only
  its output and per-row log-sum-exp, :mod:`lm_pipeline.kernels.cpu.native_attention`,
  :mod:`lm_pipeline.kernels.cpu.blocked_attention`); with checkpointing: the
  block input ``[B, T, D]`` only); the rest (x 1) is what does not repeat per layer: the
  embeddings, final norm and the logits / cross-entropy residuals ``[B, T, V]``. (On the CPU
  the trainer computes the head and loss in chunks instead,
  :func:`~lm_pipeline.train.trainer.fused_head_loss_sums`, and never holds ``[B, T, V]``
  whole; XLA's planned peak of every ``bench/estimate_check.py`` row stayed within 0.01 GiB
  of the logits path's, because the peak lies in the layers, so the model keeps the logits
  path's terms: 0.84-1.14 of XLA's plan in bf16, 0.92-1.07 in f32, after the change; 1.01-1.13
  in f32 with the native CPU attention kernel.) The
  backward pass adds working buffers; two phases are modelled and the larger is the peak:

  - *loss/head backward*: all saved tensors + ``HEAD_GRAD_BUFFERS`` x ``[B, T, V]`` f32 (the
    logits' cotangent, ``softmax - onehot``);
  - *layer backward*: all saved tensors but the logits residuals + (with checkpointing) one
    layer's full saved set, recomputed + ``ATTN_BWD_FACTOR`` x that layer's ``[.., T, T]``
    attention tensors (their f32 cotangents).

* **total** (the peak) = parameters + optimizer state + batch (the step's arguments, alive
  throughout) + the larger of the *backward* phase (compute copy + backward gradients +
  accumulator + activations) and the *update* phase (gradients + one f32 parameter-sized
  update buffer, read by ``optax.apply_updates`` and the ``update_norm`` metric).

With tensor parallelism, saved tensors with a heads / MLP / vocab dimension (recognised by
shape: 5+ dims, or a dimension equal to the MLP width or the vocabulary) are divided by
``model_axis_size``; the batch is split over ``data``.

Constants and calibration
-------------------------
``HEAD_GRAD_BUFFERS = 1`` and ``ATTN_BWD_FACTOR = 0.5`` were fitted (minimising the worst
relative error) against XLA's buffer assignment of the real train step:
``build_step_functions(...).train_step.lower(state, tokens, None).compile().memory_analysis()``
on a 1-device CPU mesh (JAX 0.10.2, jaxlib CPU). XLA's peak is ``argument_size + output_size -
alias_size + temp_size``: the state is donated, so outputs alias arguments, and ``temp_size``
is the one temp allocation XLA packs every intermediate into (their peak, with reuse). That is
what :attr:`Estimate.total` estimates.

``CPU_ACTIVATION_BYTES = 4``: XLA:CPU performs bf16 elementwise work in f32, and bf16 tensors
saved into a scan's stacked buffers go through f32. So on ``platform="cpu"`` saved bf16
tensors count 4 bytes, except the LM head's output, and except (attention's aside) those of
a stack ``scan_blocks`` unrolls (low precision, no checkpointing, at most
``layers.UNROLL_MAX_LAYERS`` layers) and of the one layer a checkpointed backward recomputes,
which XLA keeps in bf16. Counting every bf16 tensor at 2 bytes came out up to 40% low,
counting all at 4 up to 30% high. On GPU/TPU saved tensors count in their traced dtype (see
the accelerator calibration below).

Calibration (total MiB, XLA -> estimate, ratio), D/T/B/V/L/N[/K] = width, seq, micro-batch,
vocab, layers, heads [/ kv heads], M = MLP width; f32 and ``p=f32,c=bf16``::

    model D/T/B/V/L/N[/K]           M  remat f32         no-remat f32      remat bf16        no-remat bf16
    gpt2  64/64/4/512/2/4         256  4.9->5.5 1.11     9.6->9.2 0.95     5.1->4.8 0.94     7.2->7.3 1.02
    llama 64/64/4/512/2/4/4       192  6.0->5.7 0.94     9.9->9.0 0.90     5.2->5.2 0.99     6.9->7.4 1.07
    gpt2  128/128/8/2048/2/4      512  34.4->37.4 1.09   72.9->74.9 1.03   35.1->31.2 0.89   60.7->57.0 0.94
    llama 128/128/8/2048/2/4/2    384  41.7->37.6 0.90   69.9->71.7 1.02   34.7->33.1 0.95   56.9->56.4 0.99
    gpt2  256/256/16/8192/4/8    1024  373->369 0.99     1191->1227 1.03   346->315 0.91     1102->931 0.84
    llama 256/256/16/8192/4/8/4   768  407->400 0.98     1117->1146 1.02   353->350 0.99     1043->891 0.85
    gpt2  256/64/8/512/4/4       1024  72.0->74.0 1.03   140.7->131.2 0.93 77.5->72.8 0.94   105.6->106.8 1.01
    llama 256/64/8/512/4/4/4      768  80.1->76.6 0.96   138.1->124.8 0.90 80.6->77.1 0.96   100.4->104.8 1.04
    gpt2  64/256/8/1024/2/4       256  44.6->47.9 1.07   102.0->99.0 0.97  46.5->40.8 0.88   88.5->80.1 0.91
    llama 64/256/8/1024/2/4/1     192  47.8->44.9 0.94   94.9->92.2 0.97   44.9->39.2 0.87   81.9->75.9 0.93
    gpt2  128/64/4/4096/4/4       256  23.2->25.2 1.09   36.8->39.1 1.06   26.2->25.2 0.96   35.5->34.5 0.97
    llama 128/64/4/4096/4/4/2     256  32.0->34.0 1.06   45.1->47.4 1.05   33.0->35.2 1.06   40.6->43.6 1.07
    gpt2  256/32/2/4096/2/8      1024  50.3->50.3 1.00   50.3->50.3 1.00   52.6->50.3 0.96   54.5->50.3 0.92
    llama 256/32/2/4096/2/8/8     768  72.5->72.5 1.00   72.5->72.5 1.00   68.2->72.5 1.06   70.7->72.5 1.03
    gpt2  64/128/16/512/6/2       256  30.9->34.3 1.11   152.3->150.1 0.99 30.6->27.5 0.90   120.2->103.5 0.86
    llama 64/128/16/512/6/2/2     256  38.5->36.2 0.94   159.8->152.0 0.95 31.6->29.0 0.92   115.1->102.3 0.89
    gpt2  192/256/4/2048/3/6      576  65.4->69.6 1.06   155.9->154.0 0.99 70.9->63.5 0.90   140.2->125.5 0.90
    llama 192/256/4/2048/3/6/3    960  108.2->96.5 0.89  214.7->197.5 0.92 93.6->88.0 0.94   163.7->156.3 0.95
    gpt2  128/256/8/8192/2/8      512  156.7->156.6 1.00 290.9->311 1.07   132.0->127.4 0.96 269.4->251.2 0.93
    llama 128/256/8/8192/2/8/4    384  171.2->172.1 1.01 291.4->312 1.07   139.9->144.8 1.03 267.8->259.2 0.97
    with segment ids (packed batches):
    gpt2  128/128/8/2048/2/4      512  34.5->37.5 1.09   72.9->74.9 1.03   -                 -
    llama 128/128/8/2048/2/4/2    384  42.0->38.0 0.90   70.2->72.1 1.03   -                 -
    gpt2  192/256/4/2048/3/6      576  -                 -                 71.1->63.8 0.90   140.5->125.6 0.89
    llama 192/256/4/2048/3/6/3    960  -                 -                 94.0->88.4 0.94   163.8->156.5 0.96

All 88 within 20% (0.84-1.11), measured before the CPU's blocked attention. Since then, an
unrolled bf16 stack whose attention takes the blocked path (more than one query block, T >= 128)
keeps its saved tensors in f32 like a scanned one: ``python bench/estimate_check.py`` (bf16,
micro-batch 8) gives 1.12, 1.14, 1.00 and 1.03 on its four models without checkpointing
(counted as bf16 they were 0.77-0.87) and 0.86-1.04 with it. Also checked: gradient accumulation
(micro-batch 2 of 8 sequences: 1.10 and 1.03), pure data parallelism on 8 host devices (1.00),
tensor parallelism over 2 (1.00), GPT-2 with all dropouts at 0.1 (0.90 and 1.01).

Accelerators (``platform`` other than ``"cpu"``). On a GPU, layer stacks without checkpointing
are unrolled (:func:`~lm_pipeline.models.layers.scan_blocks`), which changes what XLA keeps:

* each layer's weights are cast to the compute dtype just before use, so no whole
  compute-dtype copy is counted (on one device; the FSDP-gathered copy still is);
* the update is fused with its inputs: no separate update buffer;
* the logits' cotangent is computed fused into its compute-dtype cast: one ``[B, T, V]``
  buffer of the compute dtype, the peak phase;
* without checkpointing, XLA keeps ``ACCELERATOR_SAVED_FACTOR = 0.47`` of the layers' traced
  residuals (its fusions recompute cheap elementwise results in the backward pass).

Calibrated with ``python bench/estimate_check.py --grid gpu`` (compile-only, XLA's plan of the
real step) on an NVIDIA H100 80GB (JAX 0.11.2, cuDNN attention, ``p=f32,c=bfloat16``), GiB::

    model D/T/B/V/L                  no remat                remat
    gpt2  768/1024/32/50257/12       19.12 -> 18.52  0.97    8.42 -> 8.95  1.06
    gpt2  768/1024/8/50257/12         6.00 ->  6.07  1.01    3.32 -> 3.68  1.11
    llama 1024/2048/8/32000/24       19.11 -> 19.52  1.02    7.58 -> 8.46  1.12
    llama 1024/2048/4/32000/24       11.93 -> 12.59  1.06    6.26 -> 7.02  1.12
    gpt2  512/512/16/16384/6          1.81 ->  1.80  0.99    0.93 -> 1.01  1.09
    llama 512/1024/8/16384/8          1.98 ->  2.09  1.05    1.09 -> 1.21  1.11

(Before this model, counting the traced residuals as on the CPU, the same rows came out
1.31-1.82x high and ``per_device_parallelism: auto`` halved the 350M Llama's micro-batch.)
The device's measured peak (``memory_stats()["peak_bytes_in_use"]`` after real steps,
``bench/gpu_mfu.py``) equalled XLA's plan: GPT-2 124M at 32 x 1024, 19.1 GiB (estimate
18.5); Llama 350M at 16 x 2048, 33.3 GiB (estimate 33.4). Not calibrated: multi-GPU FSDP and
stacks deeper than ``layers.ACCELERATOR_UNROLL_MAX_LAYERS`` (scanned).

FSDP caveat: on this JAX/XLA the trainer's default FSDP (``fsdp_axis: embed``) does not keep
activations batch-sharded: with no sharding constraint on activations, XLA's propagation
follows the ``embed``-sharded weights, so every device computes the whole micro-batch
(8 host devices, GPT-2 256/256/16/8192/4/8: 269 MiB per device measured vs 118 MiB with
``fsdp_axis: null``). The estimate assumes the intended behaviour: batch-sharded activations
and parameters gathered for compute, as measured when the parameters are resharded to the
compute mapping inside the loss (1.00-1.09 on 4 and 8 host devices).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from lm_pipeline.compute import REFERENCE, ComputePlan, plan_for
from lm_pipeline.schema import ConfigError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from lm_pipeline.config import RunConfig

# --- calibrated constants (see the module docstring) ------------------------------------------

HEAD_GRAD_BUFFERS = 1.0
"""[B, T, V] f32 buffers of the loss/head backward on top of the saved logits residuals."""

ATTN_BWD_FACTOR = 0.5
"""Working set of one layer's attention backward (the f32 score / probability cotangents), as
a multiple of that layer's saved [.., T, T] attention tensors."""

CPU_ACTIVATION_BYTES = 4
"""Bytes per element of sub-f32 saved tensors on XLA:CPU (see the module docstring)."""

ACCELERATOR_SAVED_FACTOR = 0.47
"""On GPU/TPU, the share of the layers' traced saved tensors (without checkpointing) that XLA
keeps: its fusions recompute cheap elementwise results in the backward pass instead of storing
them (fitted on an H100, see the module docstring)."""

GIB = 1024**3
MIB = 1024**2


# --- the result -------------------------------------------------------------------------------


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
            lines.append(f"{name:<44}{n:>16,}{'':>4}{_size(n):>11}{('  ' + note) if note else ''}")

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
            f"(with gradient_checkpointing {'on' if other else 'off'}: total {_size(self.total_for(other))}, "
            f"activations {_size((self.activations_remat if other else self.activations_no_remat).peak)})"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(total=self.total, activations=self.activations,
                   total_remat=self.total_for(True), total_no_remat=self.total_for(False))
        return out


def _size(n: float) -> str:
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


# --- shapes -----------------------------------------------------------------------------------


def _is_array_like(x: Any) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


@functools.lru_cache(maxsize=32)
def _abstract_model(model_cfg, vocab_size: int):
    def make(key_data):
        return model_cfg.build(vocab_size, key=jax.random.wrap_key_data(key_data))

    return eqx.filter_eval_shape(make, jax.ShapeDtypeStruct((2,), jnp.uint32))


def _shard_factors(spec, shape, mapping: dict, mesh_shape: dict) -> tuple[int, int]:
    """How many ways a parameter is split, in total and over the ``data`` axis alone:
    :meth:`MeshPlan.param_shardings`, in arithmetic."""
    used: set[str] = set()
    factor = data = 1
    for i, name in enumerate(spec):
        axis = mapping.get(name) if name is not None else None
        if axis is not None and (axis in used or shape[i] % mesh_shape[axis]):
            axis = None
        if axis is not None:
            used.add(axis)
            factor *= mesh_shape[axis]
            data *= mesh_shape[axis] if axis == "data" else 1
    return factor, data


def _sharded_bytes(leaf, factor: int, dtype=None) -> int:
    itemsize = jnp.dtype(dtype if dtype is not None else leaf.dtype).itemsize
    return -(-math.prod(leaf.shape) // factor) * itemsize


def _optimizer_bytes(opt_cfg, params, axes, factors) -> int:
    """Bytes per device of the optimizer state, from its traced shapes."""
    from lm_pipeline.train.optim import weight_decay_mask

    tx = opt_cfg.build(1000, weight_decay_mask(params, axes))
    state = jax.eval_shape(tx.init, params)
    try:
        per_leaf = optax.tree_map_params(
            tx, lambda p, f: f, state, factors, transform_non_params=lambda _: 1,
            is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct),
        )
        pairs = zip(jax.tree.leaves(state), jax.tree.leaves(per_leaf), strict=True)
        return sum(_sharded_bytes(s, int(f)) for s, f in pairs)
    except Exception:  # pragma: no cover - a state optax cannot map: assume AdamW (mu + nu, f32)
        pairs = zip(jax.tree.leaves(params), jax.tree.leaves(factors), strict=True)
        return 2 * sum(_sharded_bytes(p, f, jnp.float32) for p, f in pairs)


# --- traced activations -----------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def saved_activations(
    model_cfg, vocab_size: int, batch: int, compute_dtype: str, segments: bool, plan: ComputePlan = REFERENCE
) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Shapes of the tensors ``jax.vjp`` of the loss (from the logits) saves for the backward pass
    (``batch`` sequences, the model computing as ``plan`` says, its remat policy included),
    excluding the (compute-dtype) parameters themselves."""
    from lm_pipeline.train.loss import next_token_loss_sums

    abstract = _abstract_model(model_cfg, vocab_size)
    params, static = eqx.partition(abstract, _is_array_like)
    compute = jnp.dtype(compute_dtype)

    def cast(x):
        return jax.ShapeDtypeStruct(x.shape, compute) if jnp.issubdtype(x.dtype, jnp.floating) else x

    params_c = jax.tree.map(cast, params)
    dropout_active = any(getattr(model_cfg, n, 0.0) > 0 for n in ("embed_pdrop", "resid_pdrop", "attn_pdrop"))
    tokens = jax.ShapeDtypeStruct((batch, model_cfg.seq_len), jnp.int32)
    seg = tokens if segments else None

    def residuals(p, tokens, seg, key_data):
        key = jax.random.wrap_key_data(key_data) if dropout_active else None

        def loss(p):
            model = eqx.combine(p, static)
            logits = model(tokens, seg, key=key, inference=not dropout_active, plan=plan)
            return next_token_loss_sums(logits, tokens, seg)[0]

        _, vjp_fn = jax.vjp(loss, p)
        inputs = {id(x) for x in jax.tree.leaves(p)}
        return [x for x in jax.tree.leaves(vjp_fn) if id(x) not in inputs and hasattr(x, "shape")]

    out = jax.eval_shape(residuals, params_c, tokens, seg, jax.ShapeDtypeStruct((2,), jnp.uint32))
    return tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in out)


@dataclass(frozen=True)
class _Saved:
    total: int
    attention: int
    logits: int


def _classify(
    res, *, seq_len: int, vocab: int, mlp_dims: tuple[int, ...], model_size: int, act_bytes: int | None,
    upcast_only_attention: bool = False, num_heads: int = 0,
) -> _Saved:
    """Bytes of saved tensors: all, the [.., T, T] attention ones and those with a vocab dim."""
    total = attention = logits = 0
    for x in res:
        # [.., T, T] attention tensors: [L, B, K, G, T, T] / [B, K, G, T, T] / [B, 1, T, T] masks /
        # [B, N, T, T] scores (dims >= 5, a 4-d boolean, or 4-d with N heads: a 4-d float
        # [L, B, T, D] may have D == T).
        ndim = len(x.shape)
        is_attn = ndim >= 4 and tuple(x.shape[-2:]) == (seq_len, seq_len) and (
            ndim >= 5 or x.dtype == jnp.bool_ or x.shape[-3] == num_heads)
        is_logit = ndim >= 2 and x.shape[-1] == vocab and not is_attn
        itemsize = x.dtype.itemsize  # also defined for PRNG key dtypes (dropout keys)
        upcast = act_bytes is not None and not is_logit and (is_attn or not upcast_only_attention)
        if upcast and jnp.issubdtype(x.dtype, jnp.floating) and itemsize < act_bytes:
            itemsize = act_bytes  # XLA:CPU upcasts elementwise work; the LM head's dot output stays bf16
        n = math.prod(x.shape) * itemsize
        if model_size > 1 and (ndim >= 5 or is_logit or any(d in mlp_dims for d in x.shape)):
            n = -(-n // model_size)
        total += n
        attention += n if is_attn else 0
        logits += n if is_logit else 0
    return _Saved(total, attention, logits)


def _activations(model_cfg, vocab: int, batch: int, compute_dtype: str, segments: bool, *,
                 remat: bool, model_size: int, platform: str) -> Activations:
    from lm_pipeline.kernels.cpu.blocked_attention import num_query_blocks

    cfg = dataclasses.replace(model_cfg, gradient_checkpointing=remat)
    plan = plan_for(platform, compute_dtype, num_devices=1)
    layers = model_cfg.num_layers
    mlp = tuple(d for d in (getattr(model_cfg, "mlp_dim", None), getattr(model_cfg, "intermediate_dim", None)) if d)
    on_cpu = platform == "cpu"
    act_bytes = CPU_ACTIVATION_BYTES if on_cpu else None
    kw = dict(seq_len=model_cfg.seq_len, vocab=vocab, mlp_dims=mlp, model_size=model_size, act_bytes=act_bytes,
              num_heads=getattr(model_cfg, "num_heads", 0))
    # On XLA:CPU, bf16 tensors saved into a scan's stacked buffers go through f32; those of an
    # unrolled stack (``scan_blocks`` unrolls short low-precision stacks without checkpointing)
    # or recomputed inside one layer stay bf16, except attention's -- as long as attention
    # takes XLA's path (one query block); with the blocked attention they measured f32 too.
    unrolled = (on_cpu and not remat and plan.remat_policy() is None and plan.unroll(layers)
                and num_query_blocks(model_cfg.seq_len) == 1)

    # Without checkpointing a CPU f32 step keeps only matmul and attention outputs per layer.
    dots = not remat and plan.remat_policy() is not None

    def saved(num_layers: int, remat_: bool, only_attention: bool, p: ComputePlan) -> _Saved:
        c = dataclasses.replace(cfg, num_layers=num_layers, gradient_checkpointing=remat_)
        res = saved_activations(c, vocab, batch, compute_dtype, segments, p)
        return _classify(res, upcast_only_attention=only_attention, **kw)

    one, two = saved(1, remat, unrolled, plan), saved(2, remat, unrolled, plan)
    per_layer = _Saved(two.total - one.total, two.attention - one.attention, two.logits - one.logits)
    total = one.total + (layers - 1) * per_layer.total
    attention = one.attention + (layers - 1) * per_layer.attention
    logits = one.logits + (layers - 1) * per_layer.logits
    # The logits' cotangent is computed in f32 (softmax - onehot), then cast; on accelerators
    # that computation is fused into the cast, so one compute-dtype buffer.
    logits_grad = batch * model_cfg.seq_len * vocab * (4 if on_cpu else jnp.dtype(compute_dtype).itemsize)
    logits_grad //= model_size if model_size > 1 and vocab % model_size == 0 else 1
    if not on_cpu:
        if not remat:  # XLA's fusions keep about half of what autodiff saves per layer
            layers_saved = int(ACCELERATOR_SAVED_FACTOR * (total - logits))
            total, per_layer = layers_saved + logits, dataclasses.replace(
                per_layer, total=int(ACCELERATOR_SAVED_FACTOR * per_layer.total))
        # the head's cotangent is the peak; layers' backward buffers come and go within it
        return Activations(
            saved=total, saved_per_layer=per_layer.total, attention=attention, logits=logits,
            head_backward=total + logits_grad, layer_backward=total - logits,
        )
    head = total + int(HEAD_GRAD_BUFFERS * logits_grad)
    # One layer's full saved set (what a checkpointed layer recomputes in its backward pass).
    if remat or dots:
        plain = dataclasses.replace(plan, remat="none")
        one_nr, two_nr = (dataclasses.astuple(saved(n, False, True, plain)) for n in (1, 2))
        full = _Saved(*(b - a for a, b in zip(one_nr, two_nr, strict=True)))
    else:
        full = per_layer
    # Layer backward: everything saved but the logits residuals, the recomputed layer (with
    # checkpointing), and the attention backward's working set.
    # (under the dots policy a layer recomputes only what lies between its saved matmul outputs)
    recomputed = full.total if remat else max(0, full.total - per_layer.total) if dots else 0
    layer = total - logits + recomputed + int(ATTN_BWD_FACTOR * full.attention)
    return Activations(
        saved=total, saved_per_layer=per_layer.total, attention=attention, logits=logits,
        head_backward=head, layer_backward=layer,
    )


# --- the estimate -----------------------------------------------------------------------------


def _micro_batch(trainer_cfg, data_size: int, micro_batch_per_device: int | None) -> int:
    if micro_batch_per_device is None:
        per = trainer_cfg.per_device_parallelism
        micro_batch_per_device = per if isinstance(per, int) and per > 0 else trainer_cfg.train_batch_size // data_size
    return max(1, int(micro_batch_per_device))


def estimate(
    cfg: RunConfig,
    *,
    num_devices: int,
    vocab_size: int | None = None,
    micro_batch_per_device: int | None = None,
    platform: str | None = None,
    segments: bool | None = None,
) -> Estimate:
    """Estimate parameters, FLOPs and per-device memory of ``cfg`` (a :class:`RunConfig`) on
    ``num_devices`` devices, without compiling anything.

    vocab_size: default ``cfg.data.tokenizer.vocab_size``.
    micro_batch_per_device: sequences per device per micro-batch; default from
        ``trainer.per_device_parallelism`` (-1: the whole batch, ``train_batch_size / data``).
    platform: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (default: JAX's default backend); on CPU,
        most saved bf16 tensors are counted as f32 (see the module docstring).
    segments: whether batches carry segment ids (default: ``data.packing`` is not ``concat``).
    """
    from lm_pipeline.train.sharding import axis_mappings

    tc, mc = cfg.trainer, cfg.model
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    if num_devices % tc.model_axis_size:
        raise ConfigError(
            "trainer.model_axis_size",
            f"{tc.model_axis_size} does not divide the {num_devices} devices; use a divisor of {num_devices}",
        )
    vocab = int(vocab_size if vocab_size is not None else cfg.data.tokenizer.vocab_size)
    model_size = tc.model_axis_size
    data_size = num_devices // model_size
    micro = _micro_batch(tc, data_size, micro_batch_per_device)
    if tc.train_batch_size % (micro * data_size):
        raise ConfigError(
            "trainer.train_batch_size",
            f"{tc.train_batch_size} is not divisible by the micro-batch ({micro} per device) x "
            f"data-parallel devices ({data_size}) = {micro * data_size}",
        )
    accum = tc.train_batch_size // (micro * data_size)
    platform = (platform or jax.default_backend()).lower()
    if segments is None:
        segments = getattr(cfg.data, "packing", "concat") != "concat"
    precision = tc.precision
    compute = jnp.dtype(precision.compute)

    abstract = _abstract_model(mc, vocab)
    params = eqx.filter(abstract, _is_array_like)
    axes = abstract.param_axes()
    mapping = axis_mappings(tc)[0]
    mesh_shape = {"data": data_size, "model": model_size}
    param_leaves, treedef = jax.tree.flatten(params)
    specs = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, P))
    both = [_shard_factors(s, p.shape, mapping, mesh_shape) for s, p in zip(specs, param_leaves, strict=True)]
    factors = jax.tree.unflatten(treedef, [f for f, _ in both])
    leaves = [(p, f, d) for p, (f, d) in zip(param_leaves, both, strict=True)]
    num_params = sum(math.prod(p.shape) for p, _, _ in leaves)
    param_bytes = sum(_sharded_bytes(p, f) for p, f, _ in leaves)
    grad_bytes = sum(_sharded_bytes(p, f, jnp.float32) for p, f, _ in leaves)
    # FSDP: parameters sharded over ``data`` are gathered for compute (in the compute dtype) and
    # their f32 gradients exist unsharded over ``data`` until reduce-scattered.
    floating = [(p, f, d) for p, f, d in leaves if jnp.issubdtype(p.dtype, jnp.floating)]
    # On accelerators the unrolled layers cast (and, under FSDP, gather) each layer's weights
    # just before use: only the gathered copies are counted, not a whole compute-dtype copy.
    on_cpu = platform == "cpu"
    compute_copy = sum(_sharded_bytes(p, f // d, compute) for p, f, d in floating
                       if d > 1 or (on_cpu and jnp.dtype(p.dtype) != compute))
    backward_grads = sum(_sharded_bytes(p, f // d, jnp.float32) for p, f, d in leaves)
    opt_bytes = _optimizer_bytes(cfg.optimizer, params, axes, factors)
    rows = -(-tc.train_batch_size // data_size)
    batch_bytes = rows * mc.seq_len * 4 * (2 if segments else 1)

    acts = {
        remat: _activations(mc, vocab, micro, compute.name, segments, remat=remat, model_size=model_size,
                            platform=platform)
        for remat in (True, False)
    }
    return Estimate(
        model_type=getattr(mc, "type", type(mc).__name__),
        num_params=num_params,
        flops_per_token=float(mc.flops_per_token(vocab)),
        vocab_size=vocab,
        seq_len=mc.seq_len,
        num_devices=num_devices,
        data_size=data_size,
        model_size=model_size,
        train_batch_size=tc.train_batch_size,
        micro_batch_per_device=micro,
        accum_steps=accum,
        param_dtype=str(np.dtype(jax.tree.leaves(params)[0].dtype)),
        compute_dtype=compute.name,
        platform=platform,
        gradient_checkpointing=bool(getattr(mc, "gradient_checkpointing", False)),
        params=param_bytes,
        optimizer=opt_bytes,
        gradients=grad_bytes,
        grad_accumulator=grad_bytes if accum > 1 else 0,
        compute_copy=compute_copy,
        backward_gradients=backward_grads,
        batch=batch_bytes,
        update_buffer=grad_bytes if on_cpu else 0,  # fused into the update on accelerators
        activations_remat=acts[True],
        activations_no_remat=acts[False],
    )


def compiled_step_bytes(cfg: RunConfig, vocab_size: int, *, segments: bool = False) -> int:
    """What XLA plans for the real train step of ``cfg`` on one device, without running it:
    ``argument + output - alias + temp`` bytes of the compiled step's memory analysis (the
    state is donated, so outputs alias arguments; ``temp`` packs every intermediate at its
    peak). The figure :attr:`Estimate.total` is calibrated against."""
    from lm_pipeline.train.sharding import make_mesh
    from lm_pipeline.train.trainer import build_step_functions

    plan = make_mesh(cfg.trainer, jax.devices()[:1])
    fns = build_step_functions(cfg.model, cfg.optimizer, cfg.trainer, vocab_size=vocab_size, num_train_steps=10,
                               plan=plan, has_segments=segments)
    tokens = jax.ShapeDtypeStruct((cfg.trainer.train_batch_size, cfg.model.seq_len), jnp.int32)
    with jax.set_mesh(plan.mesh):
        compiled = fns.train_step.lower(fns.abstract_state, tokens, tokens if segments else None).compile()
    return planned_bytes(compiled)


def planned_bytes(compiled: Any) -> int | None:
    """Peak bytes of a compiled step from XLA's memory analysis (``argument + output - alias +
    temp``), or None where the backend gives no analysis."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def micro_batch_candidates(train_batch_size: int, data_size: int) -> list[int]:
    """Per-device micro-batches ``m`` the trainer accepts: ``m * data_size`` divides the batch."""
    if train_batch_size % data_size:
        return []
    per_device = train_batch_size // data_size
    return [m for m in range(1, per_device + 1) if per_device % m == 0]


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
    candidates = micro_batch_candidates(cfg.trainer.train_batch_size, data_size)
    if not candidates:
        raise ConfigError(
            "trainer.train_batch_size",
            f"{cfg.trainer.train_batch_size} is not divisible by the {data_size} data-parallel devices",
        )
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
        f"even a micro-batch of 1 sequence per device needs about {_size(smallest.total)} per device, "
        f"more than the budget of {_size(budget_bytes)}; use more devices (FSDP shards parameters and "
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
    log.info("per_device_parallelism: auto -> %d sequences per device (budget %s per device)", per, _size(budget))
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
