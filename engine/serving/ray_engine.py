"""An engine whose ranks are Ray actors (``--distributed-executor-backend ray``) as the gateway's ``AsyncEngine``.

Everything but the transport is ``AsyncEngine``'s: the protocol, the reader, the failure handling, the
supervisor's restarts. The transport is ``engine.serving.ray_group``: each start places the engine's ranks
in a fresh placement group, and rank 0's actor connects back to this process over TCP with a key made for
that start. A rank lost while the engine runs (its node left the cluster, its process died) cuts the
connection, so the engine fails as a local engine whose process died: requests in flight are answered
``503``, and the supervisor's restart places a new group wherever Ray has room.
"""

import asyncio
import logging
import os
from multiprocessing.connection import Connection

from engine.core.config import EngineConfig
from engine.serving.ray_group import RayGroupError, RayRankGroup, reclaim_sigterm
from engine.serving.async_engine import MAX_UNREAD_OUTPUTS, AsyncEngine, EngineError
from engine.serving.handshake import shut

logger = logging.getLogger(__name__)

STOP_WAIT_S = 10.0  # how long a stopping engine's rank 0 may take to end before its group is removed


class RayEngine(AsyncEngine):
    def __init__(self, config: EngineConfig, stall_timeout_s: float | None = None,
                 max_unread_outputs: int = MAX_UNREAD_OUTPUTS) -> None:
        super().__init__(config, stall_timeout_s=stall_timeout_s, max_unread_outputs=max_unread_outputs)
        self.group: RayRankGroup | None = None  # this start's actors (None while stopped)
        self.lost: str | None = None  # which rank ended first, once one has (for the operator's log)

    def describe(self) -> str:
        return f"the engine's Ray actors ({self.lost})" if self.lost else "the engine's Ray actors"

    async def _open(self) -> tuple[Connection, Connection]:
        group = self.group = RayRankGroup(self.config)
        self.lost = None
        try:
            conn = await asyncio.get_running_loop().run_in_executor(None, group.start, os.urandom(32))
        except RayGroupError as e:
            raise EngineError(f"{self.describe()} did not start", detail=str(e)) from None
        except asyncio.CancelledError:  # the gateway is stopping: the start's thread finds its group removed
            group.kill()
            raise
        finally:
            reclaim_sigterm()  # the start may have joined Ray, which takes SIGTERM over
        loop = asyncio.get_running_loop()
        group.watch(lambda why: loop.call_soon_threadsafe(self._rank_ended, group, conn, why))
        return conn, conn

    def _rank_ended(self, group: RayRankGroup, conn: Connection, why: str) -> None:
        """A rank's actor ended while the engine ran: cut the connection (the reader then fails the requests in
        flight, and the supervisor restarts the engine as a whole)."""
        if group is not self.group:
            return
        self.lost = why  # rank 0's own loss closes the connection first: the reader has failed the requests already
        logger.error("%s; cutting the engine off", why)
        if not self.dead:
            shut(conn)

    def _cut_off(self, replies: Connection) -> None:
        shut(replies)
        if self.group is not None:
            self.group.kill()

    async def _close(self, replies: Connection) -> None:
        """After Shutdown was sent: let rank 0 end (``STOP_WAIT_S``; at once for an engine that failed, whose rank 0
        may be on a node that is gone), then remove the group and its actors."""
        group, self.group = self.group, None
        if group is not None:
            await asyncio.get_running_loop().run_in_executor(None, group.stop, 0.0 if self.dead else STOP_WAIT_S)
