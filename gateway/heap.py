"""Keep Python's cyclic garbage collector from stalling the event loop.

A full (generation 2) collection walks every tracked object in the process.
After startup that is some 80,000-100,000 objects that live as long as the
process (modules, SQLAlchemy mappers and compiled statements, the metrics
registry, the engine client); under load a full collection ran every few
seconds and held the event loop for 45-60 ms on the 2-core benchmark machine,
which was the whole p99 tail of the gateway overhead benchmark
(docs/performance.md). Freezing the startup heap moves it out of the
collector's reach for good, so the collections that still run only walk
objects made while serving.
"""

import gc

from aiohttp import web


async def freeze_startup_heap(app: web.Application) -> None:
    """``on_startup`` hook, registered last: collect what startup threw away, then freeze the rest.

    Runs before the server accepts connections, so the one full collection costs nothing to
    clients. Startup objects that later become cyclic garbage (an engine client replaced by a
    restart, say) are not reclaimed; that is a few objects per restart, not per request.
    """
    gc.collect()
    gc.freeze()


async def unfreeze_heap(app: web.Application) -> None:
    """``on_cleanup`` hook: hand the frozen objects back to the collector once the app is done.

    A process that runs several apps in turn (the test suite) would otherwise keep every
    earlier app's cycles, and objects still frozen at exit are never finalized.
    """
    gc.unfreeze()
