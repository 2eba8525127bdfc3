"""AdamW (or Lion, Adafactor, Muon) with weight-decay masking and bad-step skipping, and the JAX
side of the learning-rate schedule; the configuration and the schedule's definition are in :mod:`lm_pipeline.train.optim_config`.

Optimizer
---------
:meth:`OptimizerConfig.build` returns an :class:`optax.GradientTransformationExtraArgs`::

    clip_by_global_norm(max_grad_norm) -> update_rule(type)
      -> add_decayed_weights(weight_decay, mask) -> scale(-schedule(step))

where the update rule (:func:`update_rule`) is Optax's ``scale_by_adam(beta1, beta2, epsilon)``
(``type: adam``), ``scale_by_lion(beta1, beta2)``, ``scale_by_factored_rms()`` (Adafactor) or
``contrib.muon`` at unit rate (Muon on the blocks' matrices, :func:`muon_dimensions`; AdamW at
``adam_lr / learning_rate`` of the schedule on the rest), or Sophia-H
(:mod:`lm_pipeline.train.sophia`, which needs ``update(..., obj_fn=...)``).

(decoupled AdamW: the decay is multiplied by the learning rate, as in ``optax.adamw`` and
Levanter). Its state is an :class:`OptimizerState`; ``update(grads, state, params, loss=...)``
accepts the step's loss (used only by ``skip_bad_steps``). ``state.step`` counts update calls
(skipped ones included), so the schedule follows the trainer's step.

Learning rate for logging: :func:`current_lr` reads the rate applied by the most recent
``update`` from the state (log it as ``optim/learning_rate`` after the update). It always equals
``config.lr_scheduler(num_train_steps)(step)`` for that step, so a trainer may compute it from
the schedule instead.

Bad-step skipping
-----------------
With ``skip_bad_steps: true`` a step is skipped when its gradients (or its loss, when given)
are not finite, or, once ``skip_warmup_steps`` steps have fed the running statistics, when the
global gradient norm (before clipping) exceeds ``skip_grad_norm_factor`` times its running EMA.
A skipped step returns zero updates (so ``optax.apply_updates`` leaves the parameters
bit-identical), keeps the inner optimizer state (moments and Adam's bias-correction count)
unchanged, and increments :func:`skipped_steps`. Non-finite steps never feed the EMA; an
outlier feeds it clipped to ``factor * EMA``, so a lasting shift in the gradient scale is
accepted after a few dozen skips instead of skipping forever.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

if TYPE_CHECKING:  # the config module builds this optimizer: no import back at run time
    from lm_pipeline.train.optim_config import CyclePhases, OptimizerConfig

__all__ = [
    "EMA_SUBTREE", "LOSS_SCALE_INIT", "LOSS_SCALE_PERIOD", "AveragedState", "OptimizerState", "averaged_params",
    "all_finite", "build_optimizer", "current_lr", "loss_scale", "muon_dimensions", "schedule_fn", "skipped_steps",
    "update_rule", "weight_decay_mask", "with_weight_average",
]


# --- weight decay mask ------------------------------------------------------------------------


def weight_decay_mask(params: Any, param_axes: Any) -> Any:
    """Which parameters get weight decay: a pytree of bools with the structure of ``param_axes``.

    ``param_axes`` is :meth:`LmModel.param_axes`: one :class:`~jax.sharding.PartitionSpec` of
    logical axis names per array, with the structure of ``eqx.filter(model, eqx.is_array)``.
    A leaf is decayed iff its logical axes, not counting a ``"layers"`` axis (stacked blocks),
    number at least 2, its key path (``jax.tree_util.keystr``) does not contain ``"embedding"``
    and its own name (the last key) does not contain ``"bias"`` (both case-insensitive). So
    matrices are decayed; norms and biases (vectors, ``[layers, d]`` when stacked, or
    multi-axis like an attention bias ``[heads, head_dim]``) and embeddings are not.

    ``params`` (arrays or ``jax.ShapeDtypeStruct`` leaves, or None entries) is used to check
    that each spec has one entry per dimension; leaves it lacks are not checked.
    """
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    shapes: dict[str, tuple[int, ...]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        shape = getattr(leaf, "shape", None)
        if shape is not None:
            shapes[jax.tree_util.keystr(path)] = tuple(shape)

    def decide(path, spec):
        name = jax.tree_util.keystr(path)
        if not is_spec(spec):
            raise TypeError(f"param_axes leaf at {name} is {type(spec).__name__}, expected a PartitionSpec")
        shape = shapes.get(name)
        if shape is not None and len(shape) != len(spec):
            raise ValueError(
                f"param_axes at {name} is {spec} ({len(spec)} axes) but the array has shape {shape}; "
                "param_axes needs one entry per dimension"
            )
        dims = sum(1 for axis in spec if axis != "layers")
        leaf_name = jax.tree_util.keystr(tuple(path[-1:])).lower()
        return bool(dims >= 2 and "embedding" not in name.lower() and "bias" not in leaf_name)

    return jax.tree_util.tree_map_with_path(decide, param_axes, is_leaf=is_spec)




# --- schedule ---------------------------------------------------------------------------------


def _decay_value(kind: str, peak: float, ratio: float, u: Any) -> Any:
    """The decay shape at fraction ``u`` in [0, 1] of the decay phase (works on floats and arrays)."""
    lo = peak * ratio
    if kind == "constant":
        return peak + 0.0 * u
    if kind == "linear":
        return peak + (lo - peak) * u
    if kind == "cosine":
        return lo + (peak - lo) * 0.5 * (1.0 + jnp.cos(jnp.pi * u))
    if kind == "inv_sqrt":
        return peak / jnp.sqrt(1.0 + (1.0 / ratio**2 - 1.0) * u)
    if kind == "inv":
        return peak / (1.0 + (1.0 / ratio - 1.0) * u)
    raise ValueError(f"unknown lr_schedule {kind!r}")


def schedule_fn(phases: list[CyclePhases], kind: str, peak: float, ratio: float) -> optax.Schedule:
    """The learning rate of :meth:`OptimizerConfig.lr_scheduler` as a jit-able function of the step.

    Evaluates the cycle containing ``count`` (found by binary search, so many cycles stay cheap).
    """
    ends = jnp.asarray([c.end for c in phases], jnp.float32)
    starts = jnp.asarray([c.start for c in phases], jnp.float32)
    warm = jnp.asarray([c.warmup for c in phases], jnp.float32)
    stable = jnp.asarray([c.stable for c in phases], jnp.float32)
    decay = jnp.asarray([c.decay for c in phases], jnp.float32)
    warm_from = jnp.asarray([c.warmup_from for c in phases], jnp.float32)
    last = len(phases) - 1

    def schedule(count):
        step = jnp.maximum(jnp.asarray(count, jnp.float32), 0.0)
        i = jnp.minimum(jnp.searchsorted(ends, step, side="right"), last)
        t = step - starts[i]
        w, st, d, w0 = warm[i], stable[i], decay[i], warm_from[i]
        warm_lr = w0 + (peak - w0) * t / jnp.maximum(w, 1.0)
        u = jnp.clip((t - w - st) / jnp.maximum(d, 1.0), 0.0, 1.0)
        decay_lr = jnp.where(d > 0, _decay_value(kind, peak, ratio, u), peak)
        lr = jnp.where(t < w, warm_lr, jnp.where(t < w + st, peak, decay_lr))
        return lr.astype(jnp.float32)

    return schedule



# --- the optimizer state and transformation ----------------------------------------------------

#: f16 dynamic loss scaling: the initial scale, and how many finite steps in a row double it.
LOSS_SCALE_INIT = 2.0**15
LOSS_SCALE_PERIOD = 2000


class OptimizerState(NamedTuple):
    """State of :meth:`OptimizerConfig.build`'s transformation (a pytree; checkpoint it whole)."""

    inner: Any  # clip -> adam -> decayed weights; untouched by skipped steps
    step: jax.Array  # int32: update() calls so far, skipped ones included; drives the schedule
    learning_rate: jax.Array  # f32: the rate applied by the most recent update
    skipped: jax.Array  # int32: steps skipped by skip_bad_steps
    grad_norm_ema: jax.Array  # f32: running EMA of the global grad norm (skip_bad_steps)
    ema_count: jax.Array  # int32: steps that fed the EMA
    loss_scale: jax.Array  # f32: dynamic loss scale (f16 compute); 1 when loss scaling is off
    good_steps: jax.Array  # int32: finite steps since the loss scale last changed


