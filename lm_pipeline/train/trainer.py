"""The trainer: a jitted, donated, sharded train step and the loop around it.

The whole train state is one pytree (:class:`TrainState`), so a checkpoint is that pytree and
resuming restores it exactly. The batch for step k comes from a step-indexed source, so a
resumed run sees the same batches as an uninterrupted one. Parameters are sharded by the
parameter axis mapping (FSDP / tensor parallel), batches by the compute mapping.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from lm_pipeline.batch import LmBatch, SequenceDataset, StepBatchSource
from lm_pipeline.models.base import LmModel
from lm_pipeline.models.layers import _xt_g, layer_remat_policy, matmuls_and_attention_saveable
from lm_pipeline.train.config import Precision, TrainerConfig
from lm_pipeline.train.optim import OptimizerConfig, loss_scale, skipped_steps, weight_decay_mask
from lm_pipeline.train.sharding import MeshPlan

log = logging.getLogger(__name__)


class TrainState(eqx.Module):
    """Everything a resumed run needs: step, parameters, optimizer state, PRNG key data."""

    step: jax.Array
    model: LmModel
    opt_state: Any
    key: jax.Array


# --- loss -------------------------------------------------------------------------------------


def next_token_loss_sums(logits: jax.Array, tokens: jax.Array, segment_ids: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(sum of next-token cross-entropy in nats, number of predicted tokens), in f32.

    Position t predicts token t+1 of the same row; with segment ids, only within a document
    and never into padding.

    Computed over all T positions with the last one masked out (slicing the ``[B, T, V]``
    logits to ``T - 1`` costs a copy forward and a pad backward), by :func:`_xent_sum`.
    """
    targets, mask = _next_token_targets(tokens, segment_ids)
    return _xent_sum(logits, targets, mask), jnp.sum(mask)


