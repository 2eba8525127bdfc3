"""Device mesh, axis mappings and shardings.

The mesh has two axes: ``data`` (data parallelism, and FSDP when parameters are sharded over
it) and ``model`` (tensor parallelism, ``model_axis_size`` devices). Models name their
parameters' axes logically (``embed``, ``mlp``, ``heads``, ...); an *axis mapping* sends logical
names to mesh axes. As in Levanter there are two mappings: one for parameters at rest
(FSDP shards ``embed`` over ``data``) and one for compute (the batch over ``data``). XLA's
SPMD partitioner inserts the collectives.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lm_pipeline.train.config import DistributedConfig, TrainerConfig

log = logging.getLogger(__name__)

AxisMapping = Mapping[str, str | None]

DEFAULT_TP_AXES = ("mlp", "heads", "kv_heads", "vocab")


@dataclass(frozen=True)
class MeshPlan:
    mesh: Mesh
    param_mapping: dict[str, str | None]
    compute_mapping: dict[str, str | None]

    @property
    def data_size(self) -> int:
        return self.mesh.shape["data"]

    @property
    def model_size(self) -> int:
        return self.mesh.shape["model"]

    def batch_sharding(self) -> NamedSharding:
        """[B, T] arrays: the batch over the data axis."""
        return NamedSharding(self.mesh, P(self.compute_mapping.get("batch"), None))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def param_shardings(self, param_axes, shapes=None):
        """Shardings for a pytree of logical PartitionSpecs (see ``LmModel.param_axes``).

        An axis is sharded only if its size divides evenly by the mesh axis (else replicated),
        so odd vocab sizes and tiny test models still work on any mesh.
        """

        def one(spec: P, shape=None) -> NamedSharding:
            used: set[str] = set()
            out = []
            for i, name in enumerate(spec):
                axis = self.param_mapping.get(name) if name is not None else None
                if axis is not None and (axis in used or (shape is not None and shape[i] % self.mesh.shape[axis])):
                    axis = None
                if axis is not None:
                    used.add(axis)
                out.append(axis)
            return NamedSharding(self.mesh, P(*out))

        if shapes is None:
            return jax.tree.map(one, param_axes)
        return jax.tree.map(lambda s, x: one(s, x.shape), param_axes, shapes)


def axis_mappings(cfg: TrainerConfig) -> tuple[dict[str, str | None], dict[str, str | None]]:
    """(parameter mapping, compute mapping) from the basic or advanced settings."""
    tp = cfg.tensor_parallel_axes if cfg.tensor_parallel_axes is not None else DEFAULT_TP_AXES
    fsdp = (cfg.fsdp_axis,) if isinstance(cfg.fsdp_axis, str) else tuple(cfg.fsdp_axis or ())
    compute: dict[str, str | None] = {cfg.batch_axis: "data", "batch": "data"}
    if cfg.model_axis_size > 1:
        compute.update({a: "model" for a in tp})
    param = dict(compute)
    param.pop(cfg.batch_axis, None)
    param.pop("batch", None)
    param.update({a: "data" for a in fsdp})
    if cfg.axis_resources:
        param.update(cfg.axis_resources)
        compute.update(cfg.axis_resources)
    if cfg.parameter_axis_resources:
        param.update(cfg.parameter_axis_resources)
    if cfg.compute_axis_resources:
        compute.update(cfg.compute_axis_resources)
    return param, compute


def make_mesh(cfg: TrainerConfig, devices=None) -> MeshPlan:
    """Mesh of shape (data = devices / model_axis_size, model = model_axis_size)."""
    devices = list(devices if devices is not None else jax.devices())
    cfg.check_devices(len(devices))
    data = len(devices) // cfg.model_axis_size
    grid = np.array(devices).reshape(data, cfg.model_axis_size)
    mesh = Mesh(grid, ("data", "model"))
    param, compute = axis_mappings(cfg)
    return MeshPlan(mesh, param, compute)


_initialized = False


def initialize_distributed(cfg: DistributedConfig) -> None:
    """Start ``jax.distributed`` when configured (idempotent); CPU uses gloo collectives."""
    global _initialized
    if _initialized or not cfg.enabled:
        return
    # Cross-process collectives on the CPU backend need an implementation (harmless on GPU/TPU).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=cfg.coordinator_address,
        num_processes=cfg.num_processes,
        process_id=cfg.process_id,
        local_device_ids=list(cfg.local_device_ids) if cfg.local_device_ids is not None else None,
    )
    _initialized = True
    log.info("jax.distributed: process %d of %d, %d global devices", jax.process_index(), jax.process_count(), jax.device_count())
