"""The gateway's supervisor of its engine replicas: a replica that dies is restarted (a remote one reconnected)
on its own, while the others keep serving."""

import asyncio
import logging
import math
import time

from engine.serving.client import EngineClient

logger = logging.getLogger(__name__)

ENGINE_RESTART_INTERVAL_S = 60.0  # at most one restart a minute for the same cause


async def supervise(name: str, replica: EngineClient, backoff_s: float, max_backoff_s: float) -> None:
    """Restart one engine replica when it dies; until then it takes no requests (and /health says so).

    A restart that fails (a remote engine not reachable yet, say) is tried again after ``backoff_s``, doubling
    up to ``max_backoff_s``; a restart that works resets it. A cause seen before is logged once and restarted at
    most once every ``ENGINE_RESTART_INTERVAL_S``, so an engine that fails the same way again and again does not
    flood the log or spin on reloading the weights. Runs until cancelled.
    """
    last_restart: dict[str, float] = {}  # cause -> when the engine was last restarted for it
    backoff = backoff_s
    while True:
        await asyncio.sleep(0.5)
        if not replica.dead:
            continue
        cause = replica.dead_detail or replica.dead
        since = time.monotonic() - last_restart.get(cause, -math.inf)
        if since < ENGINE_RESTART_INTERVAL_S:
            logger.warning("engine replica %s down again for the same cause; restarting it in %.0f s",
                           name, ENGINE_RESTART_INTERVAL_S - since)
            await asyncio.sleep(ENGINE_RESTART_INTERVAL_S - since)
        else:
            logger.error("engine replica %s down (%s): restarting it", name, cause)
        try:
            await replica.restart()
            # Only a restart that worked counts against the cause: failing to start is retried sooner.
            last_restart[cause] = time.monotonic()
            backoff = backoff_s
            logger.info("engine replica %s restarted", name)
        except Exception as e:  # keep serving without it (503s if it is the only one) and try again
            logger.error("engine replica %s restart failed (%s); trying again in %g s", name, e, backoff)
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, max_backoff_s)


class Supervisors:
    """One ``supervise`` task per replica, started and stopped as replicas join and leave the fleet."""

    def __init__(self, backoff_s: float, max_backoff_s: float) -> None:
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._tasks: dict[int, asyncio.Task] = {}  # id(replica) -> its supervisor

    def start(self, name: str, replica: EngineClient) -> None:
        self._tasks[id(replica)] = asyncio.create_task(supervise(name, replica, self.backoff_s, self.max_backoff_s))

    async def stop(self, replica: EngineClient) -> None:
        """Stop restarting ``replica`` (before it is stopped on purpose: its stop is not a death to repair)."""
        task = self._tasks.pop(id(replica), None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def stop_all(self) -> None:
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