def _find_state(opt_state: Any) -> OptimizerState:
    if isinstance(opt_state, OptimizerState):
        return opt_state
    found = [
        s
        for s in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, OptimizerState))
        if isinstance(s, OptimizerState)
    ]
    if len(found) != 1:
        raise ValueError(f"expected one OptimizerState inside the optimizer state, found {len(found)}")
    return found[0]


def skipped_steps(opt_state: Any) -> jax.Array:
    """Number of steps skipped so far (int32 scalar); 0 unless ``skip_bad_steps`` is on."""
    return _find_state(opt_state).skipped


def loss_scale(opt_state: Any) -> jax.Array:
    """The dynamic loss scale to multiply the next step's loss by (f32 scalar; 1 unless f16)."""
    return _find_state(opt_state).loss_scale


def current_lr(opt_state: Any) -> jax.Array:
    """The learning rate applied by the most recent ``update`` (f32 scalar; 0 before the first)."""
    return _find_state(opt_state).learning_rate


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every leaf of ``tree`` is finite (a bool scalar)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]
    return functools.reduce(jnp.logical_and, leaves, jnp.asarray(True))



# --- building the transformation ----------------------------------------------------------------


def update_rule(config: OptimizerConfig, param_axes: Any = None) -> optax.GradientTransformation:
    """The direction of ``config.type``, before weight decay and the learning rate (Optax's)."""
    if config.type == "lion":
        return optax.scale_by_lion(config.beta1, config.beta2)
    if config.type == "adafactor":
        return optax.scale_by_factored_rms()
    if config.type == "sophia-h":
        from lm_pipeline.train.sophia import scale_by_sophia_h

        return scale_by_sophia_h(config.beta1, config.beta2, config.epsilon, config.gamma, config.update_interval)
    if config.type == "muon":
        return _muon(config, param_axes)
    return optax.scale_by_adam(config.beta1, config.beta2, config.epsilon)


