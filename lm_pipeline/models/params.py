"""A model's parameters by name: every array of a model by its dotted field path (the names the
Hugging Face mapping, checkpoints and tests use), and each array's logical sharding axes from
its owning module's ``AXES``."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def _is_param(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _names(path: tuple) -> list[str]:
    names = []
    for entry in path:
        if not isinstance(entry, jax.tree_util.GetAttrKey):
            raise TypeError(f"unexpected pytree path entry {entry!r}: models hold modules and arrays only")
        names.append(entry.name)
    return names


def named_params(model: eqx.Module) -> dict[str, Any]:
    """``{"blocks.attn.q_proj": array, ...}``: every array of ``model`` by its dotted field path."""
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(model, _is_param))[0]
    return {".".join(_names(path)): leaf for path, leaf in leaves}


def replace_params(model: eqx.Module, named: dict[str, Any]) -> eqx.Module:
    """``model`` (or an ``eqx.filter_eval_shape`` skeleton) with every array taken from ``named``."""
    unused = set(named)

    def take(path, leaf):
        if not _is_param(leaf):
            return leaf
        name = ".".join(_names(path))
        if name not in named:
            raise KeyError(f"no value for parameter {name!r}")
        value = jnp.asarray(named[name], dtype=leaf.dtype)
        if value.shape != leaf.shape:
            raise ValueError(f"parameter {name!r}: shape {value.shape}, expected {leaf.shape}")
        unused.discard(name)
        return value

    out = jax.tree_util.tree_map_with_path(take, model)
    if unused:
        raise KeyError(f"values for unknown parameters: {sorted(unused)}")
    return out


def logical_axes(model: eqx.Module) -> Any:
    """The ``PartitionSpec`` tree of ``model``'s arrays, from each owning module's ``AXES``.

    Arrays under a field named ``blocks`` (stacked blocks) get ``layers`` as first axis.
    """

    def spec(path, leaf):
        names = _names(path)
        owner = model
        for name in names[:-1]:
            owner = getattr(owner, name)
        axes = tuple(type(owner).AXES[names[-1]])
        if "blocks" in names[:-1]:
            axes = ("layers", *axes)
        if len(axes) != leaf.ndim:
            raise ValueError(f"{'.'.join(names)}: axes {axes} do not match shape {leaf.shape}")
        return P(*axes)

    return jax.tree_util.tree_map_with_path(spec, eqx.filter(model, _is_param))
