"""Tenant weights across the fleet: one weighted-fair queue in the gateway in front of every replica (no I/O).

Each engine's scheduler shares its own capacity by tenant weight (``engine.core.waiting_queue``), but it sees only
the requests sent to it: where cache affinity keeps tenant A on one replica and tenant B on another, each replica
serves its one tenant whole and the weights mean nothing. So the gateway keeps the fleet's counters and makes the
choice itself, before any replica queues a request:

- **Counters.** Per tenant, the virtual token counter of the engines' scheduler (VTC, "Fairness in Serving Large
  Language Models", OSDI 2024), over every replica: (prompt tokens computed + ``OUTPUT_TOKEN_COST`` x output
  tokens) / weight, read from the outputs the gateway relays. A request is charged what it may cost when it is
  dispatched (its prompt, less what ``place`` expects the chosen replica to hold cached, and ``max_tokens`` of
  output, at most ``EXPECTED_OUTPUT_CAP``), and settled to what it really cost as its outputs come: at the first, to the prompt
  tokens its engine computed (``num_prompt_tokens - num_cached_tokens``); output past the estimate as it streams;
  at its end the unused rest of the estimate is refunded. Charging up front matters: slots free in bursts (requests
  of one length end in the same step), and a burst dispatched on counters that do not yet show the requests just
  sent would go whole to one tenant. Whichever engine computed the tokens (any replica, the prefill engine of a
  disaggregated pair) the tenant's one counter grows. A tenant that becomes backlogged again is lifted to the
  smallest counter among the other active tenants, so idle time earns no credit.
- **Dispatch.** A request goes to a replica only when one has room for it (``place``, the router's: a free slot
  under its ``max_num_seqs``, or, for a request that may preempt, a preemptible request of a less urgent class
  running there that its scheduler will preempt). Until then it waits here, in its tenant's queue. Whenever room
  appears (a request ended, a replica joined) the next request is, as in the engine's waiting queue: the most urgent
  class first, then the smallest ``order_in_class``, then the tenant with the smallest counter, then arrival. While
  a more urgent request waits for room no less urgent one is placed: it never takes the slot the urgent one waits
  for. A request that has waited here ``starvation_bound_s`` (the engines' own bound) goes ahead of every class,
  oldest first, as the engines promote a starved request: steady urgent traffic cannot hold it here forever.
- **Affinity yields.** ``place`` picks, among the replicas with room, by the router's usual policy (prefix-cache
  affinity, then load): a tenant whose cached replica is full runs on another that has room rather than waiting
  for its own while it is owed service. Where the cached replica has room, affinity holds as before.

Engines then never hold a queue of their own (apart from a preempted request), so the order in which the fleet
serves tenants is this queue's. The cost: a freed slot waits for the gateway to send the next request (one pipe
round trip, about one engine step) instead of the engine starting its next queued request within the same step.
"""

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from engine.core.outputs import RequestOutput
from engine.core.request_policy import RequestPolicy
from engine.core.waiting_queue import OUTPUT_TOKEN_COST, TenantCounters

P = TypeVar("P")  # where a dispatched request goes (a replica's index, an engine)

# Output tokens charged up front for a request without max_tokens (or a larger one): a guess that is settled
# anyway, and a cap keeps one long request's estimate from holding its tenant back for minutes before it has run.
EXPECTED_OUTPUT_CAP = 1024


class FleetCounters(TenantCounters):
    """Per-tenant weighted service counters over the whole fleet (the engines' VTC, summed over replicas): a
    tenant is active while it has requests waiting here or in flight."""

    def charge(self, policy: RequestPolicy, tokens: float) -> None:
        """``tokens`` of service (prompt tokens computed + OUTPUT_TOKEN_COST x output tokens; negative: a refund)."""
        self.counters[policy.tenant] += tokens / policy.weight


