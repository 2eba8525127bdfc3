"""Dagster software-defined assets of the pipeline (see :mod:`assets.pipeline`).

``assets.definitions`` is the code location (every experiment of ``configs/experiments/``);
``python -m assets`` runs the Dagster CLI against it with a persistent local instance.
"""
