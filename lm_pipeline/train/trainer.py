"""The trainer: a jitted, donated, sharded train step and the loop around it.

The whole train state is one pytree (:class:`TrainState`), so a checkpoint is that pytree and
resuming restores it exactly. The batch for step k comes from a step-indexed source, so a
resumed run sees the same batches as an uninterrupted one. Parameters are sharded by the
parameter axis mapping (FSDP / tensor parallel), batches by the compute mapping.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from lm_pipeline.batch import LmBatch, SequenceDataset, device_put_batch
from lm_pipeline.compute import REFERENCE, ComputePlan, hints_from, plan_for_mesh
from lm_pipeline.models.base import LmModel
from lm_pipeline.train.config import Precision, TrainerConfig
from lm_pipeline.train.loss import model_loss_sums, training_loss_sums
from lm_pipeline.train.optim import averaged_params, current_lr, loss_scale, skipped_steps, weight_decay_mask
from lm_pipeline.train.optim_config import OptimizerConfig
from lm_pipeline.train.sharding import MeshPlan

log = logging.getLogger(__name__)


class TrainState(eqx.Module):
    """Everything a resumed run needs: step, parameters, optimizer state, PRNG key data."""

    step: jax.Array
    model: LmModel
    opt_state: Any
    key: jax.Array


def cast_floating(tree: Any, dtype) -> Any:
    """Cast the floating-point arrays of a pytree to ``dtype`` (others untouched)."""

    def cast(x):
        if eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


def _is_array_like(x) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


# --- the step ---------------------------------------------------------------------------------

StepFn = Callable[[TrainState, jax.Array, jax.Array | None], tuple[TrainState, dict[str, jax.Array]]]


@dataclass
class StepFunctions:
    """Compiled pieces bound to one model shape, mesh, optimizer and compute plan."""

    init: Callable[[jax.Array], TrainState]
    train_step: StepFn
    eval_step: Callable[[TrainState, jax.Array, jax.Array | None], tuple[jax.Array, jax.Array]]
    state_shardings: Any
    abstract_state: Any
    compute: ComputePlan
    micro_batch_rows: int = 0  # rows of one micro-batch over all data-parallel devices
    accumulation_steps: int = 1  # micro-batches accumulated by train_step (what its scan runs)
    batch_rows: int = 0  # the global batch train_step takes (a schedule's first size)
    # a batch-size schedule's other sizes: one compiled step each (their own micro-batch split)
    other_train_steps: Mapping[int, StepFn] = field(default_factory=dict)
    loss_mask: bool = False  # train/eval steps take a 4th argument: the batch's loss mask (chat sources)

    def train_step_for(self, batch_rows: int) -> StepFn:
        """The train step of a global batch of ``batch_rows`` rows."""
        return self.train_step if batch_rows == self.batch_rows else self.other_train_steps[batch_rows]


def micro_batches(trainer_cfg: TrainerConfig, plan: MeshPlan, batch_size: int | None = None) -> tuple[int, int]:
    """(rows per micro-batch over all data-parallel devices, micro-batches per step) of a global
    batch of ``batch_size`` rows (default ``trainer.train_batch_size``; one size of a schedule)."""
    if trainer_cfg.per_device_parallelism == "auto":
        raise ValueError(
            "per_device_parallelism: 'auto' must be resolved before building the step "
            "(lm_pipeline.estimate.resolve_auto_parallelism; train() does it)"
        )
    per_device, accum = trainer_cfg.micro_batching(plan.data_size, trainer_cfg.per_device_parallelism, batch_size)
    return per_device * plan.data_size, accum


@dataclass(frozen=True)
class _Layout:
    """Where the train state lives and how it is built: shapes, shardings, optimizer."""

    tx: optax.GradientTransformation
    model_static: Any
    param_shardings: Any
    compute_shardings: Any
    state_shardings: Any
    abstract_state: Any
    init_arrays: Callable[[jax.Array], TrainState]


def _layout(model_cfg, opt_cfg: OptimizerConfig, precision: Precision, vocab_size: int, num_train_steps: int,
            plan: MeshPlan) -> _Layout:
    def make_model(key):
        return model_cfg.build(vocab_size, key=key)

    # Shapes and logical axes without allocating anything.
    abstract_model = eqx.filter_eval_shape(make_model, jax.random.key(0))
    model_arrays, model_static = eqx.partition(abstract_model, _is_array_like)
    axes = abstract_model.param_axes()
    param_shardings = plan.param_shardings(axes, model_arrays)
    tx = opt_cfg.build(num_train_steps, weight_decay_mask(model_arrays, axes), loss_scaling=precision.uses_loss_scaling,
                       param_axes=axes)
    replicated = plan.replicated()

    def init_arrays(key_data):
        init_key, state_key = jax.random.split(jax.random.wrap_key_data(key_data))
        params = eqx.filter(make_model(init_key), eqx.is_array)
        params = jax.lax.with_sharding_constraint(params, param_shardings)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), jax.random.key_data(state_key))

    abstract = jax.eval_shape(init_arrays, jax.ShapeDtypeStruct((2,), jnp.uint32))
    # Optimizer leaves shaped like parameters follow the parameters' sharding.
    opt_shardings = optax.tree_map_params(
        tx, lambda _p, s: s, abstract.opt_state, param_shardings, transform_non_params=lambda _: replicated
    )
    state_shardings = TrainState(replicated, param_shardings, opt_shardings, replicated)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_shardings)
    # Parameters at rest follow the parameter mapping (FSDP shards `embed` over `data`); for
    # compute they are gathered to the compute mapping, so activations stay split by batch
    # rather than following the weights' sharding.
    compute_shardings = MeshPlan(plan.mesh, plan.compute_mapping, plan.compute_mapping).param_shardings(axes, model_arrays)
    return _Layout(tx, model_static, param_shardings, compute_shardings, state_shardings, abstract, init_arrays)


@dataclass(frozen=True)
class _StepContext:
    """What the step computes with, fixed when the step functions are built (closed over by jit)."""

    lay: _Layout
    compute: ComputePlan
    precision: Precision
    micro: int
    accum: int
    plan: MeshPlan
    dropout_active: bool
    z_loss_weight: float = 0.0
    objective: bool = False  # the optimizer reads the step's loss as a function (sophia-h)

    @property
    def scaling(self) -> bool:
        return self.precision.uses_loss_scaling


INIT_COMPILE_OPTIONS = {"xla_backend_optimization_level": 1}
"""XLA:CPU options of the state's initialisation: a program that runs once, whose compilation at the
default level took 2.4 s of a small model's 5 s start-up; at level 1 it compiles in 1.0 s and
computes the same bits (``tests/test_startup.py``)."""

STEP_COMPILE_OPTIONS = {"xla_backend_optimization_level": 1}
"""XLA:CPU options of the train and eval steps. Their time goes to YNNPACK's products, the native
kernels and XLA's own loop fusions, which LLVM's level-2 passes do not make faster: compiled at
level 1 the quality run's train step (4 layers, width 128) ran at 0.997x and the medium shape's
(6 layers, width 384) at 0.999x the default's step time, and the quality step compiled in 2.3–2.7 s
instead of 2.9–3.1 s (``docs/benchmarks.md``). The results agree with the default level's to a few
ulps (a sum may be ordered differently; ``tests/test_startup.py``)."""


def build_step_functions(
    model_cfg,
    opt_cfg: OptimizerConfig,
    trainer_cfg: TrainerConfig,
    *,
    vocab_size: int,
    num_train_steps: int,
    plan: MeshPlan,
    has_segments: bool,
    compute: ComputePlan | None = None,
    has_loss_mask: bool = False,
) -> StepFunctions:
    """Jitted init / train / eval functions with explicit shardings.

    ``compute``: how the model computes; by default decided once from the mesh and the model
    config's hints (:func:`lm_pipeline.compute.plan_for_mesh`, :func:`~lm_pipeline.compute.hints_from`).
    """
    precision: Precision = trainer_cfg.precision
    sizes = trainer_cfg.batch_schedule.distinct_sizes
    first = trainer_cfg.batch_schedule.batch_size_at(0)
    splits = {size: micro_batches(trainer_cfg, plan, size) for size in sizes}
    for size, (m, a) in splits.items():
        log.info("train step%s: %d micro-batch(es) of %d rows (%d per data-parallel device) per optimizer step",
                 f" (batch {size})" if len(sizes) > 1 else "", a, m, m // plan.data_size)
    micro, accum = splits[first]
    if compute is None:
        compute = plan_for_mesh(plan.mesh, precision.compute, loss_scaling=precision.uses_loss_scaling,
                                hints=hints_from(model_cfg))
        if trainer_cfg.quantization is not None and trainer_cfg.quantization.fp8:
            compute = dataclasses.replace(compute, fp8=True)  # checked against the device before this
        if precision.matmul is not None:  # trainer.mp's m=: the projections' and the head's operand dtype
            compute = dataclasses.replace(compute, matmul_operands=precision.matmul)
    lay = _layout(model_cfg, opt_cfg, precision, vocab_size, num_train_steps, plan)
    dropout_active = any(getattr(model_cfg, n, 0.0) > 0 for n in ("embed_pdrop", "resid_pdrop", "attn_pdrop"))
    ctx = _StepContext(lay, compute, precision, micro, accum, plan, dropout_active, trainer_cfg.z_loss_weight,
                       opt_cfg.type == "sophia-h")
    replicated, batch_sharding = plan.replicated(), plan.batch_sharding()
    in_shardings = (lay.state_shardings, batch_sharding, batch_sharding if has_segments else None,
                    *((batch_sharding,) if has_loss_mask else ()))  # a chat source's loss mask

    on_cpu = compute.platform == "cpu"
    step_options = STEP_COMPILE_OPTIONS if on_cpu else None

    def jit_train_step(step_ctx: _StepContext) -> StepFn:
        return jax.jit(partial(_train_step, step_ctx), in_shardings=in_shardings,
                       out_shardings=(lay.state_shardings, replicated), donate_argnums=(0,),
                       compiler_options=step_options)

    others = {size: jit_train_step(dataclasses.replace(ctx, micro=m, accum=a))
              for size, (m, a) in splits.items() if size != first}
    return StepFunctions(
        init=jax.jit(lay.init_arrays, out_shardings=lay.state_shardings,
                     compiler_options=INIT_COMPILE_OPTIONS if on_cpu else None),
        train_step=jit_train_step(ctx),
        eval_step=jax.jit(partial(_eval_step, ctx), in_shardings=in_shardings, out_shardings=(replicated, replicated),
                          compiler_options=step_options),
        state_shardings=lay.state_shardings,
        abstract_state=lay.abstract_state,
        compute=compute,
        micro_batch_rows=micro,
        accumulation_steps=ctx.accum,
        batch_rows=first,
        other_train_steps=others,
        loss_mask=has_loss_mask,
    )


def _grad_sums(ctx: _StepContext, params, tokens, seg, key, scale, lmask=None):
    """(loss sum, token count, gradients of ``scale * loss sum``); scale = the f16 loss scale, else 1;
    ``lmask``: the loss mask (chat sources), or None."""

    def f(p):
        p = jax.lax.with_sharding_constraint(cast_floating(p, ctx.precision.compute), ctx.lay.compute_shardings)
        model = eqx.combine(p, ctx.lay.model_static)
        obj, s, n = training_loss_sums(model, tokens, seg, key=key, inference=not ctx.dropout_active,
                                       plan=ctx.compute, z_loss_weight=ctx.z_loss_weight, loss_mask=lmask)
        return obj * scale if ctx.scaling else obj, (s, n)

    (_, (s, n)), g = jax.value_and_grad(f, has_aux=True)(params)
    return s, n, g


def _micro_batches(ctx: _StepContext, tokens, seg):
    """The step's batch as ``[accum, micro, ...]`` (tokens, segment ids or None). Micro-batch i =
    rows i, i+accum, ...: each micro-batch stays spread over all data-parallel devices."""
    if ctx.accum == 1:
        return tokens[None], (seg[None] if seg is not None else None)
    sharding = jax.sharding.NamedSharding(ctx.plan.mesh, jax.sharding.PartitionSpec(None, *ctx.plan.batch_sharding().spec))

    def split(x):
        return jax.lax.with_sharding_constraint(x.reshape(ctx.micro, ctx.accum, *x.shape[1:]).swapaxes(0, 1), sharding)

    return split(tokens), (split(seg) if seg is not None else None)


def _accumulated_grads(ctx: _StepContext, params, tokens, seg, step_key, scale, lmask=None):
    """:func:`_grad_sums` summed over the step's micro-batches (a scan when there are several)."""
    if ctx.accum == 1:
        return _grad_sums(ctx, params, tokens, seg, step_key, scale, lmask)
    mtoks, mseg = _micro_batches(ctx, tokens, seg)
    mmask = _micro_batches(ctx, lmask, None)[0] if lmask is not None else None

    def body(carry, i):
        out = _grad_sums(ctx, params, mtoks[i], mseg[i] if mseg is not None else None,
                         jax.random.fold_in(step_key, i), scale, mmask[i] if mmask is not None else None)
        return jax.tree.map(jnp.add, carry, out), None

    zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    return jax.lax.scan(body, zeros, jnp.arange(ctx.accum))[0]


