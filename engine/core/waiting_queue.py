"""The waiting queue: by priority rank, then order in the rank, then weighted fairness across tenants (VTC),
then arrival.

A request's ``order_in_rank`` (0 unless the client asked to wait) puts it behind every waiting request of
its rank with a smaller one: among the tenants whose next request has the smallest order, VTC picks.

Virtual token counter ("Fairness in Serving Large Language Models", OSDI 2024):
each tenant's counter grows by (prompt tokens + 2 x output tokens) / weight as
it is served; within a rank, the backlogged tenant with the smallest counter
goes next. A tenant that becomes backlogged again is lifted to the smallest
counter among the other backlogged tenants, so idle time earns no credit.
Plain Python, no torch.
"""

from collections import defaultdict, deque

from engine.core.request import Request

OUTPUT_TOKEN_COST = 2.0  # an output token costs twice a prompt token (decode is the scarcer work)


class VirtualTokenCounter:
    """Per-tenant weighted service counters."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = defaultdict(float)
        self._active: dict[str, int] = defaultdict(int)  # tenant -> requests waiting or running

    def on_arrival(self, tenant: str) -> None:
        if self._active[tenant] == 0:
            others = [self.counters[t] for t, n in self._active.items() if n and t != tenant]
            if others:
                self.counters[tenant] = max(self.counters[tenant], min(others))
        self._active[tenant] += 1

    def on_departure(self, tenant: str) -> None:
        assert self._active[tenant] > 0
        self._active[tenant] -= 1
        if self._active[tenant] == 0:
            del self._active[tenant]

    def charge(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        self.counters[request.tenant] += (prompt_tokens + OUTPUT_TOKEN_COST * output_tokens) / request.weight


class _RankQueue:
    __slots__ = ("resumed", "tenants")

    def __init__(self) -> None:
        self.resumed: list[Request] = []  # preempted requests, in arrival order: they keep their place
        self.tenants: dict[str, deque[Request]] = {}

    def __len__(self) -> int:
        return len(self.resumed) + sum(len(q) for q in self.tenants.values())


class WaitingQueue:
    """Requests not running. ``peek(rank)`` gives the next one to admit in that rank."""

    def __init__(self, vtc: VirtualTokenCounter) -> None:
        self.vtc = vtc
        self._ranks: dict[int, _RankQueue] = {}
        self._len = 0
        self.num_foreground = 0  # waiting requests that are not background work

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def ranks(self) -> list[int]:
        return sorted(self._ranks)

    def count_by_rank(self) -> dict[int, int]:
        return {rank: len(q) for rank, q in sorted(self._ranks.items())}

    def add(self, request: Request) -> None:
        """A new arrival: behind earlier arrivals of its tenant with the same or a smaller order in the rank."""
        rq = self._ranks.setdefault(request.priority, _RankQueue())
        queue = rq.tenants.setdefault(request.tenant, deque())
        if queue and queue[-1].order_in_rank > request.order_in_rank:  # rare: ahead of its tenant's later orders
            i = next(i for i, r in enumerate(queue) if r.order_in_rank > request.order_in_rank)
            queue.insert(i, request)
        else:
            queue.append(request)
        self._len += 1
        self.num_foreground += not request.background

    def add_preempted(self, request: Request) -> None:
        """A preempted request: first in its rank among later arrivals (ordered by its own arrival)."""
        rq = self._ranks.setdefault(request.priority, _RankQueue())
        i = len(rq.resumed)
        while i > 0 and rq.resumed[i - 1].arrival_time > request.arrival_time:
            i -= 1
        rq.resumed.insert(i, request)
        self._len += 1
        self.num_foreground += not request.background

    def peek(self, rank: int) -> Request | None:
        rq = self._ranks.get(rank)
        if rq is None:
            return None
        if rq.resumed:
            return rq.resumed[0]
        counters = self.vtc.counters
        tenant = min(rq.tenants, key=lambda t: (rq.tenants[t][0].order_in_rank, counters[t], rq.tenants[t][0].arrival_time))
        return rq.tenants[tenant][0]

    def remove(self, request: Request) -> None:
        rq = self._ranks[request.priority]
        if request in rq.resumed:
            rq.resumed.remove(request)
        else:
            queue = rq.tenants[request.tenant]
            if queue[0] is request:
                queue.popleft()
            else:
                queue.remove(request)
            if not queue:
                del rq.tenants[request.tenant]
        if not rq.resumed and not rq.tenants:
            del self._ranks[request.priority]
        self._len -= 1
        self.num_foreground -= not request.background

    def __contains__(self, request: Request) -> bool:
        rq = self._ranks.get(request.priority)
        if rq is None:
            return False
        return request in rq.resumed or request in rq.tenants.get(request.tenant, ())

    def __iter__(self):
        for rank in self.ranks():
            rq = self._ranks[rank]
            yield from rq.resumed
            for queue in rq.tenants.values():
                yield from queue
