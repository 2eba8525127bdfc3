"""Sophia-H (Liu et al. 2023, "Sophia: A Scalable Stochastic Second-order Optimizer", Algorithms 1
and 3) as Levanter runs it, as an Optax transformation.

Per step, with gradient ``g``::

    m = beta1 * m + (1 - beta1) * g;   m_hat = m / (1 - beta1 ** t)
    update = clip(m_hat / max(gamma * h, epsilon), -1, 1)

and every ``update_interval`` steps (counted after the update; the first estimate at step 10 of
10), a Hutchinson estimate of the Hessian's diagonal at the step's parameters on the step's batch,
``h_hat = u * (H u)`` with ``u ~ N(0, I)``, enters ``h = beta2 * h + (1 - beta2) * h_hat``. Until
the first estimate ``h = 0`` and every coordinate moves by the clip bound (a sign step).

Each estimate draws a fresh probe ``u``: from ``update(..., probe_key=k)`` when given (the trainer
passes its run key folded with the step, so the probe is a pure function of the run's seed and the
step, like dropout, and a resumed run draws the same), else from the state's key folded with the
step count.

The Hessian-vector product needs the objective: ``update(..., obj_fn=f)`` with ``f(params)`` the
step's mean loss, or, with ``obj_parts=n``, ``f(params, i)`` for ``i < n`` whose sum is that mean
(the trainer passes the step's micro-batches this way: part ``i`` is micro-batch ``i``'s loss sum
over the whole batch's token count), so that the estimate is taken over the gradient's own batch,
one micro-batch at a time, with one probe. It is reverse-over-reverse (the cross-entropy has a
hand-written backward pass, which forward mode cannot enter).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class SophiaState(NamedTuple):
    count: jax.Array  # steps done
    mu: Any  # first moment
    h: Any  # EMA of the Hessian diagonal estimates
    key: jax.Array  # the probes' key without a probe_key: folded with the step count per estimate


def probe_like(params: Any, key: jax.Array) -> Any:
    """The Gaussian probe ``u ~ N(0, I)`` shaped like ``params`` drawn from ``key``."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [jax.random.normal(k, p.shape, jnp.float32).astype(p.dtype)
                                        for k, p in zip(keys, leaves, strict=True)])


def hutchinson_diagonal(obj_fn: Callable[..., jax.Array], params: Any, key: jax.Array, parts: int | None = None) -> Any:
    """``u * (H u)`` for one Gaussian probe ``u``: an unbiased estimate of diag(H) of ``obj_fn`` at ``params``.

    ``parts``: None, ``obj_fn(params)`` is the objective; else it is ``sum_i obj_fn(params, i)`` for
    ``i < parts``, and ``H u`` is summed over the parts (a scan: one part's second-order pass at a
    time), with the one probe."""
    probe = probe_like(params, key)

    def hvp_of(f):
        def grad_dot_probe(p):
            g = jax.grad(f)(p)
            return sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(probe), strict=True))

        return jax.grad(grad_dot_probe)(params)

    if parts is None:
        hvp = hvp_of(obj_fn)
    else:
        def body(acc, i):
            return jax.tree.map(jnp.add, acc, hvp_of(lambda p: obj_fn(p, i))), None

        hvp = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), jnp.arange(parts))[0]
    return jax.tree.map(lambda u, hu: u * hu, probe, hvp)


def scale_by_sophia_h(beta1: float, beta2: float, epsilon: float, gamma: float, update_interval: int,
                      seed: int = 0, clip: float = 1.0) -> optax.GradientTransformationExtraArgs:
    """The Sophia-H direction (see the module docstring); ``update`` needs ``params`` and ``obj_fn``."""

    def init_fn(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return SophiaState(jnp.zeros([], jnp.int32), zeros, zeros, jax.random.key_data(jax.random.key(seed)))

    def update_fn(updates, state: SophiaState, params=None, *, obj_fn=None, obj_parts=None, probe_key=None,
                  **extra):
        del extra
        if params is None or obj_fn is None:
            raise ValueError("sophia-h needs params and obj_fn (the step's loss as a function of the params)")
        count = state.count + 1
        mu = jax.tree.map(lambda g, m: beta1 * m + (1 - beta1) * g, updates, state.mu)
        direction = jax.tree.map(
            lambda m, h: jnp.clip(m / (1 - beta1 ** count) / jnp.maximum(gamma * h, epsilon), -clip, clip),
            mu, state.h)

        key = probe_key if probe_key is not None else jax.random.fold_in(jax.random.wrap_key_data(state.key), count)

        def estimate(h):
            fresh = hutchinson_diagonal(obj_fn, params, key, obj_parts)
            return jax.tree.map(lambda new, old: beta2 * old + (1 - beta2) * new, fresh, h)

        h = jax.lax.cond(count % update_interval == 0, estimate, lambda h: h, state.h)
        return direction, SophiaState(count, mu, h, state.key)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
