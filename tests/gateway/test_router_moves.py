"""The router moves a queued request to a replica that freed a slot, invisibly to the client.

Two fake replicas run their requests first come, first served, ``slots`` at once, and produce a token only
when the test says so, so which requests are running, queued or started is known exactly at every point.
"""

import asyncio
import random

import pytest

from engine.core.config import EngineConfig
from engine.core.outputs import RequestOutput
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.serving.protocol import Ready
from gateway.metrics import GatewayMetrics
from gateway.replica_router import ReplicaRouter
from gateway.routing_policy import RouterConfig

pytestmark = pytest.mark.timeout(60)


def _token(request_id: str, position: int) -> int:
    """The token a request produces at a position, wherever it runs (the reference for every stream)."""
    return hash((request_id, position)) % 50_000


def _ready() -> Ready:
    return Ready("fake", "Fake", 4096, 50_000, has_tokenizer=False)


class FifoReplica:
    """An ``EngineClient`` double: its first ``slots`` live requests run, the rest wait in arrival order."""

    def __init__(self, slots: int) -> None:
        self.config = EngineConfig(model="fake", max_num_seqs=slots)
        self.slots = slots
        self.info: Ready | None = _ready()
        self.dead: str | None = None
        self.stats = None
        self.arrivals: list[tuple[str, RequestPolicy]] = []  # (request id, its policy) of every request sent here
        self.aborted: list[str] = []
        self.releases: list[tuple[str, bool]] = []  # (request id, released) of every release asked
        self._live: dict[str, asyncio.Queue] = {}  # arrival order
        self._emitted: dict[str, int] = {}

    def silent_s(self) -> float:
        return 0.0  # a double that always answers: the router's silence rule is tested with real replicas

    def running(self) -> list[str]:
        return list(self._live)[:self.slots]

    def queued(self) -> list[str]:
        return list(self._live)[self.slots:]

    def emit(self, request_id: str, finished: bool) -> None:
        """One token for a running request (the last one if ``finished``)."""
        assert request_id in self.running(), request_id
        n = self._emitted[request_id] = self._emitted.get(request_id, 0) + 1
        out = RequestOutput(request_id, [_token(request_id, n - 1)], "x", finished, "length" if finished else None,
                            3, 0, n)
        self._live[request_id].put_nowait(out)
        if finished:
            del self._live[request_id]  # its slot is free at once, as after an engine step

    async def release(self, request_id: str) -> bool:
        """As the engine: a queued request that has produced nothing is dropped; a running one stays."""
        await asyncio.sleep(0)  # the answer comes back later, as over the engine's pipe
        released = request_id in self.queued() and not self._emitted.get(request_id)
        if released:
            del self._live[request_id]
        self.releases.append((request_id, released))
        return released

    async def generate(self, prompt, sampling_params, request_id=None, policy=None, stream=True):
        assert request_id not in self._live
        queue: asyncio.Queue = asyncio.Queue()
        self._live[request_id] = queue
        self.arrivals.append((request_id, policy))
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._live.pop(request_id, None)
                self.aborted.append(request_id)


async def _until(condition, what: str, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.001)


def _run_burst(body, rebalance_interval_s: float = 0.0) -> None:
    """A fresh seeded burst, started, then ``body(burst)``. By default moves happen only when a request ends
    (no periodic look), so a test knows when each can happen."""

    async def scenario():
        burst = _Burst(random.randrange(1 << 30), rebalance_interval_s)
        await burst.start()
        await body(burst)

    asyncio.run(scenario())


async def _consume(router: ReplicaRouter, request_id: str, policy: RequestPolicy) -> list[RequestOutput]:
    return [out async for out in router.generate([1, 2, 3], SamplingParams(max_tokens=64), request_id, policy)]