class Ticket(Generic[P]):
    """One request's place in the fair queue, then its charges while it runs."""

    __slots__ = ("policy", "prompt_tokens", "expected_output", "payload", "seq", "arrived", "placed",
                 "_prompt_charged", "_started", "_output", "_reserved")

    def __init__(self, policy: RequestPolicy, prompt_tokens: int, expected_output: int, payload: object,
                 seq: int, arrived: float) -> None:
        self.policy = policy
        self.prompt_tokens = prompt_tokens  # charged at dispatch (``place`` may lower it: tokens it expects cached)
        self.expected_output = expected_output  # output tokens charged up front
        self.payload = payload  # what ``place`` needs of the request (the router's: its placement)
        self.seq = seq  # arrival order
        self.arrived = arrived  # when it came (the gate's clock)
        self.placed: asyncio.Future[P] = asyncio.get_running_loop().create_future()
        self._prompt_charged = 0.0  # prompt tokens charged so far (the whole prompt, then what was computed)
        self._started = False
        self._output = 0  # output tokens relayed
        self._reserved = 0.0  # service charged up front for output not yet relayed

class FairGate(Generic[P]):
    """The fleet's weighted-fair queue (see the module docstring).

    ``place(ticket)`` tries to place one request now: where it goes (counted there from now on), or None if no
    replica has room for it (it may raise, e.g. ``EngineError`` when no replica is up: the waiting request gets that
    error). ``unplace(ticket, where)`` takes back a placement whose caller was cancelled as it was made. The owner calls
    ``pump`` whenever room may have appeared (a request ended, a replica joined), ``charge`` with every output it
    relays, and ``leave`` when a request ends.
    """

    def __init__(self, place: Callable[[Ticket[P]], P | None], unplace: Callable[[Ticket[P], P], None],
                 starvation_bound_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.place = place
        self.unplace = unplace
        self.starvation_bound_s = starvation_bound_s  # None: strict classes
        self.clock = clock
        self.counters = FleetCounters()
        self._classes: dict[int, dict[str, deque[Ticket[P]]]] = {}  # priority -> tenant -> waiting, in order
        self._seq = itertools.count()
        self.dispatched = 0  # requests placed, ever
        self.held = 0  # of those, the ones that had to wait here for room

    def __len__(self) -> int:
        return sum(len(q) for tenants in self._classes.values() for q in tenants.values())

    def waiting_by_tenant(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for tenants in self._classes.values():
            for tenant, q in tenants.items():
                out[tenant] = out.get(tenant, 0) + len(q)
        return out

    async def enter(self, policy: RequestPolicy, prompt_tokens: int, max_output: int | None,
                    payload: object = None) -> tuple[Ticket[P], P]:
        """Wait for this request's turn and room; (its ticket, where ``place`` put it). ``max_output``: the most
        output tokens it may produce over all its choices (None: unbounded). Without a queue and with room it
        returns at once. Cancelled or failed while waiting, it leaves the queue and counts nowhere."""
        expected = EXPECTED_OUTPUT_CAP if max_output is None else min(max_output, EXPECTED_OUTPUT_CAP)
        ticket = Ticket(policy, prompt_tokens, expected, payload, next(self._seq), self.clock())
        self.counters.on_arrival(policy.tenant)
        queue = self._classes.setdefault(policy.priority, {}).setdefault(policy.tenant, deque())
        # Behind its tenant's requests of the same or a smaller order in the class (the engines' rule).
        behind = next((i for i, t in enumerate(queue) if t.policy.order_in_class > policy.order_in_class), len(queue))
        queue.insert(behind, ticket)
        self.pump()
        if not ticket.placed.done():
            self.held += 1
        try:
            where = await ticket.placed
        except BaseException:
            if not ticket.placed.done() or ticket.placed.cancelled():
                self._remove(ticket)
            elif ticket.placed.exception() is None:  # placed just as the caller was cancelled: it never ran there
                self.unplace(ticket, ticket.placed.result())
                self.counters.charge(policy, -ticket._prompt_charged - ticket._reserved)
            self.counters.on_departure(policy.tenant)
            self.pump()  # it may have blocked the heads behind it
            raise
        return ticket, where

    def charge(self, ticket: Ticket[P], output: RequestOutput) -> None:
        """Settle a relayed output: at the first, the prompt tokens its engine really computed in place of the whole
        prompt charged at dispatch; its new tokens out of the up-front estimate, past it at their cost."""
        tokens = OUTPUT_TOKEN_COST * len(output.token_ids)
        ticket._output += len(output.token_ids)
        from_reserve = min(tokens, ticket._reserved)
        ticket._reserved -= from_reserve
        tokens -= from_reserve
        if not ticket._started:
            ticket._started = True
            computed = max(0, output.num_prompt_tokens - output.num_cached_tokens)
            tokens += computed - ticket._prompt_charged
            ticket._prompt_charged = computed
        if tokens:
            self.counters.charge(ticket.policy, tokens)

    def leave(self, ticket: Ticket[P]) -> None:
        """The request ended (finished, failed or cancelled after it was placed): the estimate it did not use is
        refunded, its tenant may go idle, and its room may take the next request."""
        if ticket._reserved:
            self.counters.charge(ticket.policy, -ticket._reserved)
            ticket._reserved = 0.0
        self.counters.on_departure(ticket.policy.tenant)
        self.pump()

    def pump(self) -> None:
        """Place waiting requests, in fair order, while one of the most urgent class finds room."""
        while self._place_one():
            pass

    def _place_one(self) -> bool:
        """Place the first request of the most urgent waiting class, in fair order, that finds room. Only that class
        is tried: where its head finds no free slot, the others of its class can only take one by preemption (a
        request that may not preempt waits without holding back one that may), and no less urgent request does."""
        for ticket in self._heads():
            if ticket.placed.done():  # its caller was cancelled while it waited and has not run since: drop it
                self._remove(ticket)
                return True
            try:
                where = self.place(ticket)
            except Exception as e:  # nowhere to go at all (no replica up): the request fails, the next one tries
                self._remove(ticket)
                ticket.placed.set_exception(e)
                return True
            if where is not None:
                break
        else:
            return False
        self._remove(ticket)
        # Charged now, what it may cost, so that the requests dispatched before its outputs come see it.
        ticket._prompt_charged = float(ticket.prompt_tokens)
        ticket._reserved = OUTPUT_TOKEN_COST * ticket.expected_output
        self.counters.charge(ticket.policy, ticket._prompt_charged + ticket._reserved)
        self.dispatched += 1
        ticket.placed.set_result(where)
        return True

    def _heads(self) -> list[Ticket[P]]:
        """The most urgent waiting class's tenants' first requests, in the order they go (the engines' waiting-queue
        order, over the fleet's counters): smallest order in class, then smallest counter, then arrival. Requests
        that have waited the starvation bound come first, oldest first, whatever their class."""
        if not self._classes:
            return []
        if self.starvation_bound_s is not None:
            since = self.clock() - self.starvation_bound_s
            starved = [q[0] for tenants in self._classes.values() for q in tenants.values() if q[0].arrived <= since]
            if starved:
                return sorted(starved, key=lambda t: t.seq)
        tenants = self._classes[min(self._classes)]
        counters = self.counters.counters
        return sorted((q[0] for q in tenants.values()),
                      key=lambda t: (t.policy.order_in_class, counters[t.policy.tenant], t.seq))

    def _remove(self, ticket: Ticket[P]) -> None:
        tenants = self._classes.get(ticket.policy.priority)
        queue = tenants.get(ticket.policy.tenant) if tenants else None
        if queue is None or ticket not in queue:
            return
        queue.remove(ticket)
        if not queue:
            del tenants[ticket.policy.tenant]
            if not tenants:
                del self._classes[ticket.policy.priority]
