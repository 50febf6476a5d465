"""Benchmarks: each prints numbers; docs/performance.md keeps the tables and the commands."""


def run_on_gateway_loop(main):
    """``asyncio.run(main)`` on uvloop, the event loop ``moegate serve`` installs, when it is importable.

    A benchmark that runs the gateway in its own process must give it the same loop as production:
    on asyncio's default loop the gateway's work per request is measurably larger.
    """
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run(main)
    return uvloop.run(main)