def _muon(config: OptimizerConfig, param_axes: Any) -> optax.GradientTransformation:
    """Optax's ``contrib.muon`` at unit rate, as a direction the schedule scales
    (:mod:`lm_pipeline.train.muon`): Muon on the blocks' matrices, Nesterov AdamW at ``adam_lr /
    learning_rate`` on the rest."""
    from lm_pipeline.train.muon import scale_by_muon_and_adam

    if param_axes is None:
        raise ValueError("optimizer.type muon needs the model's param_axes (which parameters are matrices)")
    return scale_by_muon_and_adam(muon_dimensions(param_axes), momentum=config.momentum, beta1=config.beta1,
                                  beta2=config.beta2, epsilon=config.epsilon,
                                  adam_scale=config.adam_lr / config.learning_rate)


def muon_dimensions(param_axes: Any) -> Any:
    """Per parameter, Muon's (input axes, output axes) for the blocks' projection matrices (read from
    their logical axes; a stacked ``layers`` axis is a batch axis), None for the rest: embeddings,
    the LM head (a ``vocab`` axis), norms, biases; a tree shaped like ``param_axes``."""
    from optax.contrib import MuonDimensionNumbers

    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731

    def dims(path, spec):
        own = [i for i, axis in enumerate(spec) if axis != "layers"]
        name = jax.tree_util.keystr(path).lower()
        if len(own) < 2 or "vocab" in spec or None in spec or "embedding" in name or "bias" in name:
            return None
        inputs = own[:1] if spec[own[0]] == "embed" else own[:-1]
        return MuonDimensionNumbers(tuple(inputs), tuple(i for i in own if i not in inputs))

    return jax.tree_util.tree_map_with_path(dims, param_axes, is_leaf=is_spec)


def build_optimizer(
    config: OptimizerConfig, num_train_steps: int, weight_decay_mask: Any, *, loss_scaling: bool = False,
    param_axes: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """What :meth:`OptimizerConfig.build` returns (see there for the arguments)."""
    schedule = config.lr_scheduler(num_train_steps)
    parts: list[optax.GradientTransformation] = []
    if config.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(config.max_grad_norm))
    parts.append(update_rule(config, param_axes))
    if config.weight_decay > 0:
        parts.append(optax.add_decayed_weights(config.weight_decay, weight_decay_mask))
    inner = optax.chain(*parts)

    def init_fn(params):
        return OptimizerState(
            inner=inner.init(params),
            step=jnp.zeros((), jnp.int32),
            learning_rate=jnp.zeros((), jnp.float32),
            skipped=jnp.zeros((), jnp.int32),
            grad_norm_ema=jnp.zeros((), jnp.float32),
            ema_count=jnp.zeros((), jnp.int32),
            loss_scale=jnp.asarray(LOSS_SCALE_INIT if loss_scaling else 1.0, jnp.float32),
            good_steps=jnp.zeros((), jnp.int32),
        )

    def update_fn(updates, state: OptimizerState, params=None, *, loss=None, **extra_args):
        lr = schedule(state.step)
        new_updates, new_inner = inner.update(updates, state.inner, params, **extra_args)  # obj_fn: sophia-h
        scaled = jax.tree.map(lambda u: (-lr * u).astype(u.dtype), new_updates)
        if not config.skip_bad_steps and not loss_scaling:
            return scaled, state._replace(inner=new_inner, step=state.step + 1, learning_rate=lr)
        return _guarded_update(config, loss_scaling, updates, scaled, new_inner, state, lr, loss)

    tx = optax.GradientTransformationExtraArgs(init_fn, update_fn)
    return tx if config.ema_beta is None else with_weight_average(tx, config.ema_beta)


