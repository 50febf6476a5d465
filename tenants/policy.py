"""A priority class as the gateway reads it: its rank, default weight and preemption flags (the engine's
scheduler applies them: ``engine.core.scheduler``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ClassInfo:
    name: str
    rank: int
    default_weight: float
    preemptible: bool
    may_preempt: bool

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("class name must not be empty")
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        if not self.default_weight > 0:
            raise ValueError(f"weight must be > 0, got {self.default_weight}")

