"""The fleet's weighted-fair queue (gateway.fleet_fairness) in the router and the disaggregated router, on replica
doubles whose every token the test emits, so which request runs where is known at each step; and the scheduler a
prefill engine runs, on prompts as a prefill engine gets them.

The reference for shares is a float64 replay of VTC over the same requests (``_vtc_order``): which tenant the
weighted-fair rule sends next at each free slot.
"""

import asyncio
import itertools
import random

import pytest

from engine.core.outputs import RequestOutput
from engine.core.request import Request
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.serving.async_engine import EngineError
from gateway.disaggregation import DisaggregatedEngines
from gateway.replica_router import ReplicaRouter
from gateway.routing_policy import RouterConfig
from tests.engine.helpers import make_scheduler
from tests.gateway.test_router_moves import FifoReplica, _until

pytestmark = pytest.mark.timeout(60)

SLOTS = 4


class _Fleet:
    """Requests on replica doubles, consumed by tasks; ``step`` emits one token for every running request."""

    def __init__(self, replicas: list[FifoReplica], client, output_len: int) -> None:
        self.replicas = replicas
        self.client = client
        self.output_len = output_len
        self.tasks: dict[str, asyncio.Task] = {}
        self.served: dict[str, int] = {}  # tenant -> output tokens received by the client
        self.policies: dict[str, RequestPolicy] = {}
        self._ids = itertools.count()

    async def _one(self, request_id: str, policy: RequestPolicy, prompt: list[int]) -> None:
        self.policies[request_id] = policy
        async for out in self.client.generate(prompt, SamplingParams(max_tokens=self.output_len), request_id, policy):
            self.served[policy.tenant] = self.served.get(policy.tenant, 0) + len(out.token_ids)

    def submit(self, request_id: str, policy: RequestPolicy, prompt: list[int]) -> None:
        self.tasks[request_id] = asyncio.create_task(self._one(request_id, policy, prompt))

    def keep(self, policy: RequestPolicy, prompt, clients: int) -> None:
        """``clients`` closed-loop clients of one tenant: each sends its next request (``prompt()``) when answered."""
        async def client() -> None:
            while True:
                await self._one(f"{policy.tenant}-{next(self._ids)}", policy, prompt())

        for _ in range(clients):
            self.tasks[f"client-{next(self._ids)}"] = asyncio.create_task(client())

    async def step(self) -> None:
        for replica in self.replicas:
            for rid in replica.running():
                replica.emit(rid, finished=replica._emitted.get(rid, 0) + 1 >= self.output_len)
        for _ in range(8):  # let the consumers read, and the freed slots take the next requests
            await asyncio.sleep(0)

    def running_tenants(self) -> list[list[str]]:
        return [sorted(self.policies[r].tenant for r in replica.running()) for replica in self.replicas]

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


def _router(fleet_fairness: bool = True) -> tuple[ReplicaRouter, list[FifoReplica]]:
    replicas = [FifoReplica(SLOTS), FifoReplica(SLOTS)]
    return ReplicaRouter(replicas, ["a", "b"], RouterConfig(rebalance_interval_s=0, fleet_fairness=fleet_fairness)), replicas


async def _warm(fleet: _Fleet, router: ReplicaRouter, system: dict[str, list[int]],
                policies: dict[str, RequestPolicy]) -> dict[str, int]:
    """Each tenant's system prompt routed once, alone: the second goes to the replica without a prompt family, and
    affinity keeps each tenant on its own replica from then on. Per tenant, that replica."""
    home = {}
    for tenant in system:
        before = list(router.routed)
        fleet.submit(f"warm-{tenant}", policies[tenant], system[tenant] + [1])
        while not fleet.tasks[f"warm-{tenant}"].done():
            await fleet.step()
        home[tenant] = next(i for i, (was, now) in enumerate(zip(before, router.routed)) if now > was)
    assert sorted(home.values()) == [0, 1], home
    fleet.served.clear()
    return home


