"""What the engine process sends the gateway after a step, and what may wait to share a later message.

Every message wakes two of the gateway's threads (the pipe reader, then the event
loop). Where the gateway shares the engine's cores, each wakeup takes a core from
a step's parallel region part-way through, and the engine's other threads wait
at the region's barrier for it: on 2 cores a 2,000-line batch of 16-token lines
woke the gateway about 4,000 times in 13 s and the engine was preempted 2.5x as
often as the offline engine on the same work (docs/performance.md, Batch API
goal 2). So the engine sends only what someone is waiting for:

- a streaming request's output every step; a ``stream=False`` ("quiet") request
  one output when it finishes, with its whole generation;
- a quiet *background* request's final delta (a Batch API line: nobody watches
  it finish) waits up to ``interval_s`` to share a message with others, unless
  nothing is left waiting in the engine (the batch runner refills the engine
  from the lines it hears have finished, so it must hear before the engine runs
  dry) or the engine falls idle;
- statistics with no delta go out when the set of priority classes that have
  requests waiting changes (the batch runner claims lines only while no live
  request waits), when the engine falls idle, and at least every ``interval_s``
  (the gateway's metrics).

Anything pending goes out with any message that is sent.
"""

import time

from engine.core.outputs import RequestOutput
from engine.core.stats import SchedulerStats
from engine.serving.protocol import StepOutputs


class StepReports:
    def __init__(self, interval_s: float = 0.05, clock=time.monotonic) -> None:
        self.interval_s, self.clock = interval_s, clock
        self.quiet: dict[str, int] = {}  # requests that want only their final outputs -> choices not finished
        self._so_far: dict[tuple[str, int], RequestOutput] = {}  # (request, choice index) -> output so far
        self.deferrable: set[str] = set()  # quiet and background: that output may wait up to interval_s
        self._pending: list[RequestOutput] = []  # final outputs of deferrable requests, not yet sent
        self._last_at = float("-inf")
        self._last_waiting_priorities: frozenset[int] | None = None

    def add(self, request_id: str, stream: bool, background: bool, n: int = 1) -> None:
        """``n``: the request's choices (each sends its own final output)."""
        if not stream:
            self.quiet[request_id] = n
            if background:
                self.deferrable.add(request_id)

    def forget(self, request_id: str) -> None:
        """An aborted request: nothing more is sent for it (its caller is gone)."""
        if self.quiet.pop(request_id, None) is not None:
            self._so_far = {k: v for k, v in self._so_far.items() if k[0] != request_id}
        self.deferrable.discard(request_id)
        self._pending = [o for o in self._pending if o.request_id != request_id]

    def after_step(self, outputs: list[RequestOutput], stats: SchedulerStats | None, busy: bool) -> StepOutputs | None:
        """The message to send after this step (``busy``: the engine still has unfinished work), or None."""
        urgent = self._collect(outputs)
        waiting_priorities = frozenset(r for r, n in stats.num_waiting_by_priority.items() if n) if stats is not None else None
        due = (bool(urgent) or not busy
               or (stats is not None and waiting_priorities != self._last_waiting_priorities)
               or (self._pending and not waiting_priorities)
               or ((stats is not None or self._pending) and self.clock() - self._last_at >= self.interval_s))
        if not due:
            return None
        outputs, self._pending = urgent + self._pending, []
        if stats is None and not outputs:
            return None
        self._last_at = self.clock()
        if stats is not None:
            self._last_waiting_priorities = waiting_priorities
        return StepOutputs(outputs, stats)

    def _collect(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """This step's outputs to send now; a quiet request's are merged until it finishes, and the final
        output of a deferrable one goes to ``_pending``."""
        urgent = []
        for o in outputs:
            if o.request_id not in self.quiet:
                urgent.append(o)
                continue
            key = (o.request_id, o.index)
            so_far = self._so_far.pop(key, None)
            whole = o if so_far is None else so_far.merge(o)
            if not o.finished:
                self._so_far[key] = whole
                continue
            self.quiet[o.request_id] -= 1
            last = self.quiet[o.request_id] == 0
            if last:
                del self.quiet[o.request_id]
            if o.request_id in self.deferrable:
                if last:
                    self.deferrable.discard(o.request_id)
                self._pending.append(whole)
            else:
                urgent.append(whole)
        return urgent