#: Sophia-H's probe for step k is ``fold_in(fold_in(run key, k), HUTCHINSON_STREAM)``: a stream of its
#: own (micro-batch i's dropout folds in i < accumulation steps).
HUTCHINSON_STREAM = 0x50524F42


def _objective(ctx: _StepContext, tokens, seg, count, lmask=None):
    """The batch's mean loss as a sum over its micro-batches, for Sophia-H's Hessian-vector products
    (``obj_fn(p, i)``, ``obj_parts = accum``): part i is micro-batch i's loss sum over the batch's
    token ``count``, so the estimate is over the gradient's batch, one micro-batch at a time. No
    dropout, and the reference plan, whose operations all have second derivatives."""
    mtoks, mseg = _micro_batches(ctx, tokens, seg)
    mmask = _micro_batches(ctx, lmask, None)[0] if lmask is not None else None

    def f(p, i):
        model = eqx.combine(cast_floating(p, ctx.precision.compute), ctx.lay.model_static)
        s, _ = model_loss_sums(model, mtoks[i], mseg[i] if mseg is not None else None, key=None, inference=True,
                               plan=REFERENCE, loss_mask=mmask[i] if mmask is not None else None)
        return s / count

    return f


def _train_step(ctx: _StepContext, state: TrainState, tokens, seg, lmask=None):
    """One optimizer step on a global batch: (new state, metrics). ``lmask``: the batch's loss mask
    (chat sources; the loss is averaged over the masked-in targets), or None."""
    params = state.model
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.key), state.step)
    scale = loss_scale(state.opt_state)
    loss_sum, count, grads = _accumulated_grads(ctx, params, tokens, seg, step_key, scale, lmask)
    count = jnp.maximum(count, 1.0)
    denom = count * scale if ctx.scaling else count
    grads = jax.tree.map(lambda g: (g.astype(jnp.float32) / denom), grads)
    loss = loss_sum / count
    grads = jax.lax.with_sharding_constraint(grads, ctx.lay.param_shardings)
    extra = ({"obj_fn": _objective(ctx, tokens, seg, count, lmask), "obj_parts": ctx.accum,
              "probe_key": jax.random.fold_in(step_key, HUTCHINSON_STREAM)} if ctx.objective else {})
    updates, opt_state = ctx.lay.tx.update(grads, state.opt_state, params, loss=loss, **extra)
    metrics = {
        "train/loss": loss,
        "optim/grad_norm": optax.global_norm(grads),
        "optim/update_norm": optax.global_norm(updates),
        "optim/skipped_steps": skipped_steps(opt_state),
        # the scheduled rate of this step (what the update applied, unless it was skipped), computed
        # with the step: the host evaluating the schedule
        # itself would compile each of its operations on the first logged step (~0.5 s on CPU)
        "optim/learning_rate": current_lr(opt_state),
    }
    if ctx.scaling:
        metrics["optim/loss_scale"] = loss_scale(opt_state)
    return TrainState(state.step + 1, optax.apply_updates(params, updates), opt_state, state.key), metrics


