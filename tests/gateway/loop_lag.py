"""How long the event loop was held while some work ran: the test of "other requests' streams keep their pace"."""

import asyncio
import time


async def loop_lag_while(work) -> tuple[float, object]:
    """(the longest the event loop was held while ``work`` ran, its result)."""
    worst, stop = 0.0, False

    async def tick():
        nonlocal worst
        while not stop:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            worst = max(worst, time.perf_counter() - t - 0.005)

    ticker = asyncio.ensure_future(tick())
    try:
        result = await work  # before reading worst: `return worst, await work` reads it first
        return worst, result
    finally:
        stop = True
        await ticker
