"""A priority class as the gateway reads it: its priority (lower is more urgent), default weight and preemption
flags (the gateway turns them into each request's ``engine.core.request_policy.RequestPolicy``; the engine's
scheduler applies them), and its service-level objectives (``gateway/slo_admission.py`` applies them)."""

from __future__ import annotations

from dataclasses import dataclass


SLO_ACTIONS = ("refuse", "queue")
# The part of a class's time-to-first-token objective its requests wait for room to free by itself before they
# preempt a less urgent request (``RequestPolicy.preempt_grace_ms``): at a full batch a slot frees every few
# steps, well within it, and the request that would have been preempted keeps its progress and its objectives;
# the rest of the objective is left for the prompt's own prefill.
PREEMPT_GRACE_SHARE = 0.5


@dataclass(slots=True, frozen=True)
class ClassInfo:
    name: str
    priority: int
    default_weight: float
    preemptible: bool
    may_preempt: bool
    # Objectives, milliseconds (None: none): time to first token, and a request's mean time between its tokens.
    ttft_slo_ms: int | None = None
    itl_slo_ms: int | None = None
    # A request predicted to miss its time to first token: "refuse" answers it at once (503 slo_unattainable,
    # with Retry-After); "queue" admits it to wait its turn.
    slo_action: str = "queue"

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("class name must not be empty")
        if self.priority < 0:
            raise ValueError(f"priority must be >= 0, got {self.priority}")
        if not self.default_weight > 0:
            raise ValueError(f"weight must be > 0, got {self.default_weight}")
        for name in ("ttft_slo_ms", "itl_slo_ms"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or none, got {value!r}")
        if self.slo_action not in SLO_ACTIONS:
            raise ValueError(f"slo_action must be one of {', '.join(SLO_ACTIONS)}, got {self.slo_action!r}")

    @property
    def has_objectives(self) -> bool:
        return self.ttft_slo_ms is not None or self.itl_slo_ms is not None

    @property
    def preempt_grace_ms(self) -> float | None:
        """How long its requests wait for room before they preempt (None: no time-to-first-token objective,
        they preempt at once)."""
        return None if self.ttft_slo_ms is None else PREEMPT_GRACE_SHARE * self.ttft_slo_ms

