"""Train steps whose loss and gradients are non-finite, made from the test side: nothing in the
product knows of them.

The production train step (the one compiled program) is given, for the chosen 1-based steps, the
state with its token embeddings set to NaN, so that its loss and every gradient are NaN; afterwards
only that one array is put back as it was. Everything else is the product's own doing: with
``optimizer.skip_bad_steps`` the other parameters and the optimizer's moments must come back
unchanged (and the skip counted); without it they come back NaN and the run must stop before a
checkpoint. A step that ignored the skip could not hide behind the restored array: every other
parameter would be NaN.

In a test: ``monkeypatch.setattr(run, "build_step_functions", poisoning(run.build_step_functions,
{5, 6}))``. For a child process: ``python -m helpers.nonfinite 3,4 train --config_path ...`` runs
the command line with the same wrapping (``tests/`` on ``PYTHONPATH``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Collection
from typing import Any

import equinox as eqx


def _embeddings(state: Any) -> Any:
    return state.model.token_embeddings


def poisoned_step(train_step: Callable, steps: Collection[int]) -> Callable:
    """``train_step`` with the 1-based ``steps`` run on NaN token embeddings (see the module)."""
    steps = frozenset(int(s) for s in steps)

    def step(state, tokens, segments):
        if int(state.step) + 1 not in steps:
            return train_step(state, tokens, segments)
        original = _embeddings(state)
        out, metrics = train_step(eqx.tree_at(_embeddings, state, original * float("nan")), tokens, segments)
        return eqx.tree_at(_embeddings, out, original), metrics

    return step


def poisoning(build_step_functions: Callable, steps: Collection[int]) -> Callable:
    """``build_step_functions`` whose result's ``train_step`` is :func:`poisoned_step`."""

    def build(*args, **kwargs):
        fns = build_step_functions(*args, **kwargs)
        return dataclasses.replace(fns, train_step=poisoned_step(fns.train_step, steps))

    return build


def main(argv: list[str]) -> int:
    """``STEPS COMMAND ARGS...``: ``lm-pipeline COMMAND ARGS...`` with the comma-separated 1-based
    ``STEPS`` non-finite."""
    from lm_pipeline.cli import main as cli_main
    from lm_pipeline.train import run

    steps = {int(s) for s in argv[0].split(",") if s.strip()}
    run.build_step_functions = poisoning(run.build_step_functions, steps)
    return cli_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
