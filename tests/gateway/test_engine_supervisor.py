"""The engine supervisor's retry schedule: a failed restart is tried again after the first backoff, doubling up
to the cap; a restart that works resets it."""

import asyncio
import logging

from gateway.engine_supervisor import supervise


class _FlakyReplica:
    """A dead replica whose restarts go as ``outcomes`` says: an exception fails one; a string succeeds and the
    replica dies again at once with that cause; None succeeds for good."""

    def __init__(self, outcomes: list) -> None:
        self.dead: str | None = "first cause"
        self.dead_detail: str | None = None
        self.outcomes = outcomes
        self.done = asyncio.Event()

    async def restart(self) -> None:
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        self.dead = outcome
        if not self.outcomes:
            self.done.set()


def test_failed_restarts_back_off_doubling_up_to_the_cap_and_reset_after_a_restart_that_works(caplog):
    refused = ConnectionRefusedError("not listening yet")

    async def scenario() -> None:
        replica = _FlakyReplica([refused, refused, refused, "second cause", refused, None])
        task = asyncio.create_task(supervise("r", replica, backoff_s=0.1, max_backoff_s=0.2))
        await asyncio.wait_for(replica.done.wait(), 30)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.ERROR, logger="gateway.engine_supervisor"):
        asyncio.run(scenario())
    waits = [r.args[-1] for r in caplog.records if "restart failed" in r.getMessage()]
    assert waits == [0.1, 0.2, 0.2, 0.1]
