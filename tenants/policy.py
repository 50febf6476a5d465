"""A priority class as the gateway reads it: its priority (lower is more urgent), default weight and preemption
flags (the gateway turns them into each request's ``engine.core.request_policy.RequestPolicy``; the engine's
scheduler applies them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ClassInfo:
    name: str
    priority: int
    default_weight: float
    preemptible: bool
    may_preempt: bool

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("class name must not be empty")
        if self.priority < 0:
            raise ValueError(f"priority must be >= 0, got {self.priority}")
        if not self.default_weight > 0:
            raise ValueError(f"weight must be > 0, got {self.default_weight}")

