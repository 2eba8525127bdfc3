"""Parameters, FLOPs and per-device memory of a training run, estimated before anything runs.

:func:`estimate` answers "how big is this model, and does one train step fit on my devices?"
from the config alone: no compilation and no device arrays. Shapes come from tracing with
``jax.eval_shape`` (the model's parameters and logical axes, the optimizer state, and the
tensors autodiff saves for the backward pass); everything else is arithmetic.
:func:`auto_micro_batch` picks the largest per-device micro-batch that fits a memory budget.

What is counted (bytes per device; "sharded" = divided by the mesh axes the parameter axis
mapping puts on each axis, on a mesh ``data = num_devices / model_axis_size`` x ``model``, and
only where the axis size divides evenly, exactly as :meth:`MeshPlan.param_shardings` does)

* **parameters**: each leaf in its own dtype (f32: the trainer keeps master weights in f32),
  sharded.
* **optimizer**: the optimizer state as ``OptimizerConfig.build(...).init`` shapes it (AdamW:
  ``mu`` and ``nu`` in f32 plus a few scalars), sharded like the parameters.
* **gradients**: f32, sharded like the parameters.
* **gradient accumulator**: with gradient accumulation (``accum > 1``) the scan carries a
  second f32 gradient tree.
* **compute copy**: when ``mp`` computes in another dtype than the parameters' (e.g.
  ``p=f32,c=bf16``), ``cast_floating`` makes a copy of every parameter in the compute dtype.
* **batch**: the int32 token (and segment id) arrays of one step.
* **activations** of one micro-batch (``micro_batch_per_device`` sequences), for gradient
  checkpointing on and off. The tensors autodiff saves for the backward pass are *traced*,
  not hand-counted: :func:`saved_activations` runs ``jax.vjp`` of the trainer's own loss
  (``cast_floating`` -> model -> :func:`~lm_pipeline.train.trainer.next_token_loss_sums`)
  under ``jax.eval_shape`` for a 1-layer and a 2-layer copy of the model; the difference is
  one layer's saved tensors (with checkpointing: the block input only, ``[B, T, D]``), and
  the rest is what does not repeat per layer (embeddings, the final norm, the logits /
  cross-entropy residuals ``[B, T, V]``). Attention implementations that materialise the
  ``[B, N, T, T]`` scores and probabilities (``jax.nn.dot_product_attention``'s XLA path,
  the only one on CPU, and the softmax path with dropout) show up as such residuals; a fused
  kernel that does not save them would not. Dropout masks are counted when dropout is on.
  On top of the saved tensors the backward pass needs working buffers, modelled as two
  phases of which the larger is the peak:

  - *loss/head backward*: all saved tensors + ``HEAD_GRAD_BUFFERS`` x ``[B, T, V]`` f32
    (the logits' cotangent and the buffers XLA allocates around the LM-head matmuls);
  - *layer backward*: all saved tensors except the logits residuals + the recomputed saved
    tensors of one layer (gradient checkpointing re-runs the layer's forward) scaled by
    ``LAYER_BWD_FACTOR`` (``ATTN_BWD_FACTOR`` for its ``[.., T, T]`` attention tensors, whose
    backward also holds the f32 score and probability cotangents).

* **total** = parameters + optimizer + batch + gradients + gradient accumulator + compute copy
  + max(activations, optimizer update buffer). The update buffer (one f32 parameter-sized
  tree: the clipped, scaled update that ``optax.apply_updates`` and the ``update_norm``
  metric both read) is alive only after the activations are freed, hence the max.

Sharding of activations: the batch is split over ``data`` (the traces use the per-device
micro-batch); with tensor parallelism (``model_axis_size > 1``) saved tensors with a heads,
MLP or vocab dimension (recognised by shape: 4+ dims, or a dimension equal to the MLP width or
the vocabulary) are divided by ``model_axis_size``. FSDP's all-gathered layer weights, the
collectives' buffers and TP are *not* calibrated (no multi-device measurements); the
single-device terms below are.

Constants and calibration
-------------------------
Calibrated against XLA's buffer assignment of the real train step
(``build_step_functions(...).train_step.lower(state, tokens, None).compile()
.memory_analysis()``) on a 1-device CPU mesh, JAX 0.10.2. XLA's figure for the peak is
``argument_size + output_size - alias_size + temp_size`` (the state is donated, so outputs
alias arguments; ``temp_size`` is the size of the one temp allocation XLA packs all
intermediates into, i.e. their peak with reuse). The comparable estimate is :attr:`Estimate.total`.
CPU-specific: XLA:CPU computes most bf16 elementwise work in f32, so on ``platform="cpu"``
bf16 activations are counted at 4 bytes (``CPU_ACTIVATION_BYTES``); on GPU/TPU they are
counted in their traced dtype (not calibrated here: no accelerator was available).

CALIBRATION_TABLE_PLACEHOLDER
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from lm_pipeline.schema import ConfigError

# --- calibrated constants (see the module docstring) ------------------------------------------

HEAD_GRAD_BUFFERS = 1.0
"""[B, T, V] f32 buffers of the loss/head backward on top of the saved logits residuals."""

ATTN_BWD_FACTOR = 0.5
"""Working set of one layer's attention backward (the f32 score / probability cotangents), as
a multiple of that layer's saved [.., T, T] attention tensors."""

