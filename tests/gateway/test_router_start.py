"""The router's start: when one replica fails to start, the others, still starting, are stopped at once and the
failure is raised (replicas that divide the experts would otherwise wait for the failed one at their meeting
point until its timeout); when the start is cancelled (the gateway stopping), the replicas still starting are
cancelled and the ones already up are shut down."""

import asyncio
import random
import time

import pytest

from engine.core.config import EngineConfig
from engine.serving.async_engine import EngineError
from gateway.replica_router import ReplicaRouter
from gateway.routing_policy import RouterConfig

pytestmark = pytest.mark.timeout(30)


class StartingReplica:
    """An ``EngineClient`` double whose start fails after ``fail_after_s``, or waits until it is shut down."""

    def __init__(self, fail_after_s: float | None, misplaced: bool = False) -> None:
        self.config = EngineConfig(model="fake")
        self.info, self.dead, self.stats = None, None, None
        self.fail_after_s = fail_after_s
        self.misplaced = misplaced
        self.stopped = asyncio.Event()
        self.cancelled = False
        self.started = False

    async def preflight(self) -> None:
        await asyncio.sleep(random.uniform(0, 0.05))
        if self.misplaced:
            raise EngineError("the engine is data-parallel rank 0 of 2, but this gateway needs it as rank 1")

    async def start(self):
        self.started = True
        if self.fail_after_s == 0:  # up at once
            self.info = object()
            return self.info
        if self.fail_after_s is not None:
            await asyncio.sleep(self.fail_after_s)
            raise EngineError("rank 1: could not join the 2 ranks")
        try:
            await self.stopped.wait()  # a replica waiting at its group's rendezvous
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        raise EngineError("the engine process exited during start-up")

    async def shutdown(self) -> None:
        self.stopped.set()


def test_one_failed_start_stops_the_replicas_still_starting():
    async def scenario():
        replicas = [StartingReplica(None) for _ in range(random.randint(1, 3))]
        replicas.insert(random.randrange(len(replicas) + 1), StartingReplica(random.uniform(0.05, 0.3)))
        router = ReplicaRouter(replicas, [str(i) for i in range(len(replicas))], RouterConfig())
        begin = time.monotonic()
        with pytest.raises(EngineError, match="could not join"):
            await router.start()
        assert time.monotonic() - begin < 5
        assert all(r.stopped.is_set() for r in replicas)

    asyncio.run(scenario())


def test_a_cancelled_start_cancels_the_starting_replicas_and_stops_the_ones_up():
    async def scenario():
        up = [StartingReplica(0) for _ in range(random.randint(1, 2))]
        waiting = [StartingReplica(None) for _ in range(random.randint(1, 2))]
        replicas = random.sample(up + waiting, len(up) + len(waiting))
        router = ReplicaRouter(replicas, [str(i) for i in range(len(replicas))], RouterConfig())
        start = asyncio.create_task(router.start())
        await asyncio.sleep(0.1)
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        assert all(r.cancelled for r in waiting) and all(r.stopped.is_set() for r in up)

    asyncio.run(scenario())


def test_a_replica_that_fails_its_check_stops_the_start_before_any_replica_starts():
    """Several remote engines: one in the wrong place (or unreachable) must not leave the others building."""
    async def scenario():
        replicas = [StartingReplica(random.choice([0, None])) for _ in range(random.randint(1, 3))]
        replicas.insert(random.randrange(len(replicas) + 1), StartingReplica(None, misplaced=True))
        router = ReplicaRouter(replicas, [str(i) for i in range(len(replicas))], RouterConfig())
        with pytest.raises(EngineError, match="needs it as rank 1"):
            await router.start()
        assert not any(r.started for r in replicas) and all(r.stopped.is_set() for r in replicas)

    asyncio.run(scenario())
