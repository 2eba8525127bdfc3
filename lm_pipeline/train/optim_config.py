"""The ``optimizer:`` section of a run config: AdamW settings and Levanter's learning-rate schedules.

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

Light on purpose: parsing a config imports this module, so it must not import JAX or Optax;
:meth:`OptimizerConfig.lr_scheduler` and :meth:`OptimizerConfig.build` come from
:mod:`lm_pipeline.train.optim`, imported when they are called.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from lm_pipeline.schema import ConfigError, field

if TYPE_CHECKING:
    import optax

__all__ = ["CyclePhases", "LrScheduleName", "OptimizerConfig", "OptimizerName"]

LrScheduleName = Literal["constant", "linear", "cosine", "inv_sqrt", "inv"]
OptimizerName = Literal["adam", "lion", "adafactor", "muon", "sophia-h"]

#: Levanter's defaults of each optimizer type for the keys a config leaves out (its
#: ``SophiaHConfig``, ``LionConfig``); ``adam``, ``adafactor`` and ``muon`` share this section's.
TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "sophia-h": {"beta1": 0.96, "beta2": 0.99, "epsilon": 1e-12, "weight_decay": 0.1},
    "lion": {"beta1": 0.9, "beta2": 0.99},
}


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



@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (decoupled weight decay, global-norm clipping) and its learning-rate schedule."""

    type: OptimizerName = field("adam", help="The update rule: 'adam' (AdamW; Levanter's adam/adamw), 'lion' (sign of interpolated momentum, Chen et al. 2023; beta1, beta2), 'adafactor' (factored second moments, Shazeer & Stern 2018; no first moment) or 'muon' (orthogonalized momentum for the blocks' matrices, AdamW at adam_lr for embeddings, norms, biases and the LM head), each through Optax; or 'sophia-h' (Liu et al. 2023, Levanter's variant: bias-corrected momentum over gamma times an EMA of Hutchinson estimates of the Hessian's diagonal, clipped to [-1, 1]; Levanter's beta1 0.96, beta2 0.99, epsilon 1e-12, weight_decay 0.1 unless given). The schedule, clipping, decoupled weight decay and bad-step skipping are the same for all.", hashed_at_default=False)
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
    momentum: float = field(0.95, help="muon: decay of the momentum that is orthogonalized (Nesterov).", hashed_at_default=False)
    ema_beta: float | None = field(None, help="An exponential moving average of the weights, ema = ema_beta * ema + (1 - ema_beta) * weights after each step (Levanter's trainer.model_averaging: {type: ema, beta}); evaluation, checkpoint evaluation and exports use it. Kept in the optimizer state; null = none.", hashed_at_default=False)
    gamma: float = field(0.01, help="sophia-h: the Hessian's scale in the preconditioner, update = clip(m / max(gamma * h, epsilon), 1).", hashed_at_default=False)
    update_interval: int = field(10, help="sophia-h: steps between two Hutchinson estimates of the Hessian's diagonal (each one Hessian-vector product on the step's batch).", hashed_at_default=False)
    adam_lr: float = field(6e-4, help="muon: peak learning rate of the parameters Muon leaves to AdamW (embeddings, norms, biases, LM head), on the same schedule; Levanter's default.", hashed_at_default=False)

    @classmethod
    def normalize_raw(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Levanter's ``type: adamw`` is ``adam``, ``sophiah`` is ``sophia-h``; a type's keys left
        out take Levanter's defaults for that type (:data:`TYPE_DEFAULTS`)."""
        kind = data.get("type")
        if not isinstance(kind, str):  # not a name: the field's own check says what it must be
            return data
        kind = data["type"] = {"adamw": "adam", "sophiah": "sophia-h", "sophia_h": "sophia-h"}.get(kind, kind)
        return {**TYPE_DEFAULTS.get(kind, {}), **data}

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
        if self.ema_beta is not None and not 0.0 < self.ema_beta < 1.0:
            raise ConfigError("ema_beta", f"must be in (0, 1) or null, got {self.ema_beta}")
        if not self.gamma > 0:
            raise ConfigError("gamma", f"must be > 0, got {self.gamma}")
        if self.update_interval < 1:
            raise ConfigError("update_interval", f"must be >= 1, got {self.update_interval}")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError("momentum", f"must be in [0, 1), got {self.momentum}")
        if not (self.adam_lr > 0 and math.isfinite(self.adam_lr)):
            raise ConfigError("adam_lr", f"must be > 0, got {self.adam_lr}")
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
        from lm_pipeline.train.optim import schedule_fn  # JAX only when scheduling, not when parsing

        phases = self.schedule_phases(num_train_steps)
        return schedule_fn(phases, self.lr_schedule, self.learning_rate, self.min_lr_ratio)

    # -- optimizer -----------------------------------------------------------------------------

    def build(
        self, num_train_steps: int, weight_decay_mask: Any, *, loss_scaling: bool = False, param_axes: Any = None
    ) -> optax.GradientTransformationExtraArgs:
        """The optimizer of ``type`` with this schedule (and bad-step skipping when enabled).

        ``param_axes``: the model's logical axes per parameter (:meth:`LmModel.param_axes`); Muon
        reads from them which parameters are matrices and which of their axes are inputs (it needs
        them).

        ``weight_decay_mask``: a pytree of bools shaped like the parameters (see
        :func:`~lm_pipeline.train.optim.weight_decay_mask`), a callable params -> such a pytree,
        or None to decay every parameter. ``update(grads, state, params, *, loss=None)`` needs
        ``params`` when ``weight_decay > 0``; ``loss`` is only looked at by ``skip_bad_steps``.

        ``loss_scaling`` (f16 compute): the state carries a dynamic loss scale
        (:func:`~lm_pipeline.train.optim.loss_scale`) that the caller multiplies the loss by,
        dividing the gradients by it again before ``update``. A step whose gradients are not
        finite is skipped (counted in :func:`~lm_pipeline.train.optim.skipped_steps`) and halves
        the scale; :data:`~lm_pipeline.train.optim.LOSS_SCALE_PERIOD` finite steps in a row double it (the scheme of
        ``jmp.DynamicLossScale``).
        """
        from lm_pipeline.train.optim import build_optimizer  # Optax only when building, not when parsing

        return build_optimizer(self, num_train_steps, weight_decay_mask, loss_scaling=loss_scaling,
                               param_axes=param_axes)