def _next_token_targets(tokens: jax.Array, segment_ids: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(targets ``[B, T]``, f32 mask ``[B, T]``): position t predicts token t+1 of its document."""
    b, t = tokens.shape
    # Target of the last position is a placeholder (masked).
    targets = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    has_next = jnp.arange(t) < t - 1
    if segment_ids is None:
        mask = jnp.broadcast_to(has_next, (b, t)).astype(jnp.float32)
    else:
        nxt = jnp.concatenate([segment_ids[:, 1:], segment_ids[:, :1]], axis=1)
        mask = (has_next & (nxt == segment_ids) & (nxt != 0)).astype(jnp.float32)
    return targets, mask


HEAD_CHUNK_ROWS = 512
"""Token rows (batch x positions) per chunk of :func:`fused_head_loss_sums`: a chunk's
``[rows, vocab]`` logits, probabilities and cotangent stay small enough to be reused from cache."""


def head_chunks(batch: int, seq_len: int) -> tuple[tuple[int, int], ...]:
    """The ``[start, end)`` position ranges :func:`fused_head_loss_sums` splits a sequence into:
    about :data:`HEAD_CHUNK_ROWS` rows (``batch x positions``) each."""
    n = max(1, min(seq_len, round(batch * seq_len / HEAD_CHUNK_ROWS)))
    size = -(-seq_len // n)
    return tuple((s, min(seq_len, s + size)) for s in range(0, seq_len, size))


def fused_head_loss_sums(
    hidden: jax.Array, head: jax.Array, tokens: jax.Array, segment_ids: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """:func:`next_token_loss_sums` of ``lm_logits(hidden, head)``, computed in chunks of
    positions so that the ``[B, T, V]`` logits never exist whole.

    ``hidden`` ``[B, T, D]`` and ``head`` ``[V, D]`` are what
    :meth:`~lm_pipeline.models.base.LmModel.features` returns. Each chunk (about
    :data:`HEAD_CHUNK_ROWS` token rows) computes its logits, its share of the loss and, when
    differentiated, its gradients at once: the cotangent ``softmax - onehot`` is used while it is
    still in cache and the pass keeps only ``d hidden`` ``[B, T, D]`` and ``d head`` ``[V, D]``
    for the backward pass (the loss is the last thing computed, so its gradients are those
    times the incoming scalar cotangent). Same values as the unfused loss up to float rounding
    (``tests/test_fused_head.py``); the weight gradient is accumulated over chunks in f32.
    Chunks split positions, not the batch, so a batch sharded over devices stays sharded.
    """
    targets, mask = _next_token_targets(tokens, segment_ids)
    bounds = head_chunks(*tokens.shape)
    return _fused_head_xent(hidden, head, targets, mask, bounds), jnp.sum(mask)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused_head_xent(hidden, head, targets, mask, bounds):
    return _head_xent_chunks(hidden, head, targets, mask, bounds, grads=False)[0]


def _head_xent_chunks(hidden, head, targets, mask, bounds, *, grads: bool):
    f32 = jnp.float32
    total = jnp.zeros((), f32)
    d_hidden, d_head_t = [], None
    for t0, t1 in bounds:
        h = hidden[:, t0:t1]
        if t0 > 0:  # chunks in order, one at a time: the next starts when this one's results exist
            h, total, d_head_t, d_hidden = jax.lax.optimization_barrier((h, total, d_head_t, d_hidden))
        tgt, m = targets[:, t0:t1], mask[:, t0:t1]
        logits = jnp.einsum("btd,vd->btv", h, head)  # as lm_logits: [B, t, V], compute dtype
        lf = logits.astype(f32)
        mx = jnp.max(lf, axis=-1)
        mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
        e = jnp.exp(lf - mx[..., None])
        z = jnp.sum(e, axis=-1)
        picked = jnp.take_along_axis(lf, tgt[..., None], axis=-1)[..., 0]
        total = total + jnp.sum((mx + jnp.log(z) - picked) * m)
        if grads:
            onehot = jnp.arange(head.shape[0], dtype=tgt.dtype) == tgt[..., None]
            dl = ((e / z[..., None] - onehot.astype(f32)) * m[..., None]).astype(logits.dtype)
            d_hidden.append(jnp.einsum("btv,vd->btd", dl, head))
            part = _xt_g(h.reshape(-1, h.shape[-1]), dl.reshape(-1, dl.shape[-1])).astype(f32)  # [D, V]
            d_head_t = part if d_head_t is None else d_head_t + part
    if not grads:
        return total, None
    return total, (jnp.concatenate(d_hidden, axis=1), d_head_t)


def _fused_head_xent_fwd(hidden, head, targets, mask, bounds):
    total, (d_hidden, d_head_t) = _head_xent_chunks(hidden, head, targets, mask, bounds, grads=True)
    return total, (d_hidden, d_head_t, jnp.zeros((), head.dtype))


def _fused_head_xent_bwd(bounds, res, g):
    d_hidden, d_head_t, head_dtype = res
    return (g * d_hidden).astype(d_hidden.dtype), (g * d_head_t.T).astype(head_dtype.dtype), None, None


_fused_head_xent.defvjp(_fused_head_xent_fwd, _fused_head_xent_bwd)


def model_loss_sums(
    model: LmModel, tokens: jax.Array, segment_ids: jax.Array | None, *, key: jax.Array | None,
    inference: bool, fused_head: bool,
) -> tuple[jax.Array, jax.Array]:
    """(loss sum, predicted tokens) of ``model`` on a batch: the training loss.

    ``fused_head``: through :func:`fused_head_loss_sums` (the CPU trainer's choice, see
    :func:`uses_fused_head`), else the model's logits and :func:`next_token_loss_sums`."""
    if fused_head:
        hidden, head = model.features(tokens, segment_ids, key=key, inference=inference)
        return fused_head_loss_sums(hidden, head, tokens, segment_ids)
    logits = model(tokens, segment_ids, key=key, inference=inference)
    return next_token_loss_sums(logits, tokens, segment_ids)


def uses_fused_head(platform: str, loss_scaling: bool) -> bool:
    """Whether the trainer computes its loss with :func:`fused_head_loss_sums`: on the CPU
    backend, unless f16 loss scaling is on (the chunk's cotangent would be cast to f16 before
    it is scaled). 1.1x faster than logits + :func:`next_token_loss_sums` for the head and loss
    of a width-384, 8k-vocabulary GPT-2 on 2 CPU cores, and no ``[B, T, V]`` activations
    (``docs/benchmarks.md``). Accelerators keep the logits path their MFU figures were measured
    with."""
    return platform == "cpu" and not loss_scaling


@jax.custom_vjp
def _xent_sum(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """``sum(mask * (logsumexp(logits) - logits[targets]))`` in f32, with a hand-written VJP.

    The gradient wrt the logits is ``(softmax(logits) - onehot(targets)) * mask``, one fused pass
    over the ``[B, T, V]`` array, instead of autodiff's exp / multiply / scatter-add passes.
    ``targets`` and ``mask`` get no gradient.
    """
    return _xent_fwd(logits, targets, mask)[0]


def _xent_fwd(logits, targets, mask):
    lf = logits.astype(jnp.float32)
    m = jnp.max(lf, axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    logz = m + jnp.log(jnp.sum(jnp.exp(lf - m[..., None]), axis=-1))
    picked = jnp.take_along_axis(lf, targets[..., None], axis=-1)[..., 0]
    return jnp.sum((logz - picked) * mask), (logits, targets, mask, logz)


def _xent_bwd(res, g):
    logits, targets, mask, logz = res
    probs = jnp.exp(logits.astype(jnp.float32) - logz[..., None])
    onehot = jnp.arange(logits.shape[-1], dtype=targets.dtype) == targets[..., None]
    dlogits = (probs - onehot.astype(jnp.float32)) * (g * mask)[..., None]
    return dlogits.astype(logits.dtype), None, None


_xent_sum.defvjp(_xent_fwd, _xent_bwd)


def cast_floating(tree: Any, dtype) -> Any:
    """Cast the floating-point arrays of a pytree to ``dtype`` (others untouched)."""

    def cast(x):
        if eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


INJECT_NONFINITE_ENV = "LM_PIPELINE_INJECT_NONFINITE_STEPS"


def injected_nonfinite_steps() -> tuple[int, ...]:
    """Train steps (1-based) whose loss and gradients a test forces to NaN.

    Read from ``$LM_PIPELINE_INJECT_NONFINITE_STEPS`` (comma-separated) when the step functions
    are built; empty (and no trace of it in the compiled step) when unset. This is how the
    fault suite checks that a NaN is skipped or stops the run, and never reaches a checkpoint.
    """
    spec = os.environ.get(INJECT_NONFINITE_ENV, "").strip()
    if not spec:
        return ()
    try:
        return tuple(sorted({int(x) for x in spec.split(",") if x.strip()}))
    except ValueError:
        raise ValueError(f"${INJECT_NONFINITE_ENV}={spec!r}: expected comma-separated step numbers, e.g. 5,6") from None


def saves_only_dots(model_cfg, compute_dtype, platform: str) -> bool:
    """Whether the train step keeps only matmul outputs for the backward pass.

    On the CPU backend in f32, without the model's own gradient checkpointing: each layer of the
    model's layer scan is wrapped in ``jax.checkpoint`` with policy
    :func:`~lm_pipeline.models.layers.matmuls_and_attention_saveable` (``dots_saveable`` plus the
    named outputs of the CPU projections and of the blocked attention;
    :func:`lm_pipeline.models.layers.layer_remat_policy`), so the elementwise work between
    matmuls (norms, GELU, softmax, masks) is recomputed in the backward pass instead of being
    saved per layer (same results). Otherwise XLA:CPU zero-fills a stacked buffer per
    saved residual and copies it before the layer scan writes it: the step moves about 2x less
    temporary memory and ran 1.1x (4 layers, width 128) to 1.35x (6 layers, width 384) faster
    in ``bench/train_throughput.py`` (``docs/benchmarks.md``). In bf16 the same policy measured
    slower (the model unrolls short stacks there instead); accelerators keep plain autodiff.
    :mod:`lm_pipeline.estimate` uses the same rule.
    """
    return (
        platform == "cpu"
        and jnp.dtype(compute_dtype) == jnp.float32
        and not getattr(model_cfg, "gradient_checkpointing", False)
    )


def _platform(plan: MeshPlan) -> str:
    platforms = {d.platform for d in plan.mesh.devices.flat}
    return platforms.pop() if len(platforms) == 1 else "mixed"


def _save_only_dots(model_cfg, precision: Precision, plan: MeshPlan) -> bool:
    return _platform(plan) == "cpu" and saves_only_dots(model_cfg, precision.compute, "cpu")


def _is_array_like(x) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


# --- the step ---------------------------------------------------------------------------------


@dataclass
class StepFunctions:
    """Compiled pieces bound to one model shape, mesh and optimizer."""

    init: Callable[[jax.Array], TrainState]
    train_step: Callable[[TrainState, jax.Array, jax.Array | None], tuple[TrainState, dict[str, jax.Array]]]
    eval_step: Callable[[TrainState, jax.Array, jax.Array | None], tuple[jax.Array, jax.Array]]
    state_shardings: Any
    abstract_state: Any


def build_step_functions(
    model_cfg,
    opt_cfg: OptimizerConfig,
    trainer_cfg: TrainerConfig,
    *,
    vocab_size: int,
    num_train_steps: int,
    plan: MeshPlan,
    has_segments: bool,
) -> StepFunctions:
    """Jitted init / train / eval functions with explicit shardings."""
    precision: Precision = trainer_cfg.precision
    batch_size = trainer_cfg.train_batch_size
    if trainer_cfg.per_device_parallelism == "auto":
        raise ValueError(
            "per_device_parallelism: 'auto' must be resolved before building the step "
            "(lm_pipeline.estimate.resolve_auto_parallelism; train() does it)"
        )
    if trainer_cfg.per_device_parallelism > 0:
        micro = trainer_cfg.per_device_parallelism * plan.data_size
    else:
        micro = batch_size
    accum = batch_size // micro
    dropout_active = any(getattr(model_cfg, n, 0.0) > 0 for n in ("embed_pdrop", "resid_pdrop", "attn_pdrop"))

    def make_model(key):
        return model_cfg.build(vocab_size, key=key)

    # Shapes and logical axes without allocating anything.
    abstract_model = eqx.filter_eval_shape(make_model, jax.random.key(0))
    model_arrays, model_static = eqx.partition(abstract_model, _is_array_like)
    axes = abstract_model.param_axes()
    param_shardings = plan.param_shardings(axes, model_arrays)
    decay_mask = weight_decay_mask(model_arrays, axes)
    tx = opt_cfg.build(num_train_steps, decay_mask, loss_scaling=precision.uses_loss_scaling)
    poison_steps = injected_nonfinite_steps()
    replicated = plan.replicated()

    def init_arrays(key_data):
        key = jax.random.wrap_key_data(key_data)
        init_key, state_key = jax.random.split(key)
        model = make_model(init_key)
        params = eqx.filter(model, eqx.is_array)
        params = jax.lax.with_sharding_constraint(params, param_shardings)
        opt_state = tx.init(params)
        return TrainState(jnp.zeros((), jnp.int32), params, opt_state, jax.random.key_data(state_key))

    abstract_state = jax.eval_shape(init_arrays, jax.ShapeDtypeStruct((2,), jnp.uint32))

    def opt_sharding(abstract_opt):
        # Optimizer leaves shaped like parameters follow the parameters' sharding.
        return optax.tree_map_params(
            tx,
            lambda _p, s: s,
            abstract_opt,
            param_shardings,
            transform_non_params=lambda _: replicated,
        )

    state_shardings = TrainState(replicated, param_shardings, opt_sharding(abstract_state.opt_state), replicated)
    abstract_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, state_shardings
    )

    init = jax.jit(init_arrays, out_shardings=state_shardings)
    batch_sharding = plan.batch_sharding()

    # Parameters at rest follow the parameter mapping (FSDP shards `embed` over `data`); for
    # compute they are gathered to the compute mapping, so activations stay split by batch
    # rather than following the weights' sharding.
    compute_shardings = MeshPlan(plan.mesh, plan.compute_mapping, plan.compute_mapping).param_shardings(axes, model_arrays)

    save_dots_only = _save_only_dots(model_cfg, precision, plan)
    fused_head = uses_fused_head(_platform(plan), precision.uses_loss_scaling)

    def loss_sums(params, tokens, seg, key):
        params = jax.lax.with_sharding_constraint(cast_floating(params, precision.compute), compute_shardings)
        model = eqx.combine(params, model_static)
        policy = matmuls_and_attention_saveable() if save_dots_only else None
        with layer_remat_policy(policy):
            return model_loss_sums(model, tokens, seg, key=key, inference=not dropout_active, fused_head=fused_head)

    def grad_sums(params, tokens, seg, key, scale):
        # Gradients of scale * loss_sum (scale = the f16 loss scale, else 1); loss_sum unscaled.
        def f(p):
            s, n = loss_sums(p, tokens, seg, key)
            return s * scale if scaling else s, (s, n)

        (_, (s, n)), g = jax.value_and_grad(f, has_aux=True)(params)
        return s, n, g

    scaling = precision.uses_loss_scaling

    def train_step(state: TrainState, tokens, seg):
        params = state.model
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state.key), state.step)
        scale = loss_scale(state.opt_state)
        if accum == 1:
            loss_sum, count, grads = grad_sums(params, tokens, seg, step_key, scale)
        else:
            # Micro-batch i = rows i, i+accum, ...: each micro-batch stays spread over all
            # data-parallel devices.
            def split(x):
                x = x.reshape(micro, accum, *x.shape[1:]).swapaxes(0, 1)
                return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec(None, *batch_sharding.spec)))

            mtoks = split(tokens)
            mseg = split(seg) if seg is not None else None

            def body(carry, i):
                s_acc, n_acc, g_acc = carry
                t = mtoks[i]
                sg = mseg[i] if mseg is not None else None
                s, n, g = grad_sums(params, t, sg, jax.random.fold_in(step_key, i), scale)
                g_acc = jax.tree.map(jnp.add, g_acc, g)
                return (s_acc + s, n_acc + n, g_acc), None

            zeros = jax.tree.map(jnp.zeros_like, params)
            (loss_sum, count, grads), _ = jax.lax.scan(
                body, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros), jnp.arange(accum)
            )
        count = jnp.maximum(count, 1.0)
        denom = count * scale if scaling else count
        grads = jax.tree.map(lambda g: (g.astype(jnp.float32) / denom), grads)
        loss = loss_sum / count
        if poison_steps:  # test hook: LM_PIPELINE_INJECT_NONFINITE_STEPS
            poisoned = jnp.isin(state.step + 1, jnp.asarray(poison_steps, jnp.int32))
            loss = jnp.where(poisoned, jnp.nan, loss)
            grads = jax.tree.map(lambda g: jnp.where(poisoned, jnp.nan, g), grads)
        grads = jax.lax.with_sharding_constraint(grads, param_shardings)
        updates, opt_state = tx.update(grads, state.opt_state, params, loss=loss)
        new_params = optax.apply_updates(params, updates)
        metrics = {
            "train/loss": loss,
            "optim/grad_norm": optax.global_norm(grads),
            "optim/update_norm": optax.global_norm(updates),
            "optim/skipped_steps": skipped_steps(opt_state),
        }
        if scaling:
            metrics["optim/loss_scale"] = loss_scale(opt_state)
        return TrainState(state.step + 1, new_params, opt_state, state.key), metrics

    seg_sharding = batch_sharding if has_segments else None
    jit_train = jax.jit(
        train_step,
        in_shardings=(state_shardings, batch_sharding, seg_sharding),
        out_shardings=(state_shardings, replicated),
        donate_argnums=(0,),
    )

    def eval_step(state: TrainState, tokens, seg):
        params = state.model
        model = eqx.combine(cast_floating(params, precision.compute), model_static)
        # Not differentiated: on CPU the fused head computes only the loss, chunk by chunk.
        return model_loss_sums(model, tokens, seg, key=None, inference=True, fused_head=fused_head)

    jit_eval = jax.jit(eval_step, in_shardings=(state_shardings, batch_sharding, seg_sharding), out_shardings=(replicated, replicated))
    return StepFunctions(init, jit_train, jit_eval, state_shardings, abstract_state)


# --- moving batches onto devices --------------------------------------------------------------


def put_batch(batch: LmBatch, plan: MeshPlan) -> tuple[jax.Array, jax.Array | None]:
    """Place this process's slice of a batch onto the mesh (multi-host safe)."""
    sharding = plan.batch_sharding()

    def put(x):
        if x is None:
            return None
        x = np.asarray(x, dtype=np.int32)
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        return jax.make_array_from_process_local_data(sharding, x)

    return put(batch.tokens), put(batch.segment_ids)


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
            toks, seg = put_batch(ds.get_many(idx), plan)
            s, c = fns.eval_step(state, toks, seg)
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


def iter_steps(source: StepBatchSource, start: int, stop: int) -> Iterable[tuple[int, LmBatch]]:
    for k in range(start, stop):
        yield k, source.batch(k)
