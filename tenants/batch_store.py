"""Files, batches and batch lines in the database: the Batch API's durable state.

Lines are claimed with leases: ``claim`` marks up to N lines ``running`` with
an owner and an expiry; a line whose lease ran out (its gateway crashed) can be
claimed again by anyone. ``finish`` records a line's result *only if the caller
still holds its lease*, in the same transaction as the batch's counters and the
line's usage row, so a line is finished, counted and billed exactly once even
if two gateways ran it. A batch is finalized (its output files written) under
a lease of its own, so a crash while finalizing is also taken over.

Every method is one transaction. Times: naive UTC datetimes for the API's
``*_at`` fields, epoch seconds (floats) for leases.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import msgspec
from sqlalchemy import Connection, and_, case, func, insert, or_, select, update
from sqlalchemy.orm import Session

from tenants.batch_statements import BatchStatements
from tenants.models import FILE_CHUNK_BYTES, Batch, BatchLine, FileChunk, StoredFile, utcnow
from tenants.quota import QuotaManager
from tenants.storage_cap import OverStorageCap, check_room
from tenants.store import QuotaConfig, TenantStore, UsageRecord
from tenants.sync_transactions import SyncTransactions

TERMINAL = ("failed", "completed", "expired", "cancelled")
INSERT_SLICE_ROWS = 500  # batch lines per insert statement (see ``create_batch``)


# A line's result as compact JSON: msgspec's encoder takes a fifth of json.dumps' time per line.
_encode_json = msgspec.json.Encoder().encode


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


@dataclass(slots=True, frozen=True)
class FileInfo:
    id: str
    tenant_id: int
    filename: str
    purpose: str
    bytes: int
    path: str
    created_at: datetime


@dataclass(slots=True, frozen=True)
class ClaimedLine:
    id: int
    batch_id: str
    tenant_id: int
    endpoint: str
    custom_id: str
    body_json: str
    attempts: int


@dataclass(slots=True, frozen=True)
class FinishedLine:
    """A line's outcome, to be written by ``BatchStore.finish_many``."""

    line: ClaimedLine
    ok: bool
    result: dict
    usage: UsageRecord | None


def _file_info(f: StoredFile) -> FileInfo:
    return FileInfo(f.id, f.tenant_id, f.filename, f.purpose, f.bytes, f.path, f.created_at)


def _scalar(c: Connection, query):
    """The first ORM object ``query`` selects on ``c``, or None; detached, with its columns loaded."""
    with Session(c) as session:
        return session.scalar(query)


class StorageFull(OverStorageCap):
    """A file that would take a tenant's stored files past its cap (``QuotaConfig.max_stored_file_bytes``)."""