class _Burst:
    """Four requests per slot over replicas a and b (each: ``slots`` running, ``slots`` queued)."""

    def __init__(self, seed: int, rebalance_interval_s: float) -> None:
        self.seed = seed
        self.rng = rng = random.Random(seed)
        self.slots = slots = rng.randint(2, 4)
        self.a, self.b = FifoReplica(slots), FifoReplica(slots)
        self.router = ReplicaRouter([self.a, self.b], ["a", "b"], RouterConfig(rebalance_interval_s=rebalance_interval_s))
        self.policies = {f"r{i}": RequestPolicy(priority=rng.randint(0, 3), tenant=f"t{rng.randint(0, 9)}",
                                                cache_salt=f"s{rng.random()}", weight=rng.uniform(0.5, 2))
                         for i in range(4 * slots)}
        self.tasks: dict[str, asyncio.Task] = {}

    async def start(self) -> None:
        for rid, policy in self.policies.items():
            self.tasks[rid] = asyncio.create_task(_consume(self.router, rid, policy))
        n = len(self.policies) // 2
        await _until(lambda: len(self.a.arrivals) == n and len(self.b.arrivals) == n, "the burst was not split")
        for replica in (self.a, self.b):  # every running request starts: from now on none of them may move
            for rid in replica.running():
                replica.emit(rid, finished=False)
        await _until(lambda: [len(u) for u in self.router._unstarted] == [self.a.slots] * 2,
                     "the router did not see the first outputs")

    async def finish(self, replica: FifoReplica, request_id: str) -> None:
        replica.emit(request_id, finished=True)
        await _until(lambda: self.tasks[request_id].done(), f"{request_id} did not end")

    async def drain_a_while_not_ready(self) -> None:
        """Every request on a ends while a restarts (not ready), so nothing moves to it; then it is ready."""
        self.a.info = None
        while self.a.running():  # both of a's waves
            await self.finish(self.a, self.a.running()[0])
        assert self.router.moved_from == [0, 0] and self.router.in_flight == [0, 2 * self.a.slots]
        self.a.info = _ready()

    async def drain(self) -> None:
        """Tokens to every running request, some finishing, until every client has its whole stream; then
        ``check_streams``."""
        while not all(t.done() for t in self.tasks.values()):
            for replica in (self.a, self.b):
                for rid in replica.running():
                    replica.emit(rid, finished=self.rng.random() < 0.3)
            await asyncio.sleep(0.002)
        self.check_streams()

    def check_streams(self) -> None:
        """Each client saw its request's tokens exactly once, in order, ending with one finished output."""
        for rid, task in self.tasks.items():
            outs = task.result()  # raises if the client saw an error
            assert [o.num_output_tokens for o in outs] == list(range(1, len(outs) + 1)), (rid, outs)
            assert [o.token_ids[0] for o in outs] == [_token(rid, j) for j in range(len(outs))], rid
            assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], rid
        assert self.router.in_flight == [0, 0] and not any(self.router._unstarted)
        for replica in (self.a, self.b):  # only requests that had produced nothing there left it
            assert all(replica._emitted.get(rid, 0) == 0 for rid in replica.aborted), replica.aborted


def test_queued_requests_move_to_the_replica_that_freed_a_slot_and_started_ones_never_do():
    async def body(burst):
        a, b, router, slots, seed = burst.a, burst.b, burst.router, burst.slots, burst.seed
        freed = burst.rng.randint(1, slots)  # slots replica a frees once its own queue is done
        started_on_b = b.running()
        queued_on_b = b.queued()
        assert len(started_on_b) == len(queued_on_b) == slots
        # a finishes its first wave: its queue takes the freed slots, so it has none free and nothing moves.
        for rid in a.running():
            await burst.finish(a, rid)
        assert len(a.running()) == slots and not a.queued() and router.moved_from == [0, 0], seed
        for rid in a.running():
            a.emit(rid, finished=False)
        # a's second wave: each request that ends frees a slot, and one of b's queued requests moves there,
        # the most recently routed first.
        for rid in a.running()[:freed]:
            await burst.finish(a, rid)
        expected = queued_on_b[::-1][:freed]
        await _until(lambda: [r for r, _ in a.arrivals[2 * slots:]] == expected, f"moved: {a.arrivals}, seed {seed}")
        assert router.moved_from == [0, freed] and b.aborted == expected, seed
        assert list(b._live) == started_on_b + queued_on_b[:slots - freed], seed
        # A moved request keeps its request policy (priority, tenant, cache salt, weight).
        assert all(policy == burst.policies[rid] for rid, policy in a.arrivals), seed
        assert router.in_flight == [slots, 2 * slots - freed], seed
        metrics = GatewayMetrics(router).render().body.decode()
        assert f'moegate_router_moved_requests_total{{replica="b"}} {float(freed)}' in metrics

        await burst.drain()
        assert set(b.aborted) <= set(queued_on_b)  # more may move while the rest drains; none that started
        assert router.routed == [2 * slots + len(b.aborted), 2 * slots], seed

    _run_burst(body)


