"""Graceful shutdown: on SIGTERM/SIGINT, in-flight requests run on for up to the drain timeout, then are cut.

aiohttp's own shutdown waits ``shutdown_timeout`` for handlers, then cancels only the request's body and
waits ``shutdown_timeout`` again before it cancels the handler: a stream that never reads its body runs on
for twice the timeout. So the gateway drains by itself, in an ``on_shutdown`` hook (which aiohttp runs after
it has stopped accepting connections and before its own wait): it waits for the requests in flight up to
the drain timeout and cancels the handlers of those still running, as a client disconnect would (their
engine requests are aborted and what they produced is billed). aiohttp's wait then finds them ended.
"""

import asyncio

from aiohttp import web

# Seconds a cancelled handler gets to unwind (abort its engine request, hand its usage to the ledger).
CUT_GRACE_S = 5.0
# The task handling each request in flight -> an event set when its handler returns.
OPEN_REQUESTS = web.AppKey("open_requests", dict)


@web.middleware
async def track_open_requests(request: web.Request, handler):
    """Record the request as in flight until its handler returns (the outermost middleware)."""
    open_requests = request.app[OPEN_REQUESTS]
    task = asyncio.current_task()
    ended = asyncio.Event()
    open_requests[task] = ended
    try:
        return await handler(request)
    finally:
        open_requests.pop(task, None)
        ended.set()


async def drain_open_requests(app: web.Application, timeout_s: float) -> int:
    """Wait up to ``timeout_s`` for the requests in flight to end, then cancel the handlers of those still
    running; returns how many were cancelled. New requests must already be refused (the caller's job)."""
    open_requests = dict(app[OPEN_REQUESTS])
    if not open_requests:
        return 0
    waiters = [asyncio.ensure_future(ended.wait()) for ended in open_requests.values()]
    _, pending = await asyncio.wait(waiters, timeout=timeout_s)
    for waiter in pending:
        waiter.cancel()
    cut = [task for task, ended in open_requests.items() if not ended.is_set()]
    for task in cut:
        task.cancel()
    if cut:  # let the cancelled handlers unwind (abort, billing) before aiohttp closes their connections
        waiters = [asyncio.ensure_future(open_requests[task].wait()) for task in cut]
        _, pending = await asyncio.wait(waiters, timeout=CUT_GRACE_S)
        for waiter in pending:
            waiter.cancel()
    return len(cut)
