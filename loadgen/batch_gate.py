"""Static and dynamic batching as admission gates in front of a continuous-batching engine.

The engine's scheduler batches continuously: a request joins the running batch at
the next step. The two older strategies are kept only to compare against it
(``moegate loadgen compare-batching``), so they live here, in front of the
engine, not inside its scheduler:

- ``static``: hold arrivals until ``batch_size`` wait (or no more will come),
  hand exactly that batch to the engine, and admit nothing else until every
  member has finished.
- ``dynamic``: the same, but a batch also starts ``max_wait_s`` after its oldest
  member arrived, however few have come.
- ``continuous``: no gate; every arrival goes straight to the engine.
"""

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

STRATEGIES = ("static", "dynamic", "continuous")


@dataclass(slots=True)
class _Pending:
    prompt: list[int]
    params: object  # engine.SamplingParams
    request_id: str
    arrived: float


class BatchGate:
    """Admits requests into ``engine`` (an ``LLMEngine``) one whole batch at a time.

    ``submit`` queues an arrival; ``close`` says nothing more will arrive, so a
    partial batch may start; ``step`` admits the next batch when it is due and
    the previous one has finished, then steps the engine.
    """

    def __init__(self, engine, strategy: str, batch_size: int, max_wait_s: float = 0.05,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if batch_size < 1 or max_wait_s < 0:
            raise ValueError(f"batch_size must be >= 1 and max_wait_s >= 0, got {batch_size} and {max_wait_s}")
        self.engine = engine
        self.strategy = strategy
        self.batch_size = batch_size
        self.max_wait_s = max_wait_s
        self.clock = clock
        self.closed = False
        self._pending: deque[_Pending] = deque()

    def submit(self, prompt: list[int], params, request_id: str) -> None:
        if self.strategy == "continuous":
            self.engine.add_request(prompt, params, request_id=request_id)
        else:
            self._pending.append(_Pending(prompt, params, request_id, self.clock()))

    def close(self) -> None:
        """No more arrivals: a partial batch may start."""
        self.closed = True

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.engine.has_unfinished()

    def _batch_due(self) -> bool:
        if not self._pending or self.engine.has_unfinished():
            return False  # nothing to start, or the batch in flight has not finished
        waited = self.clock() - self._pending[0].arrived
        return (len(self._pending) >= self.batch_size or self.closed
                or (self.strategy == "dynamic" and waited >= self.max_wait_s))

    def step(self) -> list:
        """Admit the next batch if due, then run one engine step; returns the step's outputs (maybe none)."""
        if self._batch_due():
            for _ in range(min(self.batch_size, len(self._pending))):
                p = self._pending.popleft()
                self.engine.add_request(p.prompt, p.params, request_id=p.request_id)
        return self.engine.step() if self.engine.has_unfinished() else []