def test_no_move_to_a_replica_that_is_not_ready_until_it_is():
    """While a is not ready nothing moves to it; once it is, the next request to end anywhere moves b's
    queue to it, down to b's slots (a move never leaves the source with a free slot)."""
    async def body(burst):
        a, b, router, slots, seed = burst.a, burst.b, burst.router, burst.slots, burst.seed
        queued_on_b = b.queued()
        await burst.drain_a_while_not_ready()
        assert b.queued() == queued_on_b, seed
        # One of b's running requests ends: b still has 2 * slots - 1 requests, so its slots - 1 newest move to a.
        await burst.finish(b, b.running()[0])
        await _until(lambda: router.moved_from == [0, slots - 1], f"{router.moved_from}, seed {seed}")
        assert [r for r, _ in a.arrivals[2 * slots:]] == queued_on_b[::-1][:slots - 1], seed
        assert router.in_flight == [slots - 1, slots], seed
        await burst.drain()

    _run_burst(body)


def test_a_request_running_without_output_is_refused_and_stays():
    """b's newest request runs without output yet (a better-ranked or quiet request): the router asks b to
    release it, b refuses, and it stays and is not asked again; b's queued requests move instead."""
    async def body(burst):
        a, b, router, slots, seed = burst.a, burst.b, burst.router, burst.slots, burst.seed
        await burst.drain_a_while_not_ready()
        newest = b.queued()[-1]
        b._live = {newest: b._live[newest], **{r: q for r, q in b._live.items() if r != newest}}  # it runs first
        assert newest in b.running() and not b._emitted.get(newest)
        queued = b.queued()  # a started request pushed back (it has output: never a candidate), then the rest
        await burst.finish(b, b.running()[1])  # b has 2 * slots - 1 requests: slots - 1 of them move to a
        # A move is counted when the router sends it; it arrives at a's engine a few loop turns later.
        await _until(lambda: router.moved_from == [0, slots - 1] and len(a.arrivals) >= 2 * slots + slots - 1,
                     f"{router.moved_from} {len(a.arrivals)}, seed {seed}")
        assert b.releases[0] == (newest, False), (b.releases, seed)
        assert [r for r, _ in a.arrivals[2 * slots:]] == queued[1:][::-1], seed
        assert newest not in [r for r, _ in a.arrivals] and newest in b.running(), seed
        assert [r for r, _ in b.releases].count(newest) == 1, seed
        assert router.in_flight == [slots - 1, slots], seed
        await burst.drain()

    _run_burst(body)


def test_a_replica_that_becomes_ready_takes_queued_requests_without_waiting_for_an_end():
    """With periodic looks, b's queue moves to a as soon as a is ready again, though no request ends."""
    async def body(burst):
        a, b, router, slots, seed = burst.a, burst.b, burst.router, burst.slots, burst.seed
        queued_on_b = b.queued()
        await burst.drain_a_while_not_ready()  # periodic looks meanwhile find no live target; then a is ready
        # No request ends from here until the moves are seen.
        await _until(lambda: router.moved_from == [0, slots] and len(a.arrivals) >= 2 * slots + len(queued_on_b),
                     f"{router.moved_from} {len(a.arrivals)}, seed {seed}")
        assert [r for r, _ in a.arrivals[2 * slots:]] == queued_on_b[::-1], seed
        assert not b.queued() and router.in_flight == [slots, slots], seed
        await burst.drain()

    _run_burst(body, rebalance_interval_s=0.01)
