"""When to save and what to keep: :class:`CheckpointerConfig`, its keep rules, duration strings.

Keep policy (Levanter's): a step ``N >= 1`` is saved as *permanent* if the first ``keep`` rule
whose ``until`` is null or ``>= N`` has ``N % every == 0``; otherwise a *temporary* checkpoint is
saved once ``save_interval`` wall time has passed since the last save. A temporary checkpoint is
deleted after a newer checkpoint is complete. ``force=True`` (end of training) saves a permanent
one. ``keep_last=K`` keeps only the K permanent checkpoints with the largest steps. LLM-Trainer's
``save_steps: N`` means ``keep: [{every: N}]`` and its ``save_total_limit`` is ``keep_last``. With
``keep_best``, an eval loss lower than any before forces a save at that step and ``best/`` becomes a
self-contained copy of it. Deletion is in :mod:`.retention`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from lm_pipeline.schema import ConfigError, field

__all__ = ["CheckpointerConfig", "KeepPolicy", "parse_duration"]

_DURATION_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd])\s*")
_UNIT_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds in a duration string: a number with a unit s/m/h/d, or several ('1h30m').

    Raises ValueError for anything else (including non-positive durations).
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"invalid duration {text!r}")
    pos, total = 0, 0.0
    for m in _DURATION_RE.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
        pos = m.end()
    if pos != len(text):
        raise ValueError(
            f"invalid duration {text!r}: expected a number followed by a unit s, m, h or d "
            "(e.g. '90s', '15m', '1h30m', '2d')"
        )
    if total <= 0:
        raise ValueError(f"invalid duration {text!r}: must be greater than zero")
    return total


@dataclass(frozen=True)
class KeepPolicy:
    """One rule of the permanent-checkpoint policy: every `every` steps, up to step `until`."""

    every: int = field(help="Save a permanent checkpoint when step % every == 0.", semantic=False)
    until: int | None = field(
        None, help="Last step (inclusive) this rule applies to; null = all later steps.", semantic=False
    )

    def validate(self) -> None:
        if self.every < 1:
            raise ConfigError("every", "must be >= 1")
        if self.until is not None and self.until < 1:
            raise ConfigError("until", "must be >= 1 or null")


def _default_keep() -> tuple[KeepPolicy, ...]:
    return (KeepPolicy(every=10000),)


@dataclass(frozen=True)
class CheckpointerConfig:
    """Where and when train-state checkpoints are written, and which ones are kept."""

    base_path: str | None = field(
        None,
        help="Directory or URL (gs://, s3://, ...) holding runs; a run's step-<N>/ dirs go to <base_path>/<run id>. "
        "null = the run's address in the artifact store (<store.root>/train_ckpt/<fingerprint>).",
        semantic=False,
    )
    save_interval: str = field(
        "15m",
        help="Wall time between temporary checkpoints: a number with unit s/m/h/d ('90s', '15m', '1h30m').",
        semantic=False,
    )
    keep: tuple[KeepPolicy, ...] = field(
        default_factory=_default_keep,
        help="Permanent checkpoints: rules {every, until}, applied in order; the first rule whose until "
        "is null or >= step decides.",
        semantic=False,
    )
    keep_last: int | None = field(
        None,
        help="Keep only the last K permanent checkpoints (by step); null keeps all of them.",
        semantic=False,
        aliases=("save_total_limit",),
    )
    keep_best: bool = field(
        False,
        help="Keep a copy best/ of the checkpoint with the lowest eval loss; an improving eval forces a save. "
        "Defaults to true when the trainer section uses LLM-Trainer's keys (save_steps, eval_steps, checkpoint_dir, "
        "...), as LLM-Trainer keeps its best model.",
        semantic=False,
    )

    @classmethod
    def normalize_raw(cls, data: dict[str, Any]) -> dict[str, Any]:
        """LLM-Trainer's ``save_steps: N`` is the keep rule ``keep: [{every: N}]`` (a permanent
        checkpoint every N steps; its ``save_total_limit`` is ``keep_last``, an alias)."""
        if "save_steps" in data:
            every = data.pop("save_steps")
            if "keep" in data:
                raise ConfigError("save_steps", "given together with keep; keep one (save_steps: N is keep: [{every: N}])")
            data["keep"] = [{"every": every}]
        return data

    def validate(self) -> None:
        try:
            parse_duration(self.save_interval)
        except ValueError as e:
            raise ConfigError("save_interval", str(e)) from None
        previous: int | None = None
        for i, rule in enumerate(self.keep):
            if rule.until is None and i != len(self.keep) - 1:
                raise ConfigError(f"keep[{i}].until", "only the last keep rule may have no 'until'")
            if rule.until is not None and previous is not None and rule.until <= previous:
                raise ConfigError(f"keep[{i}].until", f"must be greater than the previous rule's until ({previous})")
            previous = rule.until
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError("keep_last", "must be >= 1 or null (keep all permanent checkpoints)")

    @property
    def save_interval_seconds(self) -> float:
        """``save_interval`` in seconds."""
        return parse_duration(self.save_interval)

    def is_permanent_step(self, step: int) -> bool:
        """Whether the keep policy asks for a permanent checkpoint at ``step`` (never at step 0)."""
        if step < 1:
            return False
        for rule in self.keep:
            if rule.until is None or step <= rule.until:
                return step % rule.every == 0
        return False