class BatchStore:
    def __init__(self, store: TenantStore, quotas: QuotaManager, clock=time.time, model: str | None = None) -> None:
        """``model``: the model this gateway serves; its runner claims and finalizes only batches for it
        (None: every batch, for tools and tests)."""
        self.store, self.quotas, self.clock = store, quotas, clock
        self.sessions = store.sessions
        self._pg = store.backend == "postgresql"
        # The runner's hot path: prebuilt Core statements, whole transactions on a synchronous connection.
        self._sql = BatchStatements(self._pg, model)
        self.hot = SyncTransactions(store.engine.url.render_as_string(hide_password=False))

    async def close(self) -> None:
        """Release the hot path's connection and thread (the async store is closed by its owner)."""
        await self.hot.close()

    # -- files -----------------------------------------------------------------------------------------

    async def stored_bytes(self, tenant_id: int) -> int:
        """Bytes the tenant's stored files take together."""
        async with self.sessions() as s:
            return await self._stored_bytes(s, tenant_id)

    @staticmethod
    async def _stored_bytes(s, tenant_id: int) -> int:
        return int(await s.scalar(select(func.coalesce(func.sum(StoredFile.bytes), 0))
                                  .where(StoredFile.tenant_id == tenant_id)))

    async def add_file(self, tenant_id: int, filename: str, purpose: str, content: Path,
                       file_id: str | None = None, max_stored_bytes: int | None = None) -> FileInfo:
        """Store a file whose bytes are at ``content`` (a local file, e.g. an upload's temporary copy):
        the row and its chunks in one transaction, so every gateway sharing the database can serve it.
        ``max_stored_bytes``: StorageFull (nothing stored) if the tenant's files would take more with it."""
        size = content.stat().st_size
        row = StoredFile(id=file_id or new_id("file-"), tenant_id=tenant_id, filename=filename, purpose=purpose,
                         bytes=size, path="", created_at=utcnow())
        async with self.sessions.begin() as s:
            await check_room(s, tenant_id, size, max_stored_bytes, self._stored_bytes, StorageFull)
            s.add(row)
            await s.flush()
            with open(content, "rb") as f:
                seq = 0
                while chunk := await asyncio.to_thread(f.read, FILE_CHUNK_BYTES):
                    await s.execute(insert(FileChunk), [{"file_id": row.id, "seq": seq, "data": chunk}])
                    seq += 1
        return _file_info(row)

    @staticmethod
    def _chunk_rows(file_id: str, data: bytes) -> list[dict]:
        return [{"file_id": file_id, "seq": i // FILE_CHUNK_BYTES, "data": data[i:i + FILE_CHUNK_BYTES]}
                for i in range(0, len(data), FILE_CHUNK_BYTES)]

    async def file_chunks(self, file_id: str) -> AsyncIterator[bytes]:
        """A file's content, chunk by chunk (one query each: a large file is never all in memory)."""
        seq = 0
        while True:
            async with self.sessions() as s:
                data = await s.scalar(select(FileChunk.data).where(FileChunk.file_id == file_id, FileChunk.seq == seq))
            if data is None:
                return
            yield data
            seq += 1

    async def read_file(self, file_id: str) -> bytes:
        return b"".join([chunk async for chunk in self.file_chunks(file_id)])

    async def get_file(self, tenant_id: int, file_id: str) -> FileInfo | None:
        """The tenant's file, or None (another tenant's file is as absent as a missing one)."""
        async with self.sessions() as s:
            f = await s.scalar(select(StoredFile).where(StoredFile.id == file_id, StoredFile.tenant_id == tenant_id))
            return None if f is None else _file_info(f)

    async def list_files(self, tenant_id: int, purpose: str | None, after: str | None, limit: int,
                         newest_first: bool = True) -> tuple[list[FileInfo], bool]:
        q = select(StoredFile).where(StoredFile.tenant_id == tenant_id)
        if purpose:
            q = q.where(StoredFile.purpose == purpose)
        return await self._page(q, StoredFile, tenant_id, after, limit, newest_first, _file_info)

    async def delete_file(self, tenant_id: int, file_id: str) -> FileInfo | None:
        async with self.sessions.begin() as s:
            f = await s.scalar(select(StoredFile).where(StoredFile.id == file_id, StoredFile.tenant_id == tenant_id))
            if f is None:
                return None
            info = _file_info(f)
            await s.delete(f)
            return info

    async def _page(self, q, model, tenant_id: int, after: str | None, limit: int, newest_first: bool, convert):
        """Cursor pagination by (created_at, id): ``after`` is the last id of the previous page. Only the tenant's
        own rows anchor a page: another tenant's id pages as an unknown one (from the start), so a list tells
        nothing of it."""
        order = (model.created_at.desc(), model.id.desc()) if newest_first else (model.created_at, model.id)
        async with self.sessions() as s:
            if after:
                anchor = await s.scalar(select(model.created_at).where(model.id == after, model.tenant_id == tenant_id))
                if anchor is not None:
                    if newest_first:
                        q = q.where(or_(model.created_at < anchor, and_(model.created_at == anchor, model.id < after)))
                    else:
                        q = q.where(or_(model.created_at > anchor, and_(model.created_at == anchor, model.id > after)))
            rows = (await s.scalars(q.order_by(*order).limit(limit + 1))).all()
            return [convert(r) for r in rows[:limit]], len(rows) > limit

    # -- batches ---------------------------------------------------------------------------------------

    async def create_batch(self, tenant_id: int, endpoint: str, input_file_id: str, completion_window_s: float,
                           window_label: str, metadata: dict | None, model: str | None, lines: list,
                           errors: list[dict] | None, queued_tokens: int) -> Batch:
        """A validated batch (``in_progress``, with its lines) or a failed one (``errors`` given, no lines)."""
        now = utcnow()
        failed = bool(errors)
        batch = Batch(
            id=new_id("batch_"), tenant_id=tenant_id, endpoint=endpoint, input_file_id=input_file_id,
            completion_window=window_label, status="failed" if failed else "in_progress", model=model,
            metadata_json=json.dumps(metadata) if metadata else None,
            errors_json=json.dumps(errors) if failed else None, total=0 if failed else len(lines),
            completed=0, failed=0, queued_tokens=0 if failed else queued_tokens, created_at=now,
            expires_at=now + timedelta(seconds=completion_window_s),
            failed_at=now if failed else None, in_progress_at=None if failed else now,
        )
        async with self.sessions.begin() as s:
            s.add(batch)
            await s.flush()
            # In slices, one transaction still: preparing an insert's parameters holds the event loop (50,000
            # lines in one statement held it 1.1 s), a slice's only a few milliseconds.
            for start in range(0, 0 if failed else len(lines), INSERT_SLICE_ROWS):
                await s.execute(insert(BatchLine), [
                    dict(batch_id=batch.id, line_no=l.line_no, custom_id=l.custom_id, body_json=l.body_json,
                         status="pending", attempts=0) for l in lines[start:start + INSERT_SLICE_ROWS]])
        return batch

    async def get_batch(self, tenant_id: int | None, batch_id: str) -> Batch | None:
        """The batch (detached: its columns loaded), or None; ``tenant_id`` None: whoever owns it.

        On the hot path's thread (one hop, not one per cursor call): clients poll this while their
        batch runs, on the cores the engine is using.
        """
        q = select(Batch).where(Batch.id == batch_id)
        if tenant_id is not None:
            q = q.where(Batch.tenant_id == tenant_id)
        return await self.hot.run(_scalar, q)

    async def list_batches(self, tenant_id: int, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        return await self._page(select(Batch).where(Batch.tenant_id == tenant_id), Batch, tenant_id, after, limit,
                                True, lambda b: b)

    async def cancel(self, tenant_id: int, batch_id: str) -> Batch | None:
        """Stop new work at once: pending lines become cancelled; running ones finish and are kept."""
        async with self.sessions.begin() as s:
            b = await s.scalar(select(Batch).where(Batch.id == batch_id, Batch.tenant_id == tenant_id))
            if b is None:
                return None
            if b.status in ("in_progress", "validating"):
                await s.execute(update(BatchLine).where(BatchLine.batch_id == b.id, BatchLine.status == "pending")
                                .values(status="cancelled", result_json=None))
                b.status, b.cancelling_at = "cancelling", utcnow()
            return b

    # -- lines: the runner's hot path, whole transactions on the worker thread (one event-loop wakeup each) --

    async def claim(self, owner: str, limit: int, lease_s: float) -> list[ClaimedLine]:
        """Up to ``limit`` runnable lines (pending, or running with a lapsed lease), oldest batch first."""
        return await self.hot.run(self._claim, owner, limit, self.clock() + lease_s)

    def _claim(self, c: Connection, owner: str, limit: int, until: float) -> list[ClaimedLine]:
        sql, now = self._sql, self.clock()
        # Lapsed leases first (their lines have waited longest), then pending lines, oldest batch first.
        ids = list(c.execute(sql.pick_lapsed, {"now": now, "limit": limit}).scalars())
        if len(ids) < limit:
            for batch_id in c.execute(sql.open_batches).scalars().all():
                ids += c.execute(sql.pick_pending, {"bid": batch_id, "limit": limit - len(ids)}).scalars()
                if len(ids) == limit:
                    break
        if not ids:
            return []
        c.execute(sql.lease, {"ids": ids, "now": now, "owner": owner, "until": until})
        return [ClaimedLine(*r) for r in c.execute(sql.claimed, {"ids": ids, "owner": owner})]

    async def renew(self, owner: str, line_ids: list[int], lease_s: float) -> None:
        if line_ids:
            await self.hot.run(self._renew, owner, list(line_ids), self.clock() + lease_s)

    def _renew(self, c: Connection, owner: str, line_ids: list[int], until: float) -> None:
        c.execute(self._sql.renew, {"ids": line_ids, "owner": owner, "until": until})

    async def release_all(self, owner: str) -> None:
        """Lapse every lease ``owner`` holds (its lines, and the batches it was finalizing), so that
        anyone may take them over at once.

        A runner stopping on purpose calls it last: it also covers lines a claim took for the owner
        while the runner was being cancelled (that transaction still commits on the worker thread).
        """
        await self.hot.run(self._release_all, owner)

    def _release_all(self, c: Connection, owner: str) -> None:
        lapsed = {"owner": owner, "until": self.clock() - 1.0}
        c.execute(self._sql.release, lapsed)
        c.execute(self._sql.release_finalizing, lapsed)

    async def finish(self, owner: str, line: ClaimedLine, ok: bool, result: dict, usage: UsageRecord | None) -> bool:
        """Record a line's result if ``owner`` still holds it; bill its usage (batch rate) in the same transaction.

        Returns False when the lease was lost (another gateway took the line over): nothing is written.
        """
        return (await self.finish_many(owner, [FinishedLine(line, ok, result, usage)]))[0]

    async def finish_many(self, owner: str, items: list[FinishedLine]) -> list[bool]:
        """``finish`` for many lines in one transaction (group commit); one bool per item, in order.

        Each line is guarded by its own lease as in ``finish``: a line ``owner`` no longer holds is
        skipped (False) and neither counted nor billed; the others are written together.
        """
        if not items:
            return []
        return await self.hot.run(self._finish_many, owner, items)

    async def finish_and_claim(self, owner: str, items: list[FinishedLine], limit: int,
                               lease_s: float) -> tuple[list[bool], list[ClaimedLine]]:
        """``finish_many`` and then ``claim`` of up to ``limit`` lines, in one transaction.

        The batch runner's steady state: a wave of finished lines is written and as many fresh ones
        taken in a single round trip to the database.
        """
        return await self.hot.run(self._finish_and_claim, owner, items, limit, self.clock() + lease_s)

    def _finish_and_claim(self, c: Connection, owner: str, items: list[FinishedLine], limit: int,
                          until: float) -> tuple[list[bool], list[ClaimedLine]]:
        written = self._finish_many(c, owner, items) if items else []
        return written, self._claim(c, owner, limit, until) if limit > 0 else []

    def _finish_many(self, c: Connection, owner: str, items: list[FinishedLine]) -> list[bool]:
        sql = self._sql
        # One statement takes every line still held, and locks it for this transaction (the row locks
        # on PostgreSQL; BEGIN IMMEDIATE's write lock on SQLite): what it returns is what we write.
        held = set(c.execute(sql.take, {"ids": [item.line.id for item in items], "owner": owner}).scalars())
        written: list[bool] = []
        results, usages = [], []
        counts: dict[tuple[str, bool], int] = {}
        for item in items:
            mine = item.line.id in held
            held.discard(item.line.id)  # the same line twice in one call is written once
            written.append(mine)
            if not mine:
                continue
            results.append({"lid": item.line.id, "owner": owner, "new_status": "done" if item.ok else "failed",
                            "result": _encode_json(item.result).decode()})
            key = (item.line.batch_id, item.ok)
            counts[key] = counts.get(key, 0) + 1
            if item.usage is not None:
                usages.append(item.usage)
        if not results:
            return written
        res = c.execute(sql.write, results)  # one executemany
        # Cannot happen under the locks above. (Only where the driver sums an executemany's row counts.)
        if c.dialect.supports_sane_multi_rowcount and res.rowcount != len(results):
            raise RuntimeError(f"wrote {res.rowcount} of {len(results)} batch line results; rolled back")
        for (batch_id, ok), n in sorted(counts.items()):  # one lock order for every writer
            c.execute(sql.count_done if ok else sql.count_failed, {"bid": batch_id, "n": n})
        if usages:
            tenants = sorted({u.tenant_id for u in usages})
            discounts = dict(c.execute(sql.discounts, {"tenants": tenants}).all())
            rates = {t: QuotaConfig(batch_discount=0.5 if discounts.get(t) is None else discounts[t]) for t in tenants}
            rows, billed_by_tenant = [], {}
            for u in usages:
                billed = rates[u.tenant_id].billed(u.prompt_tokens + u.completion_tokens, True)
                row = TenantStore.usage_values(u, billed)
                row["batch"] = True  # billed at the batch rate, so flagged as batch whatever the caller said
                rows.append(row)
                billed_by_tenant[u.tenant_id] = billed_by_tenant.get(u.tenant_id, 0) + billed
            c.execute(sql.usage, rows)
            for tenant_id, billed in sorted(billed_by_tenant.items()):
                self.quotas.add_billed(c, tenant_id, billed)
        return written

    async def line_counts(self, batch_id: str) -> dict[str, int]:
        async with self.sessions() as s:
            rows = (await s.execute(select(BatchLine.status, func.count()).where(BatchLine.batch_id == batch_id)
                                    .group_by(BatchLine.status))).all()
            return {status: int(n) for status, n in rows}

    # -- finalization and expiry -------------------------------------------------------------------------

    async def expire_overdue(self) -> int:
        """Past its completion window, a batch's unstarted lines expire; returns how many batches.

        Also ends the lines of cancelled batches left running by a gateway that died: nobody renews
        their leases and nobody may run them again, so once the lease lapses they are cancelled, and
        the batch can be finalized (its queued tokens released).
        """
        now = utcnow()
        async with self.sessions.begin() as s:
            cancelling = select(Batch.id).where(Batch.status == "cancelling")
            await s.execute(update(BatchLine).where(BatchLine.batch_id.in_(cancelling), BatchLine.status == "running",
                                                    BatchLine.lease_expires < self.clock())
                            .values(status="cancelled", result_json=None, lease_owner=None, lease_expires=None)
                            .execution_options(synchronize_session=False))
            ids = list((await s.scalars(select(Batch.id).where(Batch.status == "in_progress",
                                                               Batch.expires_at <= now))).all())
            for batch_id in ids:
                await s.execute(update(BatchLine).where(BatchLine.batch_id == batch_id, BatchLine.status == "pending")
                                .values(status="expired"))
                await s.execute(update(Batch).where(Batch.id == batch_id).values(expired_at=now))
            return len(ids)

    async def ready_to_finalize(self) -> list[str]:
        """Batches with no line left to run (none pending, none running) and not yet finalized by anyone alive."""
        return await self.hot.run(self._ready_to_finalize)

    def _ready_to_finalize(self, c: Connection) -> list[str]:
        return list(c.execute(self._sql.finalizable, {"now": self.clock()}).scalars())

    async def begin_finalizing(self, owner: str, batch_id: str, lease_s: float) -> Batch | None:
        """Take the batch's finalization lease; None if someone else holds it or it is done."""
        now = self.clock()
        async with self.sessions.begin() as s:
            res = await s.execute(
                update(Batch).where(Batch.id == batch_id, or_(
                    Batch.status.in_(("in_progress", "cancelling")),
                    and_(Batch.status == "finalizing", Batch.lease_expires < now)))
                .values(status="finalizing", lease_owner=owner, lease_expires=now + lease_s,
                        finalizing_at=func.coalesce(Batch.finalizing_at, utcnow()),
                        cancelled_at=case((Batch.status == "cancelling", utcnow()), else_=Batch.cancelled_at)))
            if res.rowcount != 1:
                return None
            return await s.scalar(select(Batch).where(Batch.id == batch_id))

    async def lines_of(self, batch_id: str) -> list[tuple[int, str, str, str | None]]:
        """(line_no, custom_id, status, result_json) of every line, in file order."""
        async with self.sessions() as s:
            return [tuple(r) for r in (await s.execute(
                select(BatchLine.line_no, BatchLine.custom_id, BatchLine.status, BatchLine.result_json)
                .where(BatchLine.batch_id == batch_id).order_by(BatchLine.line_no))).all()]

    async def complete_finalizing(self, owner: str, batch: Batch, files: list[tuple[FileInfo, bytes]],
                                  output_file_id: str | None, error_file_id: str | None, final_status: str) -> bool:
        """Store the output files (info, content) and the final status, if ``owner`` still holds the lease."""
        now = utcnow()
        async with self.sessions.begin() as s:
            stamp = {"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at"}[final_status]
            res = await s.execute(
                update(Batch).where(Batch.id == batch.id, Batch.lease_owner == owner, Batch.status == "finalizing")
                .values({"status": final_status, "output_file_id": output_file_id, "error_file_id": error_file_id,
                         "lease_owner": None, "lease_expires": None, "queued_tokens": 0,
                         stamp: func.coalesce(getattr(Batch, stamp), now)}))
            if res.rowcount != 1:
                return False
            for f, data in files:
                s.add(StoredFile(id=f.id, tenant_id=f.tenant_id, filename=f.filename, purpose=f.purpose,
                                 bytes=len(data), path="", created_at=now))
            await s.flush()
            for f, data in files:
                if data:
                    await s.execute(insert(FileChunk), self._chunk_rows(f.id, data))
            if batch.queued_tokens:
                await self.quotas.bump_batch_queue(s, batch.tenant_id, -batch.queued_tokens)
            return True
