"""The waiting queue: by priority class (``Request.priority``: its policy's, or promoted for having starved),
then order in the class, then weighted fairness across tenants (VTC), then arrival.

A request's ``order_in_class`` (0 unless the client asked to wait) puts it behind every waiting request of
its class with a smaller one: among the tenants whose next request has the smallest order, VTC picks.

Virtual token counter ("Fairness in Serving Large Language Models", OSDI 2024):
each tenant's counter grows by (prompt tokens + 2 x output tokens) / weight as
it is served; within a class, the backlogged tenant with the smallest counter
goes next. A tenant that becomes backlogged again is lifted to the smallest
counter among the other backlogged tenants, so idle time earns no credit.
Plain Python, no torch.
"""

from collections import defaultdict, deque

from engine.core.request import Request

OUTPUT_TOKEN_COST = 2.0  # an output token costs twice a prompt token (decode is the scarcer work)


class TenantCounters:
    """Per-tenant weighted service counters, a tenant lifted on arrival to the smallest counter among the other
    active tenants (idle time earns no credit); what counts as service is the subclass's ``charge``."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = defaultdict(float)
        self._active: dict[str, int] = defaultdict(int)  # tenant -> its requests waiting or being served

    def on_arrival(self, tenant: str) -> None:
        if self._active[tenant] == 0:
            others = [self.counters[t] for t, n in self._active.items() if n and t != tenant]
            if others:
                self.counters[tenant] = max(self.counters[tenant], min(others))
        self._active[tenant] += 1

    def on_departure(self, tenant: str) -> None:
        self._active[tenant] -= 1
        if self._active[tenant] == 0:
            del self._active[tenant]


class VirtualTokenCounter(TenantCounters):
    """Per-tenant weighted service counters of one engine: requests waiting or running."""

    def on_departure(self, tenant: str) -> None:
        assert self._active[tenant] > 0
        super().on_departure(tenant)

    def charge(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        self.counters[request.policy.tenant] += (prompt_tokens + OUTPUT_TOKEN_COST * output_tokens) / request.policy.weight


class _ClassQueue:
    __slots__ = ("resumed", "tenants")

    def __init__(self) -> None:
        self.resumed: list[Request] = []  # preempted requests, in arrival order: they keep their place
        self.tenants: dict[str, deque[Request]] = {}

    def __len__(self) -> int:
        return len(self.resumed) + sum(len(q) for q in self.tenants.values())


class WaitingQueue:
    """Requests not running. ``peek(priority)`` gives the next one to admit from that priority class."""

    def __init__(self, vtc: VirtualTokenCounter) -> None:
        self.vtc = vtc
        self._classes: dict[int, _ClassQueue] = {}
        self._len = 0
        self.num_foreground = 0  # waiting requests that are not background work

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def priorities(self) -> list[int]:
        return sorted(self._classes)

    def count_by_priority(self) -> dict[int, int]:
        return {priority: len(q) for priority, q in sorted(self._classes.items())}

    def add(self, request: Request) -> None:
        """A new arrival: behind earlier arrivals of its tenant with the same or a smaller order in the class."""
        rq = self._classes.setdefault(request.priority, _ClassQueue())
        queue = rq.tenants.setdefault(request.policy.tenant, deque())
        if queue and queue[-1].policy.order_in_class > request.policy.order_in_class:  # rare: ahead of its tenant's later orders
            i = next(i for i, r in enumerate(queue) if r.policy.order_in_class > request.policy.order_in_class)
            queue.insert(i, request)
        else:
            queue.append(request)
        self._len += 1
        self.num_foreground += not request.policy.background

    def add_preempted(self, request: Request) -> None:
        """A preempted request: first in its class among later arrivals (ordered by its own arrival)."""
        rq = self._classes.setdefault(request.priority, _ClassQueue())
        i = len(rq.resumed)
        while i > 0 and rq.resumed[i - 1].arrival_time > request.arrival_time:
            i -= 1
        rq.resumed.insert(i, request)
        self._len += 1
        self.num_foreground += not request.policy.background

    def peek(self, priority: int, passed: frozenset[str] | set[str] = frozenset()) -> Request | None:
        """The next request to admit from ``priority``'s class, passing over the request ids in ``passed`` (not
        ready this step, e.g. their cached blocks are still being read from disk): the requests behind them go
        first, and they keep their places for the next step."""
        rq = self._classes.get(priority)
        if rq is None:
            return None
        for request in rq.resumed:
            if request.request_id not in passed:
                return request
        counters = self.vtc.counters
        heads = {}
        for tenant, queue in rq.tenants.items():
            head = next((r for r in queue if r.request_id not in passed), None)
            if head is not None:
                heads[tenant] = head
        if not heads:
            return None
        tenant = min(heads, key=lambda t: (heads[t].policy.order_in_class, counters[t], heads[t].arrival_time))
        return heads[tenant]

    def remove(self, request: Request) -> None:
        rq = self._classes[request.priority]
        if request in rq.resumed:
            rq.resumed.remove(request)
        else:
            queue = rq.tenants[request.policy.tenant]
            if queue[0] is request:
                queue.popleft()
            else:
                queue.remove(request)
            if not queue:
                del rq.tenants[request.policy.tenant]
        if not rq.resumed and not rq.tenants:
            del self._classes[request.priority]
        self._len -= 1
        self.num_foreground -= not request.policy.background

    def __contains__(self, request: Request) -> bool:
        rq = self._classes.get(request.priority)
        if rq is None:
            return False
        return request in rq.resumed or request in rq.tenants.get(request.policy.tenant, ())

    def __iter__(self):
        for priority in self.priorities():
            rq = self._classes[priority]
            yield from rq.resumed
            for queue in rq.tenants.values():
                yield from queue