def _eval_step(ctx: _StepContext, state: TrainState, tokens, seg, lmask=None):
    """(loss sum, predicted tokens) of the state's model (its weight average, when the optimizer keeps
    one) on a batch, no dropout, no gradients."""
    params = averaged_params(state.opt_state, state.model)
    model = eqx.combine(cast_floating(params, ctx.precision.compute), ctx.lay.model_static)
    return model_loss_sums(model, tokens, seg, key=None, inference=True, plan=ctx.compute, loss_mask=lmask)


# --- moving batches onto devices --------------------------------------------------------------


def put_batch(batch: LmBatch, plan: MeshPlan) -> tuple[jax.Array | None, ...]:
    """Place this process's slice of a batch onto the mesh (multi-host safe): (tokens, segment ids),
    and the loss mask third when the batch has one (a chat source's)."""
    tokens, segment_ids, loss_mask = device_put_batch(batch, plan.batch_sharding())
    return (tokens, segment_ids) if loss_mask is None else (tokens, segment_ids, loss_mask)


def step_args(fns: StepFunctions, placed: tuple[jax.Array | None, ...]) -> tuple[jax.Array | None, ...]:
    """:func:`put_batch`'s arrays as the step functions take them: with a None loss mask where
    they take one and the batch has none (text rows of a run that also trains on chat)."""
    if fns.loss_mask and len(placed) == 2:
        return (*placed, None)
    if not fns.loss_mask and len(placed) == 3:
        raise ValueError("a batch with a loss mask (a chat source's) for step functions built without one "
                         "(build_step_functions(..., has_loss_mask=True))")
    return placed


