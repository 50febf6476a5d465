"""Adding and removing local engine replicas while the gateway serves (``moegate admin replicas set N``).

Growing: each new replica is built as the start-up path builds one (``gateway.cli.engines``: the same engine
settings, local replica *k*'s GPUs and ports), started, and only once it is ready joins the router, so new
requests may go to it at once (and requests waiting at busy replicas may move there); a supervisor then restarts
it if it dies, as any replica. A replica that fails to start is stopped and the call fails; the fleet is as
before.

Shrinking: the highest-numbered replicas leave. Each takes no new request from the call on
(``ReplicaRouter.drain``) and finishes what it holds; past ``drain_timeout_s`` it is stopped anyway, and the
requests still on it end as when an engine dies (one that has produced no output yet runs on another replica;
a started stream ends with an ``engine_unavailable`` error event, a non-streamed request gets a 503). Then its
process is stopped and its slot freed.

Calls are serialized: a second ``set_count`` waits for the first to finish.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from engine.serving.client import EngineClient
from gateway.engine_supervisor import Supervisors
from gateway.replica_router import DRAINING, SERVING, ReplicaRouter

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05  # how often a draining replica's held requests are counted
SETTLE_S = 5.0  # the longest wait, once a replica is stopped, for the requests it failed to let go of it


class ReplicaScaler:
    """Sets how many replicas ``router`` serves with, 1 to ``max_replicas``. ``build(k)``: local replica ``k``
    (named ``str(k)``), not started."""

    def __init__(self, router: ReplicaRouter, build: Callable[[int], EngineClient], max_replicas: int) -> None:
        if max_replicas < len(router.current()):
            raise ValueError(f"the most replicas ({max_replicas}) is below the {len(router.current())} started")
        self.router, self.build, self.max_replicas = router, build, max_replicas
        self._lock = asyncio.Lock()
        self._starting: list[EngineClient] = []  # replicas started by a call and not yet in the router
        # Awaited with [(name, replica)] before new replicas start, as the start-up replicas are before theirs
        # (the gateway's LoRA catalog turns LoRA on where the database holds adapters).
        self.before_start: Callable[[list[tuple[str, EngineClient]]], Awaitable[None]] | None = None

    def serving(self) -> list[int]:
        """The router's slots that take requests now."""
        return [i for i in self.router.current() if self.router.states[i] == SERVING]

    def describe(self) -> list[dict]:
        """Each replica in the fleet: its name, state (serving, draining, starting, down) and requests held."""
        out = []
        for i in self.router.current():
            replica, state = self.router.replicas[i], self.router.states[i]
            if state == SERVING and replica.dead:
                state = "down"
            elif state == SERVING and replica.info is None:
                state = "starting"
            out.append({"replica": self.router.names[i], "state": state, "in_flight": self.router.in_flight[i],
                        "routed": self.router.routed[i]})
        return out

    async def set_count(self, count: int, supervisors: Supervisors, drain_timeout_s: float) -> dict:
        """Grow or shrink to ``count`` serving replicas; returns when the new ones serve or the leaving ones are
        stopped: ``{"replicas": describe(), "added": [...], "removed": [...], "seconds": ...}``. ValueError for a
        count out of range; EngineError (the fleet unchanged) if a new replica fails to start."""
        if not 1 <= count <= self.max_replicas:
            raise ValueError(f"count must be between 1 and {self.max_replicas}, got {count}")
        async with self._lock:
            began = time.monotonic()
            serving = self.serving()
            if count > len(serving):
                added, removed = await self._grow(count - len(serving), supervisors), []
            else:
                added, removed = [], await self._shrink(serving[count:], supervisors, drain_timeout_s)
            return {"replicas": self.describe(), "added": added, "removed": removed,
                    "seconds": round(time.monotonic() - began, 3)}

    async def _grow(self, n: int, supervisors: Supervisors) -> list[str]:
        taken = {self.router.names[i] for i in self.router.current()}
        numbers = [k for k in range(self.max_replicas) if str(k) not in taken][:n]
        replicas = [self.build(k) for k in numbers]
        if self.before_start is not None:
            await self.before_start([(str(k), r) for k, r in zip(numbers, replicas)])
        self._starting = replicas
        try:
            await asyncio.gather(*(r.start() for r in replicas))
        except BaseException:
            await asyncio.gather(*(r.shutdown() for r in replicas), return_exceptions=True)
            raise
        finally:
            self._starting = []
        for k, replica in zip(numbers, replicas):
            self.router.add_replica(replica, str(k))
            supervisors.start(str(k), replica)
            logger.info("engine replica %s joined", k)
        return [str(k) for k in numbers]

    async def _shrink(self, leaving: list[int], supervisors: Supervisors, drain_timeout_s: float) -> list[str]:
        for i in leaving:
            self.router.drain(i)  # no new request from now on
        await asyncio.gather(*(self._stop(i, supervisors, drain_timeout_s) for i in leaving))
        return [self.router.names[i] for i in leaving]

    async def _stop(self, i: int, supervisors: Supervisors, drain_timeout_s: float) -> None:
        name, replica = self.router.names[i], self.router.replicas[i]
        await supervisors.stop(replica)  # its stop below is not a death to repair
        deadline = time.monotonic() + drain_timeout_s
        while self.router.in_flight[i] and time.monotonic() < deadline and not replica.dead:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.router.in_flight[i]:
            logger.warning("engine replica %s still held %d requests after %g s of draining; stopping it",
                           name, self.router.in_flight[i], drain_timeout_s)
            cut = getattr(replica, "cut_requests", None)  # an orderly shutdown alone would leave them waiting
            if cut is not None:
                cut(f"removed from the fleet after a {drain_timeout_s:g} s drain")
            settle = time.monotonic() + SETTLE_S  # their handlers let go of the slot before it may be reused
            while self.router.in_flight[i] and time.monotonic() < settle:
                await asyncio.sleep(DRAIN_POLL_S)
        await replica.shutdown()
        if self.router.states[i] == DRAINING:
            self.router.remove(i)
        logger.info("engine replica %s removed", name)

    async def close(self) -> None:
        """The server stops: a replica a call is starting is stopped too (the router stops the others)."""
        await asyncio.gather(*(r.shutdown() for r in self._starting), return_exceptions=True)
