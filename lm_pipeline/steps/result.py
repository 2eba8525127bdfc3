"""What a stage hands back: :class:`StageResult` (its address, hit or built, its manifest)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class StageResult:
    """What a stage produced: its address, whether it was a cache hit, and its manifest;
    ``seconds`` of wall time this call took."""

    stage: str
    fingerprint: str
    path: str
    hit: bool
    manifest: dict[str, Any]
    seconds: float = 0.0

    @property
    def summary(self) -> dict[str, Any]:
        return {"stage": self.stage, "fingerprint": self.fingerprint, "seconds": round(self.seconds, 3),
                **self.manifest.get("summary", {})}


@dataclass(frozen=True)
class Address:
    """A stage's fingerprint and what went into it: its semantic config and its inputs."""

    stage: str
    fingerprint: str
    config: Any
    inputs: dict[str, Any]
    code_version: int