@pytest.mark.parametrize("fleet_fairness", [True, False])
def test_weights_hold_when_affinity_keeps_tenants_apart(fleet_fairness):
    """Weights 1 and 3, each tenant's prompts cached on its own replica, ten closed-loop clients each (more than the
    fleet's slots: both backlogged): 3.0 x the tokens with the fair queue (every step 2 light and 6 heavy
    sequences); without it each replica serves its one tenant (the doubles have no weights of their own): 1.0."""
    rng = random.Random()
    weights = {"light": 1.0, "heavy": 3.0}
    policies = {t: RequestPolicy(tenant=t, weight=w, cache_salt=t) for t, w in weights.items()}
    system = {t: [rng.randrange(1, 500) for _ in range(48)] for t in weights}  # 3 blocks of 16

    async def scenario() -> None:
        router, replicas = _router(fleet_fairness)
        fleet = _Fleet(replicas, router, output_len=rng.randint(3, 6))
        home = await _warm(fleet, router, system, policies)
        for _ in range(10):  # their first requests in turns
            for t in weights:
                fleet.keep(policies[t], lambda t=t: system[t] + [rng.randrange(1, 500)], clients=1)
        for _ in range(4 * fleet.output_len):  # warm-up: the first requests went out as they came, half each
            await fleet.step()
        fleet.served.clear()
        for _ in range(8 * fleet.output_len):
            await fleet.step()
            running = fleet.running_tenants()
            if fleet_fairness:  # every step, not only on average: the heavy tenant runs 6 of the 8 sequences
                assert sum(t == "light" for r in running for t in r) == 2, running
            else:  # affinity alone: each replica runs its own tenant only
                assert all(set(running[home[t]]) == {t} for t in weights), (home, running)
        ratio = fleet.served["heavy"] / fleet.served["light"]
        if fleet_fairness:
            assert 2.85 <= ratio <= 3.15, fleet.served
            assert router.moved_from == [0, 0]  # nothing queued in an engine: nothing to move
        else:
            assert ratio == 1.0, fleet.served  # what the fair queue corrects
        await fleet.close()
        if fleet_fairness:
            assert len(router.gate) == 0 and router.in_flight == [0, 0] and not router.gate.counters._active

    asyncio.run(scenario())


def test_affinity_kept_while_its_replica_has_room():
    """Below the fleet's capacity nothing waits: each tenant's requests go to the replica holding its prefix."""
    rng = random.Random()
    policies = {t: RequestPolicy(tenant=t, weight=rng.uniform(0.5, 4), cache_salt=t) for t in ("x", "y")}
    system = {t: [rng.randrange(1, 500) for _ in range(48)] for t in policies}

    async def scenario() -> None:
        router, replicas = _router()
        fleet = _Fleet(replicas, router, output_len=2)
        home = await _warm(fleet, router, system, policies)
        for k in range(SLOTS):
            for t in policies:
                fleet.submit(f"{t}-{k}", policies[t], system[t] + [k])
        await _until(lambda: sum(len(r.running()) for r in replicas) == 2 * SLOTS, "not all dispatched")
        assert all(fleet.running_tenants()[home[t]] == [t] * SLOTS for t in policies)
        assert router.gate.held == 0
        await fleet.close()

    asyncio.run(scenario())


