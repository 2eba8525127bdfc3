"""Dagster software-defined assets of the pipeline (see :mod:`assets.pipeline`).

``assets.definitions`` is the code location (it loads the experiment named by the environment);
``python -m assets`` runs the Dagster CLI against it with a persistent local instance.
"""
