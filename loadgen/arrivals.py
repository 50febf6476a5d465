"""Arrival processes: when each request of a tenant is sent, as offsets in seconds from the run's start.

Processes (``ArrivalConfig.process``):

- ``poisson``: exponential gaps at ``rate`` requests/s.
- ``gamma``: gamma gaps with mean ``1/rate`` and shape ``burstiness``
  (1 is Poisson; below 1 is burstier, above 1 is smoother), as vLLM's bench does.
- ``constant``: one request every ``1/rate`` seconds.
- ``concurrency``: no schedule; ``concurrency`` workers each send the next
  request as soon as their last one ends (the runner handles it).
- ``throughput``: every request at time 0 (``rate = inf``), to find the
  saturation rate.

A ramp (``ramp_to`` and ``ramp_s``) moves the rate linearly from ``rate`` to
``ramp_to`` over ``ramp_s`` seconds, then holds it. Ramps warp time: gaps are
drawn for a unit-rate process and mapped through the inverse of the
cumulative rate, so a ramped Poisson process is still Poisson at each instant.
"""

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

PROCESSES = ("poisson", "gamma", "constant", "concurrency", "throughput")


@dataclass(slots=True)
class ArrivalConfig:
    """How one tenant's requests arrive. ``rate`` is in requests per second."""

    process: str = "poisson"
    rate: float | None = None
    burstiness: float = 1.0
    concurrency: int | None = None
    ramp_to: float | None = None
    ramp_s: float | None = None

    def __post_init__(self) -> None:
        if self.process not in PROCESSES:
            raise ValueError(f"arrival process must be one of {PROCESSES}, got {self.process!r}")
        if self.process == "concurrency":
            if self.concurrency is None or self.concurrency < 1:
                raise ValueError("the concurrency process needs concurrency >= 1")
        elif self.process != "throughput":
            if self.rate is None or not self.rate > 0 or math.isinf(self.rate):
                raise ValueError(f"the {self.process} process needs a finite rate > 0 (requests/s), got {self.rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if (self.ramp_to is None) != (self.ramp_s is None):
            raise ValueError("a ramp needs both ramp_to (requests/s) and ramp_s (seconds)")
        if self.ramp_to is not None:
            if self.process not in ("poisson", "gamma", "constant"):
                raise ValueError("ramps apply to the poisson, gamma and constant processes")
            if not self.ramp_to > 0 or not self.ramp_s > 0:
                raise ValueError("ramp_to and ramp_s must be > 0")

    @property
    def scheduled(self) -> bool:
        """True when requests follow a timetable (False for the closed-loop concurrency process)."""
        return self.process != "concurrency"

    def describe(self) -> str:
        if self.process == "concurrency":
            return f"concurrency {self.concurrency}"
        if self.process == "throughput":
            return "all at once (throughput)"
        text = f"{self.process} {self.rate:g} req/s"
        if self.process == "gamma":
            text += f" (burstiness {self.burstiness:g})"
        if self.ramp_to is not None:
            text += f", ramp to {self.ramp_to:g} req/s over {self.ramp_s:g} s"
        return text


def _unit_gaps(config: ArrivalConfig, rng: random.Random) -> Iterator[float]:
    """Gaps of the process run at rate 1 (mean gap 1)."""
    while True:
        if config.process == "poisson":
            yield rng.expovariate(1.0)
        elif config.process == "gamma":
            # shape k, scale 1/k: mean 1, squared coefficient of variation 1/k.
            yield rng.gammavariate(config.burstiness, 1.0 / config.burstiness)
        else:
            yield 1.0


def _warp(config: ArrivalConfig, u: float) -> float:
    """Wall time at which the cumulative expected count reaches ``u`` (inverse of the integrated rate)."""
    r0 = config.rate
    if config.ramp_to is None:
        return u / r0
    r1, T = config.ramp_to, config.ramp_s
    ramp_area = (r0 + r1) / 2 * T
    if u >= ramp_area:
        return T + (u - ramp_area) / r1
    slope = (r1 - r0) / T
    if abs(slope) < 1e-12:
        return u / r0
    # Solve r0 t + slope t^2 / 2 = u for the root in [0, T].
    return (-r0 + math.sqrt(r0 * r0 + 2 * slope * u)) / slope


def arrival_times(config: ArrivalConfig, seed: int, limit: int | None = None, duration_s: float | None = None) -> Iterator[float]:
    """Send offsets (seconds from the start, non-decreasing) until ``limit`` requests or ``duration_s`` seconds.

    Deterministic for a given ``seed``. At least one of ``limit`` and
    ``duration_s`` must be set (the throughput process needs ``limit``).
    """
    if not config.scheduled:
        raise ValueError("the concurrency process has no timetable")
    if limit is None and (duration_s is None or config.process == "throughput"):
        raise ValueError("arrivals need a request count (and the throughput process always does)")
    rng = random.Random(seed)
    gaps = _unit_gaps(config, rng)
    u = 0.0
    count = 0
    while limit is None or count < limit:
        if config.process == "throughput":
            t = 0.0
        else:
            # Constant arrivals start at 0; random ones start after their first gap, as a process does.
            if count > 0 or config.process != "constant":
                u += next(gaps)
            t = _warp(config, u)
        if duration_s is not None and t >= duration_s:
            return
        yield t
        count += 1
