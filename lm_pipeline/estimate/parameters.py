"""Parameter count and the per-device bytes of everything parameter-shaped, from the traced
shapes of the model (``jax.eval_shape``) and the sharding arithmetic; nothing is allocated.

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
* **compute copy**: ``cast_floating`` copies every parameter into the compute dtype when it
  differs (``mp: p=f32,c=bf16``); under FSDP the copy used by the compute is the gathered
  (unsharded over ``data``) one, whatever the dtype. On accelerators the unrolled layers cast
  each layer's weights just before use, so only the gathered copies count there.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

if TYPE_CHECKING:
    from lm_pipeline.config import RunConfig
    from lm_pipeline.models import LmConfig


@dataclass(frozen=True)
class ParameterMemory:
    """The parameter count and the bytes per device of the parameter-shaped state."""

    num_params: int  # elements, all leaves
    param_dtype: str  # the parameters' storage dtype (f32 master weights)
    params: int
    gradients: int  # f32, sharded like the parameters
    compute_copy: int  # parameters in the compute dtype as the step uses them (gathered under FSDP)
    backward_gradients: int  # f32 gradients while the backward pass runs (unsharded under FSDP)
    optimizer: int


def is_array_like(x: Any) -> bool:
    """Whether ``x`` is an array or an abstract one (a leaf of a traced model)."""
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


@functools.lru_cache(maxsize=32)
def abstract_model(model_cfg: LmConfig, vocab_size: int) -> Any:
    """The model of ``model_cfg`` with ``jax.ShapeDtypeStruct`` leaves: shapes only, no arrays."""

    def make(key_data):
        return model_cfg.build(vocab_size, key=jax.random.wrap_key_data(key_data))

    return eqx.filter_eval_shape(make, jax.ShapeDtypeStruct((2,), jnp.uint32))


def parameter_memory(
    cfg: RunConfig, vocab_size: int, *, data_size: int, compute_dtype: Any, on_cpu: bool
) -> ParameterMemory:
    """Parameter count and per-device bytes of parameters, gradients, the compute copy and the
    optimizer state of ``cfg`` on a ``data_size x trainer.model_axis_size`` mesh."""
    from lm_pipeline.train.sharding import axis_mappings

    abstract = abstract_model(cfg.model, vocab_size)
    params = eqx.filter(abstract, is_array_like)
    axes = abstract.param_axes()
    mapping = axis_mappings(cfg.trainer)[0]
    mesh_shape = {"data": data_size, "model": cfg.trainer.model_axis_size}
    param_leaves, treedef = jax.tree.flatten(params)
    specs = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, P))
    both = [_shard_factors(s, p.shape, mapping, mesh_shape) for s, p in zip(specs, param_leaves, strict=True)]
    factors = jax.tree.unflatten(treedef, [f for f, _ in both])
    leaves = [(p, f, d) for p, (f, d) in zip(param_leaves, both, strict=True)]
    # FSDP: parameters sharded over ``data`` are gathered for compute (in the compute dtype) and
    # their f32 gradients exist unsharded over ``data`` until reduce-scattered.
    floating = [(p, f, d) for p, f, d in leaves if jnp.issubdtype(p.dtype, jnp.floating)]
    # On accelerators the unrolled layers cast (and, under FSDP, gather) each layer's weights
    # just before use: only the gathered copies are counted, not a whole compute-dtype copy.
    compute_copy = sum(_sharded_bytes(p, f // d, compute_dtype) for p, f, d in floating
                       if d > 1 or (on_cpu and jnp.dtype(p.dtype) != compute_dtype))
    return ParameterMemory(
        num_params=sum(math.prod(p.shape) for p, _, _ in leaves),
        param_dtype=str(np.dtype(param_leaves[0].dtype)),
        params=sum(_sharded_bytes(p, f) for p, f, _ in leaves),
        gradients=sum(_sharded_bytes(p, f, jnp.float32) for p, f, _ in leaves),
        compute_copy=compute_copy,
        backward_gradients=sum(_sharded_bytes(p, f // d, jnp.float32) for p, f, d in leaves),
        optimizer=_optimizer_bytes(cfg.optimizer, params, axes, factors),
    )


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

    tx = opt_cfg.build(1000, weight_decay_mask(params, axes), param_axes=axes)
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
