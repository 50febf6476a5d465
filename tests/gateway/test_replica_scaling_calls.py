"""``ReplicaScaler`` over engine doubles: concurrent calls are serialized, a replica that fails to start leaves the
fleet as it was, a count out of range is refused, a slot freed by a removal is reused (fast: no engine process)."""

import asyncio

import pytest

from engine.core.config import EngineConfig
from engine.serving.async_engine import EngineError
from gateway.engine_supervisor import Supervisors
from gateway.replica_router import REMOVED, SERVING, ReplicaRouter
from gateway.replica_scaling import ReplicaScaler

pytestmark = pytest.mark.timeout(30)


class Replica:
    """An ``EngineClient`` double that is ready ``start_s`` after its start (or fails then)."""

    def __init__(self, start_s: float = 0.05, fails: bool = False) -> None:
        self.config = EngineConfig(model="fake")
        self.info, self.dead, self.stats = None, None, None
        self.start_s, self.fails = start_s, fails
        self.stopped = False

    async def start(self):
        await asyncio.sleep(self.start_s)
        if self.fails:
            raise EngineError("the engine process exited during start-up")
        self.info = object()
        return self.info

    async def shutdown(self) -> None:
        self.stopped, self.dead = True, "stopped"

    def silent_s(self) -> float:
        return 0.0


def _fleet(fails: set[int] = frozenset()):
    built: list[tuple[int, Replica]] = []

    def build(k: int) -> Replica:
        built.append((k, Replica(fails=k in fails)))
        return built[-1][1]

    first = Replica()
    first.info = object()
    router = ReplicaRouter([first], ["0"])
    return router, ReplicaScaler(router, build, 3), built


def test_concurrent_calls_are_serialized():
    async def scenario():
        router, scaler, built = _fleet()
        supervisors = Supervisors(5, 60)
        try:
            # Unserialized, both would see 1 replica serving and start 2 each.
            a, b = await asyncio.gather(scaler.set_count(3, supervisors, 1), scaler.set_count(3, supervisors, 1))
            assert sorted(a["added"] + b["added"]) == ["1", "2"] and [k for k, _ in built] == [1, 2]
            assert [router.names[i] for i in scaler.serving()] == ["0", "1", "2"]
            grow, shrink = await asyncio.gather(scaler.set_count(3, supervisors, 1), scaler.set_count(1, supervisors, 1))
            assert grow["added"] == [] and sorted(shrink["removed"]) == ["1", "2"]
            assert all(r.stopped for _, r in built) and router.states == [SERVING, REMOVED, REMOVED]
            assert [x["replica"] for x in scaler.describe()] == ["0"]
            again = await scaler.set_count(2, supervisors, 1)  # the freed slot is reused under the lowest name
            assert again["added"] == ["1"] and router.states == [SERVING, SERVING, REMOVED]
            assert router.replicas[1] is built[-1][1] and router.live() == [0, 1]
        finally:
            await supervisors.stop_all()

    asyncio.run(scenario())


def test_a_replica_that_fails_to_start_leaves_the_fleet_as_it_was():
    async def scenario():
        router, scaler, built = _fleet(fails={1})
        supervisors = Supervisors(5, 60)
        try:
            with pytest.raises(EngineError):
                await scaler.set_count(2, supervisors, 1)
            assert built[0][1].stopped and [x["replica"] for x in scaler.describe()] == ["0"]
            for bad in (0, 4):
                with pytest.raises(ValueError, match="between 1 and 3"):
                    await scaler.set_count(bad, supervisors, 1)
        finally:
            await supervisors.stop_all()

    asyncio.run(scenario())
