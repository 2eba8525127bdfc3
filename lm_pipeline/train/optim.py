"""AdamW with Levanter's learning-rate schedules, weight-decay masking and bad-step skipping.

Configuration (``optimizer:``) uses Levanter's names and defaults::

    optimizer:
      learning_rate: 3e-4
      weight_decay: 0.1
      lr_schedule: cosine      # constant | linear | cosine | inv_sqrt | inv
      min_lr_ratio: 0.1
      warmup: 0.01             # fraction of the (first) cycle, or steps
      decay: null              # null = the rest of the cycle after warmup
      cycles: null             # N, or [steps where cycles end]
      cycle_length: null       # steps, fraction, or [lengths]
      rewarmup: 0.0

Learning-rate schedule
----------------------
The run is cut into cycles (one by default). Each cycle is::

    [(re)warmup] -> [stable at learning_rate] -> [decay to min_lr_ratio * learning_rate]

* ``warmup`` applies to the first cycle and ramps linearly from 0 (so step 0 has lr 0, as in
  Levanter). ``rewarmup`` applies to every later cycle and ramps linearly from the previous
  cycle's final value back to the peak; ``rewarmup: 0`` jumps straight back to the peak.
* ``decay`` is the length of the decay phase; ``None`` means "all of the cycle after the
  (re)warmup" (no stable phase). The stable phase is whatever is left, so WSD is
  ``warmup: 0.01, decay: 0.2`` (or in steps).
* Lengths (``warmup``, ``decay``, ``rewarmup``, float ``cycle_length``): a Python ``int`` is a
  number of steps; a float in ``[0, 1]`` is a fraction of the cycle it applies to (of the run
  for ``cycle_length``), truncated to whole steps like Levanter (0.29 of 100 is 29, not 28); an integral float > 1 (e.g.
  YAML ``1e3``) is steps. Note ``1`` is one step while ``1.0`` is the whole cycle.
* ``cycles: N`` gives N equal cycles (minima at ``k * num_train_steps / N``, ``k = 1..N``,
  truncated to ints, exactly like Levanter's implementation); ``cycles: [a, b, ...]`` lists the
  steps where cycles end (their minima); ``num_train_steps`` always ends the last cycle.
  ``cycle_length: L`` cuts cycles of L steps (the last cycle absorbs any remainder);
  ``cycle_length: [l1, l2, ...]`` gives the lengths (a remainder becomes a final cycle).
  Giving both ``cycles`` and ``cycle_length`` is an error.
* The value at a cycle boundary step belongs to the *next* cycle: with ``rewarmup > 0`` it is
  the minimum (the ramp starts there); with ``rewarmup: 0`` it is already the peak. After the
  last cycle (``step >= num_train_steps``) the schedule stays at its final value.

Decay shapes over the decay phase, with ``u`` in ``[0, 1]`` the fraction of the decay phase
done, ``P = learning_rate``, ``r = min_lr_ratio``, ``m = r * P``:

* ``constant``: ``P`` (no decay at all; only the warmup shapes the schedule).
* ``linear``: ``P + (m - P) * u``.
* ``cosine``: ``m + (P - m) * (1 + cos(pi * u)) / 2``.
* ``inv_sqrt``: ``P / sqrt(1 + t / tau)`` with ``t`` the steps into the decay and
  ``tau = decay_steps / (1 / r**2 - 1)``, i.e. the time scale is fitted so the decay ends at
  exactly ``m``. (Levanter uses a fixed 10,000-step time scale floored at ``m``; here every
  schedule reaches ``m`` at the end of each cycle, so cycles behave the same for all shapes.)
* ``inv``: ``P / (1 + t / tau)`` with ``tau = decay_steps / (1 / r - 1)`` (Levanter's ``inv``).

``inv_sqrt`` and ``inv`` need ``min_lr_ratio > 0``.

Optimizer
---------
:meth:`OptimizerConfig.build` returns an :class:`optax.GradientTransformationExtraArgs`::

    clip_by_global_norm(max_grad_norm) -> scale_by_adam(beta1, beta2, epsilon)
      -> add_decayed_weights(weight_decay, mask) -> scale(-schedule(step))

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
import itertools
import math
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from lm_pipeline.schema import ConfigError, field

LrScheduleName = Literal["constant", "linear", "cosine", "inv_sqrt", "inv"]

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


def _to_steps(value: int | float, total: int) -> int:
    """Levanter's fraction-or-steps: ints are steps, floats in [0, 1] a fraction of ``total``."""
    if isinstance(value, bool):
        raise TypeError("expected a number, got a boolean")
    if isinstance(value, int):
        return value
    if value <= 1.0:
        # Truncate like Levanter, but not below a whole step lost to rounding (0.29 * 100 -> 29).
        return int(math.floor(value * total + 1e-6))
    return int(value)


