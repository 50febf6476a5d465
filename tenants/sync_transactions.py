"""Whole transactions on a synchronous connection, run in one worker thread: one thread hop each.

The async store reaches SQLite through aiosqlite, which runs every cursor call
in its own thread: creating a cursor, executing, fetching and closing are each a
round trip through a queue and back through the event loop's self-pipe, so one
statement costs the loop three or four wakeups and a transaction of eight
statements about thirty. The batch runner's hot path (claim, result writes,
lease renewals, the finalize check) runs such transactions for every few lines,
and on a machine whose cores the engine needs, those wakeups were most of the
gateway's CPU per batch line. Here the same Core statements run on a plain
synchronous connection (pysqlite or psycopg) inside a function the worker
thread calls once: the event loop pays one hop per transaction.

One worker thread, so transactions from this process never queue on each
other's database locks, and a connection pool of one (SQLite allows one writer
at a time; the async store's own connection is the only other one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from sqlalchemy import Connection, Engine, create_engine

from tenants.db import DEFAULT_TIMEOUTS, DatabaseTimeouts, backend, sqlite_pragmas, sync_url

T = TypeVar("T")


class SyncTransactions:
    """Runs ``body(connection, *args)`` inside ``BEGIN ... COMMIT`` on the worker thread.

    ``url`` is the store's database URL (any driver; the synchronous one is derived).
    The engine and thread are created on first use and released by ``close``.
    """

    def __init__(self, url: str, timeouts: DatabaseTimeouts = DEFAULT_TIMEOUTS) -> None:
        self.url = sync_url(url)
        self.timeouts = timeouts
        self._engine: Engine | None = None
        self._executor: ThreadPoolExecutor | None = None

    def _engine_for_thread(self) -> Engine:
        if self._engine is None:  # only ever touched from the worker thread
            t = self.timeouts
            if backend(self.url) == "sqlite":
                self._engine = create_engine(self.url, pool_size=1, max_overflow=0, connect_args={"timeout": t.sqlite_busy_s})
                sqlite_pragmas(self._engine)
            else:
                self._engine = create_engine(self.url, pool_size=1, max_overflow=0, connect_args={
                    "connect_timeout": max(1, round(t.connect_s)), "options": t.postgres_options()})
        return self._engine

    def _in_transaction(self, body: Callable[..., T], args: tuple) -> T:
        with self._engine_for_thread().begin() as connection:
            return body(connection, *args)

    async def run(self, body: Callable[[Connection], T] | Callable[..., T], *args) -> T:
        """``body``'s result, committed; an exception from ``body`` rolls the transaction back and is raised here."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moegate-batch-sql")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._in_transaction, body, args)

    async def close(self) -> None:
        executor, self._executor = self._executor, None
        if executor is None:
            return
        engine = self._engine

        def release() -> None:
            if engine is not None:
                engine.dispose()

        await asyncio.get_running_loop().run_in_executor(executor, release)
        executor.shutdown(wait=False)
        self._engine = None
