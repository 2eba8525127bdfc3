"""The token cache built on a Ray cluster: one Ray task per shard group, then one commit here.

:func:`build_token_cache_on_ray` is the fan-out of :mod:`lm_pipeline.steps.fanout` with Ray tasks
in place of Dagster ops: the driver builds the tokenizer (a hit when it exists), submits
``Pipeline.token_cache_part(group)`` for every group as a task (``num_cpus`` and other resources
per task, ``SPREAD`` over the nodes by default), gathers the tasks' results and calls
``Pipeline.token_cache_commit``, which merges the parts in group order: the artifact is
byte-identical to the single-process build, whatever order the tasks finish in. A task whose
worker dies is re-run by Ray (``max_retries``); a part is rebuilt from scratch, so a retried part
is the same part.

The tasks read the shards and write their parts into the store themselves, so ``store.root`` and
the data must be reachable from every node under the same name: an object store
(``s3://``, ``gs://``) or a directory every node mounts at the same path. Each task recomputes the
token cache's fingerprint from the config and the data it sees and refuses to write a part when it
differs from the driver's.

The driver connects with ``ray.init(address)``: ``auto``, the cluster's GCS address
``<head>:6379`` (from a node of the cluster) or ``ray://<head>:10001`` (Ray Client, from any
machine). Ray is imported lazily (:func:`lm_pipeline.cluster.require_ray`).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from lm_pipeline.cluster import ClusterError, require_ray

if TYPE_CHECKING:
    from lm_pipeline.steps.pipeline import Pipeline
    from lm_pipeline.steps.result import StageResult

log = logging.getLogger(__name__)

#: The fault point each task passes after writing its part (tests kill a task there).
FAULTPOINT = "token_cache.ray_part_built"
_ADDRESS_RE = re.compile(r"^(auto|local|ray://[A-Za-z0-9_.\-]+(:\d{1,5})?/?|[A-Za-z0-9_.\-]+:\d{1,5})$")


def check_ray_address(address: str | None) -> str | None:
    """``address`` stripped, if ``ray.init`` can take it (``auto``, ``<host>:<port>``,
    ``ray://<host>:<port>``; None: ``$RAY_ADDRESS`` or a new local Ray), else a :class:`ClusterError`."""
    if address is None:
        return None
    addr = address.strip()
    if addr.startswith(("http://", "https://")):
        raise ClusterError(f"ray address {addr!r} is a job API (dashboard) address; tokenizing on Ray connects a "
                           "driver: give the cluster's GCS address <head>:6379 (on a node) or ray://<head>:10001")
    if not _ADDRESS_RE.match(addr):
        raise ClusterError(f"ray address {addr!r} is not one ray.init takes (auto, <head>:6379 or ray://<head>:10001)")
    return addr


def _first_line(e: BaseException) -> str:
    """``Type: first line`` of ``e`` (and the last line when the first only announces what follows)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = f"{lines[0]} {lines[-1]}" if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    return f"{type(e).__name__}: {text}"


def _build_part(config_yaml: str, store_root: str, expected_fingerprint: str, group: dict[str, Any]) -> dict[str, Any]:
    """The Ray task: one shard group's part, written into the store; ``{part, node_id, ip, pid}``."""
    import ray
    import yaml

    from lm_pipeline.config import RunConfig
    from lm_pipeline.faultpoints import faultpoint
    from lm_pipeline.schema import from_dict
    from lm_pipeline.steps import CacheGroup, Pipeline
    from lm_pipeline.store import open_store

    pipe = Pipeline(from_dict(RunConfig, yaml.safe_load(config_yaml)), open_store(store_root), progress=False)
    fp = pipe.address("token_cache").fingerprint
    if fp != expected_fingerprint:
        raise RuntimeError(f"token_cache fingerprint {fp} on this node differs from the driver's {expected_fingerprint}; "
                           "the data or the code differs between the machines")
    info = pipe.token_cache_part(CacheGroup.from_dict(group))
    faultpoint(FAULTPOINT)
    ctx = ray.get_runtime_context()
    return {"part": info, "node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}


def build_token_cache_on_ray(pipe: Pipeline, *, address: str | None = None, num_cpus: float = 1.0,
                             resources: Mapping[str, float] | None = None, max_retries: int = 3,
                             scheduling_strategy: str = "SPREAD", runtime_env: Mapping[str, Any] | None = None,
                             on_part: Callable[[dict[str, Any]], None] | None = None) -> StageResult:
    """Build ``pipe``'s token cache with one Ray task per shard group; a hit returns at once.

    ``address``: what ``ray.init`` takes (see the module); ignored when this process is already
    connected. ``num_cpus``, ``resources``: what each task reserves. ``max_retries``: how often
    Ray re-runs a task whose worker died. ``runtime_env``: the tasks' Ray runtime environment.
    ``on_part``: called with each finished task's result (``part``, ``node_id``, ``ip``, ``pid``),
    in completion order (where each group was built).
    """
    from lm_pipeline.config import dump_config

    address = check_ray_address(address)
    if num_cpus < 0 or max_retries < 0:
        raise ClusterError(f"num_cpus and max_retries must be >= 0, got {num_cpus!r} and {max_retries!r}")
    ray = require_ray("tokenizing on Ray")
    hit = pipe.cached("token_cache")
    if hit is not None:
        return hit
    started_here = not ray.is_initialized()
    if started_here:
        try:
            ray.init(address=address, log_to_driver=True)
        except Exception as e:
            raise ClusterError(f"cannot connect to the Ray cluster at {address or '$RAY_ADDRESS/local'}: {_first_line(e)}") from None
    try:
        pipe.tokenizer()  # once, here: every task reads it
        fp = pipe.address("token_cache").fingerprint
        groups = pipe.token_cache_groups()
        task = ray.remote(_build_part).options(
            num_cpus=num_cpus, resources=dict(resources or {}), max_retries=max_retries, retry_exceptions=False,
            scheduling_strategy=scheduling_strategy, runtime_env=dict(runtime_env) if runtime_env else None,
            name="token_cache_part")
        config_yaml = dump_config(pipe.cfg)
        t0 = time.perf_counter()
        pending = {task.remote(config_yaml, pipe.store.root, fp, g.to_dict()): g for g in groups}
        log.info("token_cache %s: %d shard groups submitted as Ray tasks", fp, len(pending))
        done: dict[str, dict[str, Any]] = {}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                group = pending.pop(ref)
                try:
                    out = ray.get(ref)
                except Exception as e:
                    for other in pending:
                        ray.cancel(other, force=True)
                    cause = getattr(e, "cause", None) or e  # a task's own exception, else Ray's (worker died, ...)
                    raise ClusterError(f"token cache group {group.key} failed on the cluster: {_first_line(cause)}") from None
                done[group.key] = out
                log.info("token_cache %s: group %s built on %s (pid %d): %s docs, %s tokens in %.1fs", fp, group.key,
                         out["ip"], out["pid"], out["part"].get("num_docs"), out["part"].get("num_tokens"),
                         out["part"].get("seconds", 0.0))
                if on_part is not None:
                    on_part(out)
        parts = [done[g.key]["part"] for g in groups]  # group order (the commit merges in group order anyway)
        log.info("token_cache %s: %d parts built on the cluster in %.1fs; committing", fp, len(parts),
                 time.perf_counter() - t0)
        return pipe.token_cache_commit(parts)
    finally:
        if started_here:
            ray.shutdown()
