"""The usage ledger's writer: settles finished requests in batches, off the request path.

Handlers hand over ``(grant, usage)`` (usage None for a request that never
ran) and return at once; one flusher task writes everything that has piled
up since its last write in a single transaction (group commit), so under load
the database sees one transaction per batch instead of one per request, and at
low load nothing waits for a timer. A failed write is retried with the same
items; ``close`` writes whatever is left, so graceful shutdown loses nothing.
If the database is down at shutdown, what could not be written is kept in a
journal file under ``journal_dir`` and written at the next start
(``replay_journal``), so an outage loses no usage either.
"""

import asyncio
import logging
import os
import uuid
from pathlib import Path

import msgspec

from tenants.quota import Granted, QuotaManager
from tenants.store import UsageRecord

logger = logging.getLogger(__name__)

_Journal = list[tuple[Granted, UsageRecord | None]]
_journal_decoder = msgspec.json.Decoder(_Journal)


class UsageLedger:
    def __init__(self, quotas: QuotaManager, max_batch: int = 512, retry_s: float = 1.0,
                 min_interval_s: float = 0.0, journal_dir: Path | None = None) -> None:
        self.quotas = quotas
        self.journal_dir = journal_dir  # None: settles that cannot be written at shutdown are lost (logged)
        self.max_batch = max_batch
        # Least time from one write's start to the next one's. Each transaction costs the event loop
        # about 1 ms however few rows it has (SQLAlchemy, greenlet and aiosqlite hops); written as
        # often as settles arrived, that was about 190 transactions a second at 1,000 requests/s.
        # The first write after a quiet spell still starts at once.
        self.min_interval_s = min_interval_s
        self.retry_s = retry_s
        self._pending: list[tuple[Granted, UsageRecord | None]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self.close_attempts = 5  # failed writes tolerated at shutdown before giving up (and saying so)
        self.flushes = 0  # transactions written (for tests and the benchmark)
        self.settled = 0  # items written
        # Called with the request ids of usage rows once committed (or kept in the journal): the stream journal
        # (gateway.stream_journal) stops keeping them.
        self.on_written = None

    def submit(self, grant: Granted, usage: UsageRecord | None) -> None:
        """Queue one settle (``usage`` given) or release (None); never blocks, never raises."""
        self._pending.append((grant, usage))
        self._wake.set()

    @property
    def backlog(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage-ledger")

    async def _write_some(self) -> None:
        batch = self._pending[: self.max_batch]
        await self.quotas.settle_many(batch)
        del self._pending[: len(batch)]  # only after the commit: a failed write keeps its items
        self._written(batch)
        self.flushes += 1
        self.settled += len(batch)

    def _written(self, items: list) -> None:
        if self.on_written is not None:
            self.on_written([usage.request_id for _, usage in items if usage is not None])

    async def _run(self) -> None:
        failures = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                started = asyncio.get_running_loop().time()
                try:
                    await self._write_some()
                    failures = 0
                    rest = started + self.min_interval_s - asyncio.get_running_loop().time()
                    if rest > 0 and not self._closing:
                        await asyncio.sleep(rest)
                except Exception:
                    failures += 1
                    if self._closing and failures >= self.close_attempts:
                        self._spill()
                        return
                    logger.exception("usage ledger write failed (%d items kept); retrying", len(self._pending))
                    await asyncio.sleep(self.retry_s)
            if self._closing:
                return

    async def close(self) -> None:
        """Write what is left and stop. The flusher is never cancelled mid-write: a write cut
        after its commit would be written again."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None

    # -- the journal: settles the database could not take at shutdown -------------------------------------

    def _spill(self) -> None:
        if self.journal_dir is None:
            logger.error("usage ledger: %d settles could not be written and are lost", len(self._pending))
            return
        self.journal_dir.mkdir(parents=True, exist_ok=True)
        path = self.journal_dir / f"usage-{os.getpid()}-{uuid.uuid4().hex[:12]}.json"
        _write_journal(path, self._pending)
        self._written(self._pending)
        logger.error("usage ledger: the database is unavailable; %d settles kept in %s, written at the next start",
                     len(self._pending), path)
        self._pending.clear()

    async def replay_journal(self) -> int:
        """Write the settles earlier runs kept in the journal; returns how many. A file shrinks as its
        settles are committed and is removed when none is left; if the database is still down, what is
        left stays for the next start."""
        if self.journal_dir is None or not self.journal_dir.is_dir():
            return 0
        replayed = 0
        for path in sorted(self.journal_dir.glob("usage-*.json")):
            items = _journal_decoder.decode(path.read_bytes())
            while items:
                chunk = items[: self.max_batch]
                try:
                    await self.quotas.settle_many(chunk)
                except Exception:
                    logger.exception("usage ledger: %d settles of journal %s could not be written yet; kept",
                                     len(items), path)
                    return replayed
                items = items[len(chunk):]
                replayed += len(chunk)
                if items:  # what is committed leaves the file before the next chunk is tried
                    _write_journal(path, items)
            path.unlink()
            logger.info("usage ledger: wrote the settles kept in %s", path)
        return replayed


def _write_journal(path: Path, items: list) -> None:
    """Complete or absent: written aside, synced, then renamed over ``path``."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(items))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
