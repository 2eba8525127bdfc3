"""Muon as Optax's ``contrib.muon`` computes it, with one state tree shaped like the parameters.

``optax.contrib.muon`` partitions the parameters into a Muon part and an AdamW part, so its state
holds masked placeholders where the other part's parameters are; the trainer lays optimizer state
out by mapping each parameter-shaped leaf to its parameter's sharding, which those placeholders
break. Here every parameter has a first moment (Muon's momentum or Adam's) and a second moment
(used by the AdamW parameters only), the same two buffers as AdamW, and the arithmetic is
Optax's (its Newton-Schulz iteration and width scaling; ``tests/test_optimizer_types.py`` checks
step for step that this equals ``contrib.muon``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.contrib import _muon  # private: its Newton-Schulz iteration and width scaling


class MuonAdamState(NamedTuple):
    count: jax.Array
    mu: Any  # first moment of every parameter
    nu: Any  # second moment (AdamW's parameters; zeros for Muon's)


def scale_by_muon_and_adam(dims: Any, *, momentum: float, beta1: float, beta2: float, epsilon: float,
                           adam_scale: float) -> optax.GradientTransformation:
    """Muon (Nesterov momentum ``momentum``, orthogonalized, width-scaled) where ``dims`` holds a
    :class:`optax.contrib.MuonDimensionNumbers`; Nesterov Adam scaled by ``adam_scale`` where it
    holds None. ``dims`` is shaped like the parameters."""
    coeffs = jnp.asarray(_muon._DEFAULT_NS_COEFFS)

    def init_fn(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return MuonAdamState(jnp.zeros([], jnp.int32), zeros, zeros)

    def nesterov(g, m, b, count):
        return b * m / (1 - b ** (count + 1)) + (1 - b) * g / (1 - b ** count)

    def leaf(dim, g, m, v, count):
        if dim is not None:
            m = momentum * m + (1 - momentum) * g
            x = _muon.orthogonalize_via_newton_schulz(nesterov(g, m, momentum, count), coeffs, 5, "frobenius",
                                                      epsilon, dim)
            return _muon._scale_update_for_width_transfer(x, dim), m, v
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * jnp.square(g)
        u = nesterov(g, m, beta1, count) / (jnp.sqrt(v / (1 - beta2 ** count)) + epsilon)
        return adam_scale * u, m, v

    def update_fn(updates, state: MuonAdamState, params=None):
        del params
        count = state.count + 1
        g, treedef = jax.tree.flatten(updates)
        flags = treedef.flatten_up_to(dims)  # per gradient leaf: its dimension numbers, or None
        out = [leaf(d, *x, count) for d, *x in zip(flags, g, jax.tree.leaves(state.mu), jax.tree.leaves(state.nu),
                                                    strict=True)]
        u, m, v = (jax.tree.unflatten(treedef, [o[i] for o in out]) for i in range(3))
        return u, MuonAdamState(count, m, v)

    return optax.GradientTransformation(init_fn, update_fn)
