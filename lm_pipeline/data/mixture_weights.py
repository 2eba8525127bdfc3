"""The rules for a mixture's ``train_weights``: its two shapes (a mapping, or phases ``[[step,
mapping], ...]``), how a block's rows are rounded (Levanter's way), and every check of its
values. :class:`lm_pipeline.data.config.DataConfig` reports their problems with the config's;
:mod:`lm_pipeline.data.mixture` lays blocks out by them.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Any

from lm_pipeline.data.config import MAX_MIXTURE_BLOCK_SIZE

Phases = list[tuple[int, dict[str, float]]]



def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _weights(mapping: Mapping, where: str) -> tuple[dict[str, float], list[tuple[str, str]]]:
    out, problems = {}, []
    for name, w in mapping.items():
        if not isinstance(name, str):
            problems.append((f"{where}.{name}", f"component names are strings, got {name!r}"))
            continue
        try:
            if isinstance(w, bool):
                raise ValueError
            out[name] = float(w)
        except (TypeError, ValueError):
            problems.append((f"{where}.{name}", f"a weight is a number, got {_short(w)}"))
    return out, problems


def weight_phases(train_weights: Any) -> tuple[Phases, list[tuple[str, str]]]:
    """``train_weights`` as phases ``[(step, {component: weight}), ...]`` (a mapping is one phase
    from step 0), and a (field, problem) for each part of neither shape (fields relative to the
    data section). The values are checked by :func:`schedule_problems`."""
    if isinstance(train_weights, Mapping):
        weights, problems = _weights(train_weights, "train_weights")
        return [(0, weights)], problems
    if not isinstance(train_weights, (list, tuple)):
        return [], [("train_weights", "expected {component: weight, ...} or phases [[step, {component: weight, "
                     f"...}}], ...], got {_short(train_weights)}")]
    phases: Phases = []
    problems: list[tuple[str, str]] = []
    for i, phase in enumerate(train_weights):
        where = f"train_weights[{i}]"
        if not isinstance(phase, (list, tuple)) or len(phase) != 2:
            problems.append((where, f"a phase is [step, {{component: weight, ...}}], got {_short(phase)}"))
            continue
        step, mapping = phase
        integral = isinstance(step, int) or (isinstance(step, float) and step.is_integer())
        if isinstance(step, bool) or not integral:
            problems.append((f"{where}[0]", f"a phase's step is an integer, got {_short(step)}"))
        if not isinstance(mapping, Mapping):
            problems.append((f"{where}[1]", f"a phase's weights are a mapping {{component: weight, ...}}, got {_short(mapping)}"))
            continue
        weights, bad = _weights(mapping, f"{where}[1]")
        problems += bad
        if integral and not isinstance(step, bool):
            phases.append((int(step), weights))
    return phases, problems


def block_counts(weights: Mapping[str, float], names: Sequence[str], size: int) -> list[int]:
    """Rows of each of ``names`` in a block of ``size`` rows, as Levanter rounds them: ``int(w /
    total * size)`` (``total``: the sum of ``weights``), and the rows left over to the component
    with the most rows among those of positive weight (the first of ``names`` on a tie)."""
    total = sum(weights.values())
    counts = [int(weights[n] / total * size) if weights.get(n, 0.0) > 0 else 0 for n in names]
    positive = [i for i, n in enumerate(names) if weights.get(n, 0.0) > 0]
    largest = max(positive, key=counts.__getitem__)
    counts[largest] += size - sum(counts)
    return counts


def schedule_problems(train_weights: Any, names: Sequence[str], block_size: int) -> list[tuple[str, str]]:
    """(field, problem) for everything wrong with ``train_weights`` over components ``names``:
    its shape, phase steps that do not start at 0 or do not increase, weights that are negative
    or not finite, names that are no component, a phase without a positive weight, and a
    positive weight that rounds to no row of a block."""
    phases, problems = weight_phases(train_weights)
    if problems:
        return problems
    mapping = isinstance(train_weights, Mapping)
    previous = None
    for i, (step, weights) in enumerate(phases):
        where = "train_weights" if mapping else f"train_weights[{i}][1]"
        if not mapping:
            if i == 0 and step != 0:
                problems.append((f"train_weights[{i}][0]", f"the first phase starts at step 0, got {step}"))
            elif previous is not None and step <= previous:
                problems.append((f"train_weights[{i}][0]", f"phase steps must increase: step {step} follows step {previous}"))
            previous = step
        valid = True
        for name, w in weights.items():
            if name not in names:
                hint = difflib.get_close_matches(name, list(names), n=1)
                problems.append((f"{where}.{name}", f"no component named {name!r} in configs"
                                 f"{f' (did you mean {hint[0]!r}?)' if hint else ''}; components: {', '.join(names)}"))
                valid = False
            if not math.isfinite(w) or w < 0:
                problems.append((f"{where}.{name}", f"a weight must be a finite number >= 0, got {w}"))
                valid = False
        if not any(w > 0 and math.isfinite(w) for w in weights.values()):
            problems.append((where, "needs at least one positive weight"))
        elif valid and not math.isfinite(sum(weights.values())):
            problems.append((where, "the weights add up to more than a number holds; scale them down"))
        elif valid and 1 <= block_size <= MAX_MIXTURE_BLOCK_SIZE:
            counts = dict(zip(names, block_counts(weights, names, block_size), strict=True))
            total = sum(weights.values())
            for name, w in weights.items():
                if w > 0 and counts[name] == 0:
                    need = math.ceil(total / w) if math.isfinite(total / w) else MAX_MIXTURE_BLOCK_SIZE + 1
                    while need <= MAX_MIXTURE_BLOCK_SIZE and int(w / total * need) < 1:
                        need += 1
                    fix = (f"raise mixture_block_size to at least {need}, or the weight" if need <= MAX_MIXTURE_BLOCK_SIZE
                           else "raise the weight")
                    problems.append((f"{where}.{name}", f"weight {w:g} of {total:g} is no row of a block of "
                                     f"{block_size} (mixture_block_size): the component would never be drawn; {fix}"))
    return problems