CPU_ACTIVATION_BYTES = 4
"""Bytes per element of sub-f32 activations on XLA:CPU (which upcasts bf16 arithmetic)."""

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
            f"model: {self.model_type}, {_count(self.num_params)} parameters, vocab {self.vocab_size}, seq_len {self.seq_len}",
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
            gathered = ", gathered over data" if self.fsdp else ""
            row(f"parameters in compute dtype ({self.compute_dtype}{gathered})", self.compute_copy)
        if self.fsdp:
            row("gradients during backward (f32, unsharded)", self.backward_gradients)
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


def _nbytes(x: Any) -> int:
    return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


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
        return 2 * sum(_sharded_bytes(p, f, jnp.float32) for p, f in zip(jax.tree.leaves(params), jax.tree.leaves(factors)))


# --- traced activations -----------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def saved_activations(model_cfg, vocab_size: int, batch: int, compute_dtype: str, segments: bool) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Shapes of the tensors ``jax.vjp`` of the trainer's loss saves for the backward pass
    (``batch`` sequences), excluding the (compute-dtype) parameters themselves."""
    from lm_pipeline.train.trainer import next_token_loss_sums

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
            logits = model(tokens, seg, key=key, inference=not dropout_active)
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


def _classify(res, *, seq_len: int, vocab: int, mlp_dims: tuple[int, ...], model_size: int, act_bytes: int | None) -> _Saved:
    total = attention = logits = 0
    for x in res:
        # [.., T, T] attention tensors: [L, B, K, G, T, T] / [B, K, G, T, T] / [B, 1, T, T] masks
        # (dims >= 5, or a 4-d boolean: a 4-d float [L, B, T, D] may have D == T).
        ndim = len(x.shape)
        is_attn = ndim >= 4 and tuple(x.shape[-2:]) == (seq_len, seq_len) and (ndim >= 5 or x.dtype == jnp.bool_)
        is_logit = ndim >= 2 and x.shape[-1] == vocab and not is_attn
        itemsize = jnp.dtype(x.dtype).itemsize
        if act_bytes is not None and not is_logit and jnp.issubdtype(x.dtype, jnp.floating) and itemsize < act_bytes:
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
    cfg = dataclasses.replace(model_cfg, gradient_checkpointing=remat)
    layers = model_cfg.num_layers
    mlp = tuple(d for d in (getattr(model_cfg, "mlp_dim", None), getattr(model_cfg, "intermediate_dim", None)) if d)
    act_bytes = CPU_ACTIVATION_BYTES if platform == "cpu" else None
    kw = dict(seq_len=model_cfg.seq_len, vocab=vocab, mlp_dims=mlp, model_size=model_size, act_bytes=act_bytes)

    def saved(num_layers: int, remat_: bool) -> _Saved:
        c = dataclasses.replace(cfg, num_layers=num_layers, gradient_checkpointing=remat_)
        return _classify(saved_activations(c, vocab, batch, compute_dtype, segments), **kw)

    one, two = saved(1, remat), saved(2, remat)
    per_layer = _Saved(two.total - one.total, two.attention - one.attention, two.logits - one.logits)
    total = one.total + (layers - 1) * per_layer.total
    attention = one.attention + (layers - 1) * per_layer.attention
    logits = one.logits + (layers - 1) * per_layer.logits
    # One layer's full saved set (what a checkpointed layer recomputes in its backward pass).
    full = per_layer if not remat else _Saved(
        *(b - a for a, b in zip(dataclasses.astuple(saved(1, False)), dataclasses.astuple(saved(2, False)), strict=True))
    )
    # The logits' cotangent is computed in f32 (softmax - onehot), then cast.
    logits_grad = batch * model_cfg.seq_len * vocab * 4
    logits_grad //= model_size if model_size > 1 and vocab % model_size == 0 else 1
    head = total + int(HEAD_GRAD_BUFFERS * logits_grad)
    # Layer backward: everything saved but the logits residuals, the recomputed layer (with
    # checkpointing), and the attention backward's working set.
    recomputed = full.total if remat else 0
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
    cfg,
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
        bf16 activations are counted as f32 (see the module docstring).
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
    global_micro = micro * data_size
    accum = max(1, tc.train_batch_size // global_micro)
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
    compute_copy = sum(_sharded_bytes(p, f // d, compute) for p, f, d in floating
                       if d > 1 or jnp.dtype(p.dtype) != compute)
    backward_grads = sum(_sharded_bytes(p, f // d, jnp.float32) for p, f, d in leaves)
    opt_bytes = _optimizer_bytes(cfg.optimizer, params, axes, factors)
    rows = -(-tc.train_batch_size // data_size)
    batch_bytes = rows * mc.seq_len * 4 * (2 if segments else 1)

    acts = {
        remat: _activations(mc, vocab, micro, compute.name, segments, remat=remat, model_size=model_size, platform=platform)
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
        update_buffer=grad_bytes,
        activations_remat=acts[True],
        activations_no_remat=acts[False],
    )


def micro_batch_candidates(train_batch_size: int, data_size: int) -> list[int]:
    """Per-device micro-batches ``m`` the trainer accepts: ``m * data_size`` divides the batch."""
    if train_batch_size % data_size:
        return []
    per_device = train_batch_size // data_size
    return [m for m in range(1, per_device + 1) if per_device % m == 0]


def auto_micro_batch(
    cfg,
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