def test_urgent_class_first_and_preemption_goes_where_a_victim_runs():
    """With every slot full: an urgent request that may preempt goes at once to the replica running preemptible
    requests of a less urgent class (past its slots: that engine's scheduler preempts one); one that may not
    preempt waits, and at the next free slots goes before the less urgent requests that waited longer."""
    rng = random.Random()
    batch = RequestPolicy(priority=2, tenant="batch", weight=rng.uniform(1, 4), cache_salt="batch")
    pinned = RequestPolicy(priority=2, tenant="pinned", preemptible=False, cache_salt="pinned")
    urgent = RequestPolicy(priority=0, tenant="rt", weight=rng.uniform(0.1, 1))
    polite = RequestPolicy(priority=0, tenant="polite", may_preempt=False)
    shared = [rng.randrange(1, 500) for _ in range(32)]  # one prompt family per tenant: affinity keeps it together

    async def scenario() -> None:
        router, replicas = _router()
        fleet = _Fleet(replicas, router, output_len=3)
        order: list[str] = []  # request ids in the order the fair queue placed them
        place = router.gate.place
        router.gate.place = lambda ticket: _logged(place(ticket), ticket, order)
        for k in range(SLOTS):  # one replica: work that may not be preempted
            fleet.submit(f"pinned-{k}", pinned, shared + [k])
        await _until(lambda: sorted(len(r.running()) for r in replicas) == [0, SLOTS], "pinned not together")
        hold = next(i for i, r in enumerate(replicas) if r.running())
        other = 1 - hold
        for k in range(SLOTS + 2):  # the other: preemptible batch work, and two more wait in the gateway
            fleet.submit(f"batch-{k}", batch, shared + [k])
        await _until(lambda: len(router.gate) == 2, "batch not held")
        fleet.submit("polite", polite, [7])
        fleet.submit("urgent", urgent, [8])
        await _until(lambda: "urgent" in order, "urgent not placed")
        assert [r for r, _ in replicas[other].arrivals][-1] == "urgent" or (await asyncio.sleep(0.01)) or \
            [r for r, _ in replicas[other].arrivals][-1] == "urgent"
        assert router.in_flight[other] == SLOTS + 1 and router.in_flight[hold] == SLOTS
        assert len(router.gate) == 3  # polite and the two batch requests wait
        for _ in range(3):  # the doubles run first come first: every running request ends together at step 3
            await fleet.step()
        assert order[-3:] == ["polite", "batch-4", "batch-5"], order
        await fleet.close()
        assert len(router.gate) == 0 and router.in_flight == [0, 0]
        assert not router.gate.counters._active  # every tenant left: none is counted active

    asyncio.run(scenario())


def _logged(where, ticket, order: list[str]):
    if where is not None:
        order.append(ticket.payload.request_id)
    return where


def test_a_cancelled_waiting_request_leaves_and_no_replica_fails_the_wait():
    async def scenario() -> None:
        router, replicas = _router()
        fleet = _Fleet(replicas, router, output_len=2)
        for k in range(2 * SLOTS + 1):
            fleet.submit(f"r{k}", RequestPolicy(tenant="t"), [k])
        await _until(lambda: len(router.gate) == 1, "the last one not held")
        fleet.tasks[f"r{2 * SLOTS}"].cancel()
        await asyncio.sleep(0)
        assert len(router.gate) == 0 and sum(router.in_flight) == 2 * SLOTS
        for replica in replicas:
            replica.dead = "gone"
        fleet.submit("late", RequestPolicy(tenant="u"), [1])
        await asyncio.gather(fleet.tasks["late"], return_exceptions=True)
        assert isinstance(fleet.tasks["late"].exception(), EngineError)
        for task in fleet.tasks.values():
            task.cancel()
        await asyncio.gather(*fleet.tasks.values(), return_exceptions=True)

    asyncio.run(scenario())


class _NoPrefill:
    """A prefill engine that is down: the disaggregated router's decode engines compute every prompt."""

    info = None
    dead = "down"


def test_disaggregated_decode_engines_share_by_weight():
    """Two decode engines behind the disaggregated router, ten closed-loop clients a tenant: 3.0 x the tokens to
    weight 3 (the doubles have no weights of their own: without the fair queue, 1.0)."""
    rng = random.Random()
    weights = {"light": 1.0, "heavy": 3.0}
    policies = {t: RequestPolicy(tenant=t, weight=w, cache_salt=t) for t, w in weights.items()}

    async def scenario() -> None:
        decode = [FifoReplica(SLOTS), FifoReplica(SLOTS)]
        engines = DisaggregatedEngines([_NoPrefill()], decode, fleet_fairness=True)
        fleet = _Fleet(decode, engines, output_len=rng.randint(3, 6))
        for _ in range(10):
            for t in weights:
                fleet.keep(policies[t], lambda: [rng.randrange(1, 500) for _ in range(5)], clients=1)
        for _ in range(4 * fleet.output_len):
            await fleet.step()
        fleet.served.clear()
        for _ in range(8 * fleet.output_len):
            await fleet.step()
        assert 2.85 <= fleet.served["heavy"] / fleet.served["light"] <= 3.15, fleet.served
        await fleet.close()
        assert len(engines.gate) == 0 and not any(engines._in_flight.values())

    asyncio.run(scenario())