class AveragedState(NamedTuple):
    """The optimizer's state and an exponential moving average of the weights after each step."""

    opt: Any
    ema: Any


#: Where a checkpoint keeps the weight average (the train state's ``opt_state`` is an
#: :class:`AveragedState`); evaluation and export read the model from here when it is set.
EMA_SUBTREE = "opt_state.ema"


def with_weight_average(tx: optax.GradientTransformationExtraArgs, beta: float) -> optax.GradientTransformationExtraArgs:
    """``tx`` that also keeps ``ema = beta * ema + (1 - beta) * new_params`` (from the initial
    parameters; Levanter's ``model_averaging: {type: ema, beta}``)."""

    def init_fn(params):
        return AveragedState(tx.init(params), jax.tree.map(jnp.asarray, params))

    def update_fn(updates, state: AveragedState, params=None, **extra):
        if params is None:
            raise ValueError("a weight average needs the params")
        new, opt = tx.update(updates, state.opt, params, **extra)
        ema = jax.tree.map(lambda e, p, u: (beta * e + (1 - beta) * (p + u)).astype(e.dtype), state.ema, params, new)
        return new, AveragedState(opt, ema)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def averaged_params(opt_state: Any, params: Any) -> Any:
    """The weight average of ``opt_state`` when it keeps one, else ``params``."""
    return opt_state.ema if isinstance(opt_state, AveragedState) else params


def _guarded_update(
    config: OptimizerConfig, loss_scaling: bool, grads: Any, scaled: Any, new_inner: Any,
    state: OptimizerState, lr: jax.Array, loss: jax.Array | None,
) -> tuple[Any, OptimizerState]:
    """The step's updates and state when bad steps are skipped and/or the loss is scaled: a bad
    step returns zero updates and keeps the inner state (see the module docstring)."""
    skip, factor, ema_decay = config.skip_bad_steps, config.skip_grad_norm_factor, config.skip_ema_decay
    norm = optax.global_norm(grads).astype(jnp.float32)
    finite = all_finite(grads) & jnp.isfinite(norm)
    if loss is not None:
        finite = finite & jnp.all(jnp.isfinite(loss))
    ema, count = state.grad_norm_ema, state.ema_count
    if not skip or factor is None:  # loss scaling alone, or no outlier test: skip only non-finite steps
        outlier = jnp.asarray(False)
        fed = norm
    else:
        outlier = (count >= config.skip_warmup_steps) & (norm > factor * ema)
        fed = jnp.where(count > 0, jnp.minimum(norm, factor * ema), norm)
    bad = ~finite | outlier
    new_ema = jnp.where(count > 0, ema_decay * ema + (1.0 - ema_decay) * fed, norm)
    scale, good = state.loss_scale, state.good_steps
    if loss_scaling:
        grow = finite & (good + 1 >= LOSS_SCALE_PERIOD)
        scale = jnp.where(finite, jnp.where(grow, scale * 2.0, scale), jnp.maximum(scale * 0.5, 1.0))
        good = jnp.where(finite & ~grow, good + 1, 0)
    out = jax.tree.map(lambda u: jnp.where(bad, jnp.zeros_like(u), u), scaled)
    kept_inner = jax.tree.map(lambda new, old: jnp.where(bad, old, new), new_inner, state.inner)
    return out, OptimizerState(
        inner=kept_inner,
        step=state.step + 1,
        learning_rate=lr,
        skipped=state.skipped + bad.astype(jnp.int32),
        grad_norm_ema=jnp.where(finite, new_ema, ema),
        ema_count=count + finite.astype(jnp.int32),
        loss_scale=scale,
        good_steps=good,
    )
