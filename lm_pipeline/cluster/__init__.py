"""Running the pipeline's work on a cluster (Ray). Optional: ``pip install 'lm-pipeline[cluster]'``.

:mod:`lm_pipeline.cluster.ray_train` trains one run as N processes of one ``jax.distributed`` job
on a Ray cluster; :mod:`lm_pipeline.cluster.ray_cache` builds the token cache as one Ray task per
shard group. Nothing here imports Ray at module import; :func:`require_ray` imports it and
fails in one line when it is missing.
"""

from __future__ import annotations

from typing import Any

INSTALL_HINT = "pip install 'lm-pipeline[cluster]'"


class ClusterError(RuntimeError):
    """A cluster setting or the cluster itself is not usable (one line, no traceback needed)."""


def require_ray(what: str = "training on Ray") -> Any:
    """The ``ray`` module, or a :class:`ClusterError` saying that ``what`` needs it and how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ClusterError(f"{what} needs the 'ray' package ({e}); {INSTALL_HINT}") from None
    return ray