def _prompt(tenant: str, weight: float, priority: int = 1, length: int = 40, **policy) -> Request:
    """A prompt as a prefill engine gets it: computed, one token sampled (max_tokens 1), then gone."""
    return Request(f"{tenant}-{random.random()}", [random.randrange(1, 500) for _ in range(length)],
                   SamplingParams(max_tokens=1, ignore_eos=True), 1,
                   policy=RequestPolicy(tenant=tenant, weight=weight, priority=priority, **policy))


def test_prefill_engine_scheduler_orders_prompts_by_weight_and_class():
    """Prefill engines run the engines' one scheduler, with the request's own RequestPolicy (the disaggregated router
    passes it on): prompt tokens go 3:1 to weight 3 while both are backlogged, and an urgent prompt is scheduled at
    the next step, ahead of the tenants' queues."""
    rng = random.Random()
    sched = make_scheduler(num_blocks=512, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)
    computed = {"a": 0, "b": 0}
    for i in range(400):
        for tenant, weight in (("a", 1.0), ("b", 3.0)):
            while sum(r.policy.tenant == tenant for r in sched.waiting) < 4:
                sched.add_request(_prompt(tenant, weight, length=rng.randint(20, 60)))
        if i == 300:
            sched.add_request(_prompt("rt", 1.0, priority=0))
        out = sched.schedule()
        sched.update(out, [7 if s.sample else None for s in out.scheduled])
        if i == 300:
            assert "rt" in {s.request.policy.tenant for s in out.scheduled}
        if i >= 100:
            for s in out.scheduled:
                if s.request.policy.tenant in computed:
                    computed[s.request.policy.tenant] += s.num_new_tokens
    assert 2.85 <= computed["b"] / computed["a"] <= 3.15, computed


@pytest.mark.parametrize("flag", [True, False])
def test_the_serve_flag_reaches_the_router(flag, tmp_path):
    """``moegate serve --fleet-fairness`` gives the replica router its fair queue (nothing is started here)."""
    from engine.core.config import EngineConfig
    from gateway.cli import build_parser
    from gateway.cli.engines import build_engines

    args = build_parser().parse_args(["serve", "--model", str(tmp_path)] + (["--fleet-fairness"] * flag))
    assert args.fleet_fairness is flag
    router = build_engines(EngineConfig(model=str(tmp_path)), 2, [], b"", args.router, 60.0, 0, args.fleet_fairness)
    assert isinstance(router, ReplicaRouter) and (router.gate is not None) is flag


def test_a_request_that_waited_the_starvation_bound_goes_before_urgent_ones():
    """Strict classes, except that a request waiting the starvation bound goes first (the engines' rule); without a
    bound, steady urgent arrivals keep it waiting."""
    from gateway.fleet_fairness import FairGate

    rng = random.Random()
    bound = rng.uniform(1, 100)

    async def scenario(starvation_bound_s):
        now = [0.0]
        room = [0]
        placed: list[str] = []

        def place(ticket):
            if room[0] == 0:
                return None
            room[0] -= 1
            placed.append(ticket.payload)
            return ticket.payload

        gate = FairGate(place, lambda ticket, where: None, starvation_bound_s, clock=lambda: now[0])
        waits = [asyncio.create_task(gate.enter(RequestPolicy(priority=3, tenant="batch"), 10, 5, "old"))]
        for k in range(30):  # urgent work keeps coming, one a slot; the clock passes the bound along the way
            waits.append(asyncio.create_task(gate.enter(RequestPolicy(priority=0, tenant="rt"), 10, 5, f"rt{k}")))
            await asyncio.sleep(0)
            now[0] += bound / 10
            room[0] = 1
            gate.pump()
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        return placed

    with_bound = asyncio.run(scenario(bound))
    assert "old" in with_bound and with_bound.index("old") in (9, 10), with_bound  # once it has waited the bound
    assert "old" not in asyncio.run(scenario(None))