def _check_frac_or_steps(name: str, value: int | float | None, *, allow_none: bool = False) -> None:
    if value is None:
        if not allow_none:
            raise ConfigError(name, "is required")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(name, f"expected a fraction in [0, 1] or a number of steps, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(name, f"must be finite, got {value}")
    if value < 0:
        raise ConfigError(name, f"must be >= 0 (a fraction in [0, 1] or a number of steps), got {value}")
    if isinstance(value, float) and value > 1.0 and not value.is_integer():
        raise ConfigError(
            name, f"{value} is neither a fraction in [0, 1] nor a whole number of steps; use e.g. 0.1 or 500"
        )


@dataclass(frozen=True)
class CyclePhases:
    """One cycle of the schedule, in absolute steps: ``[start, end)``."""

    start: int
    warmup: int  # (re)warmup steps
    stable: int
    decay: int
    end: int
    warmup_from: float  # the lr the (re)warmup starts from (0 in the first cycle)


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


def _schedule_fn(phases: list[CyclePhases], kind: str, peak: float, ratio: float) -> optax.Schedule:
    """Evaluate the cycle containing ``count`` (found by binary search, so many cycles stay cheap)."""
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


# --- config -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (decoupled weight decay, global-norm clipping) and its learning-rate schedule."""

    learning_rate: float = field(1e-4, help="Peak learning rate.")
    weight_decay: float = field(0.0, help="Decoupled (AdamW) weight decay, applied to matrices only (see weight_decay_mask).")
    beta1: float = field(0.9, help="Adam beta1.")
    beta2: float = field(0.95, help="Adam beta2.")
    epsilon: float = field(1e-8, help="Adam epsilon.")
    max_grad_norm: float | None = field(1.0, help="Clip gradients to this global norm; null = no clipping.")
    lr_schedule: LrScheduleName = field("cosine", help="Decay shape: constant, linear, cosine, inv_sqrt or inv.")
    min_lr_ratio: float = field(0.1, help="Each cycle decays to min_lr_ratio * learning_rate.")
    warmup: int | float = field(0.01, help="First-cycle warmup from 0: a fraction of the cycle (float <= 1) or steps (int).")
    decay: int | float | None = field(None, help="Decay phase per cycle (fraction or steps); null = all of the cycle after warmup. A stable phase fills the rest (WSD).")
    rewarmup: int | float = field(0.0, help="Warmup of later cycles from the previous minimum (fraction or steps); 0 = jump back to the peak.")
    cycles: int | tuple[int, ...] | None = field(None, help="Number of equal cycles, or the steps where cycles end (their minima).")
    cycle_length: int | float | tuple[int, ...] | None = field(None, help="Cycle length in steps or as a fraction of the run, or a list of lengths. Not with cycles.")
    skip_bad_steps: bool = field(False, help="Skip (no parameter or moment change) steps with non-finite loss/gradients or an outlier gradient norm.")
    skip_grad_norm_factor: float | None = field(5.0, help="skip_bad_steps: a grad norm above this times its running EMA is an outlier; null = only non-finite steps are skipped.")
    skip_warmup_steps: int = field(100, help="skip_bad_steps: steps that feed the grad-norm EMA before outliers can be skipped.")
    skip_ema_decay: float = field(0.99, help="skip_bad_steps: decay of the grad-norm EMA.")

    @classmethod
    def normalize_raw(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Accept Levanter's ``type: adam`` (the only optimizer here)."""
        kind = data.pop("type", "adam")
        if kind not in ("adam", "adamw"):
            raise ConfigError("type", f"unknown optimizer {kind!r}; only 'adam' (AdamW) is available")
        return data

    # -- validation ----------------------------------------------------------------------------

    def validate(self) -> None:
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ConfigError("learning_rate", f"must be > 0, got {self.learning_rate}")
        if not self.weight_decay >= 0:
            raise ConfigError("weight_decay", f"must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ConfigError(name, f"must be in [0, 1), got {v}")
        if not self.epsilon >= 0:
            raise ConfigError("epsilon", f"must be >= 0, got {self.epsilon}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError("max_grad_norm", f"must be > 0 or null (no clipping), got {self.max_grad_norm}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if self.lr_schedule in ("inv_sqrt", "inv") and self.min_lr_ratio == 0.0:
            raise ConfigError("min_lr_ratio", f"must be > 0 for lr_schedule '{self.lr_schedule}' (it never reaches 0)")
        _check_frac_or_steps("warmup", self.warmup)
        _check_frac_or_steps("decay", self.decay, allow_none=True)
        _check_frac_or_steps("rewarmup", self.rewarmup)
        # Fractions of the same cycle can be checked without knowing the run length.
        if isinstance(self.decay, float) and self.decay <= 1.0:
            for name in ("warmup", "rewarmup"):
                w = getattr(self, name)
                if isinstance(w, float) and w <= 1.0 and w + self.decay > 1.0 + 1e-9:
                    raise ConfigError(
                        "decay", f"{name} ({w}) + decay ({self.decay}) is more than the whole cycle (1.0)"
                    )
        if self.cycles is not None and self.cycle_length is not None:
            raise ConfigError(
                "cycle_length", "give only one of 'cycles' and 'cycle_length' (both are set)"
            )
        if isinstance(self.cycles, int):
            if self.cycles < 1:
                raise ConfigError("cycles", f"must be >= 1, got {self.cycles}")
        elif self.cycles is not None:
            pts = list(self.cycles)
            if not pts:
                raise ConfigError("cycles", "an empty list; give the steps where cycles end, or null")
            if pts[0] < 1 or any(b <= a for a, b in zip(pts, pts[1:], strict=False)):
                raise ConfigError("cycles", f"must be strictly increasing positive steps, got {pts}")
        if isinstance(self.cycle_length, (int, float)):
            _check_frac_or_steps("cycle_length", self.cycle_length)
            if self.cycle_length == 0:
                raise ConfigError("cycle_length", "must be > 0")
        elif self.cycle_length is not None:
            lengths = list(self.cycle_length)
            if not lengths or any(n < 1 for n in lengths):
                raise ConfigError("cycle_length", f"a list of cycle lengths must hold positive steps, got {lengths}")
        if self.skip_grad_norm_factor is not None and not self.skip_grad_norm_factor > 1.0:
            raise ConfigError("skip_grad_norm_factor", f"must be > 1 or null, got {self.skip_grad_norm_factor}")
        if self.skip_warmup_steps < 0:
            raise ConfigError("skip_warmup_steps", f"must be >= 0, got {self.skip_warmup_steps}")
        if not 0.0 <= self.skip_ema_decay < 1.0:
            raise ConfigError("skip_ema_decay", f"must be in [0, 1), got {self.skip_ema_decay}")

    # -- schedule ------------------------------------------------------------------------------

    def cycle_ends(self, num_train_steps: int) -> list[int]:
        """The steps where cycles end (their minima), the last being ``num_train_steps``."""
        n = num_train_steps
        if n < 1:
            raise ValueError(f"num_train_steps must be >= 1, got {n}")
        if self.cycle_length is not None:
            if isinstance(self.cycle_length, (int, float)):
                length = _to_steps(self.cycle_length, n)
                if length < 1:
                    raise ConfigError("cycle_length", f"{self.cycle_length} of {n} steps is less than one step")
                points = [i * length for i in range(1, n // length)]
            else:
                points = list(itertools.accumulate(int(v) for v in self.cycle_length))
                if points[-1] > n:
                    raise ConfigError(
                        "cycle_length", f"the cycle lengths add up to {points[-1]}, more than num_train_steps={n}"
                    )
        elif isinstance(self.cycles, int):
            points = [int(n / self.cycles * (i + 1)) for i in range(self.cycles - 1)]
            if len(set(points)) != len(points) or (points and points[0] < 1):
                raise ConfigError("cycles", f"{self.cycles} cycles do not fit in {n} steps")
        elif self.cycles is not None:
            points = list(self.cycles)
            if points[-1] > n:
                raise ConfigError("cycles", f"step {points[-1]} is past the end of training (num_train_steps={n})")
        else:
            points = []
        if not points or points[-1] != n:
            points.append(n)
        return points

    def schedule_phases(self, num_train_steps: int) -> list[CyclePhases]:
        """The cycles of the schedule with their phase lengths in steps (checks they fit)."""
        phases: list[CyclePhases] = []
        start = 0
        prev_end_lr = 0.0
        peak, ratio = self.learning_rate, self.min_lr_ratio
        for i, end in enumerate(self.cycle_ends(num_train_steps)):
            length = end - start
            wname = "warmup" if i == 0 else "rewarmup"
            warm = _to_steps(self.warmup if i == 0 else self.rewarmup, length)
            decay = length - warm if self.decay is None else _to_steps(self.decay, length)
            if warm > length:
                raise ConfigError(wname, f"{warm} steps is longer than cycle {i} ({length} steps, {start}..{end})")
            if warm + decay > length:
                raise ConfigError(
                    "decay",
                    f"{wname} ({warm} steps) + decay ({decay} steps) exceed the length of cycle {i} "
                    f"({length} steps, {start}..{end})",
                )
            phases.append(CyclePhases(start, warm, length - warm - decay, decay, end, prev_end_lr if i else 0.0))
            # Every decay shape ends at exactly min_lr_ratio * peak (constant: at the peak).
            prev_end_lr = peak * ratio if decay > 0 and self.lr_schedule != "constant" else peak
            start = end
        return phases

    def lr_scheduler(self, num_train_steps: int) -> optax.Schedule:
        """The learning rate as a function of the step (jit-able; ints or int arrays)."""
        phases = self.schedule_phases(num_train_steps)
        return _schedule_fn(phases, self.lr_schedule, self.learning_rate, self.min_lr_ratio)

    # -- optimizer -----------------------------------------------------------------------------

    def build(
        self, num_train_steps: int, weight_decay_mask: Any, *, loss_scaling: bool = False
    ) -> optax.GradientTransformationExtraArgs:
        """AdamW with this schedule (and bad-step skipping when enabled).

        ``weight_decay_mask``: a pytree of bools shaped like the parameters (see
        :func:`weight_decay_mask`), a callable params -> such a pytree, or None to decay every
        parameter. ``update(grads, state, params, *, loss=None)`` needs ``params`` when
        ``weight_decay > 0``; ``loss`` is only looked at by ``skip_bad_steps``.

        ``loss_scaling`` (f16 compute): the state carries a dynamic loss scale
        (:func:`loss_scale`) that the caller multiplies the loss by, dividing the gradients by
        it again before ``update``. A step whose gradients are not finite is skipped (counted
        in :func:`skipped_steps`) and halves the scale; :data:`LOSS_SCALE_PERIOD` finite steps
        in a row double it (the scheme of ``jmp.DynamicLossScale``).
        """
        schedule = self.lr_scheduler(num_train_steps)
        parts: list[optax.GradientTransformation] = []
        if self.max_grad_norm is not None:
            parts.append(optax.clip_by_global_norm(self.max_grad_norm))
        parts.append(optax.scale_by_adam(self.beta1, self.beta2, self.epsilon))
        if self.weight_decay > 0:
            parts.append(optax.add_decayed_weights(self.weight_decay, weight_decay_mask))
        inner = optax.chain(*parts)
        skip = self.skip_bad_steps
        factor = self.skip_grad_norm_factor
        ema_decay = self.skip_ema_decay
        skip_warmup = self.skip_warmup_steps

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
            del extra_args
            lr = schedule(state.step)
            new_updates, new_inner = inner.update(updates, state.inner, params)
            scaled = jax.tree.map(lambda u: (-lr * u).astype(u.dtype), new_updates)
            if not skip and not loss_scaling:
                return scaled, state._replace(inner=new_inner, step=state.step + 1, learning_rate=lr)

            norm = optax.global_norm(updates).astype(jnp.float32)
            finite = all_finite(updates) & jnp.isfinite(norm)
            if loss is not None:
                finite = finite & jnp.all(jnp.isfinite(loss))
            ema, count = state.grad_norm_ema, state.ema_count
            if not skip:  # loss scaling alone: skip only non-finite steps
                outlier = jnp.asarray(False)
                fed = norm
            elif factor is None:
                outlier = jnp.asarray(False)
                fed = norm
            else:
                outlier = (count >= skip_warmup) & (norm > factor * ema)
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

        return optax.GradientTransformationExtraArgs(init_fn, update_fn)