# --- evaluation -------------------------------------------------------------------------------


def evaluate_datasets(
    fns: StepFunctions,
    state: TrainState,
    datasets: Mapping[str, SequenceDataset],
    plan: MeshPlan,
    *,
    batch_size: int,
    max_batches: int | None = None,
) -> dict[str, dict[str, float]]:
    """Mean next-token loss per dataset over its rows in order: {name: {loss, tokens}}.

    A final partial batch is skipped unless it is the only one, so every evaluated batch has
    the same (compiled) shape.
    """
    out: dict[str, dict[str, float]] = {}
    for name, ds in datasets.items():
        n = len(ds)
        nb = max(1, n // batch_size)
        if max_batches is not None:
            nb = min(nb, max_batches)
        total, count = 0.0, 0.0
        for b in range(nb):
            idx = np.arange(b * batch_size, (b + 1) * batch_size) % n
            # Each process reads its own slice of the eval batch, like training.
            per = batch_size // jax.process_count()
            idx = idx[jax.process_index() * per : (jax.process_index() + 1) * per]
            s, c = fns.eval_step(state, *step_args(fns, put_batch(ds.get_many(idx), plan)))
            total += float(s)
            count += float(c)
        out[name] = {"loss": total / max(count, 1.0), "tokens": count}
    return out


# --- the loop ---------------------------------------------------------------------------------


@dataclass
class StepInfo:
    """What hooks see after each step."""

    step: int  # number of completed steps
    state: TrainState
    metrics: dict[str, Any]


@dataclass
class Hook:
    fn: Callable[[StepInfo], Mapping[str, float] | None]
    every: int = 1


@dataclass
class TrainResult:
    state: TrainState
    final_step: int
    metrics: dict[str, float] = field(default_factory=dict)
    eval_history: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    resumed_from: str | None = None
    train_seconds: float = 0.0


PEAK_BF16_FLOPS = {  # dense bf16 datasheet peaks per device
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5p": 459e12,
}


def device_peak_flops() -> float | None:
    kind = jax.devices()[0].device_kind
    for name, peak in PEAK_BF16_FLOPS.items():
        if name.lower() in kind.lower():
            return peak
    env = os.environ.get("LM_PIPELINE_PEAK_FLOPS")
    return float(env) if env else None
