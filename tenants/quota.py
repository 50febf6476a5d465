"""Quota arithmetic: reserve before a request runs, settle with what it really used.

A gateway calls ``try_acquire(tenant, tokens=prompt+max_tokens)``; on
``Granted`` it runs the request and then ``settle(grant, usage)`` with the
actual counts, which gives back the unused part of the reservation, frees the
concurrency slot and appends the usage row, all in one transaction.

Every counter lives in ``quota_counters`` and changes only through one atomic
conditional upsert (``INSERT .. ON CONFLICT DO UPDATE .. WHERE value + n <=
limit RETURNING value``): the database decides, never a value read earlier,
so several gateway processes sharing PostgreSQL never admit past a limit.
One acquire bumps its counters in a fixed order inside one transaction; the
first that refuses rolls back the ones before it.

Windows: requests/min and tokens/min are fixed one-minute windows; daily and
monthly budgets are the UTC calendar day and month, and their counters hold
the billed tokens of the ledger for that period plus open reservations.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from datetime import date, datetime, timezone
from typing import Callable

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from tenants.models import Quota, QuotaCounter, Tenant
from tenants.store import NotFound, QuotaConfig, TenantStore, UsageRecord, next_month

CONCURRENCY_WINDOW = 0
CONCURRENCY_RETRY_S = 1.0  # nobody knows when an in-flight request ends; ask clients to come back soon


@dataclass(slots=True, frozen=True)
class Granted:
    """A reservation; pass it back to ``settle`` (or ``release``) exactly once."""

    tenant_id: int
    requests: int
    tokens: int  # raw tokens reserved against tokens/min
    billed: int  # billed tokens reserved against the daily and monthly budgets
    batch: bool
    batch_discount: float
    minute: int  # window start (epoch s) of the per-minute counters
    day: int  # window start (epoch s) of the daily budget
    month: int  # window start (epoch s) of the monthly budget
    concurrent: bool  # whether a concurrency slot was taken
    # Per-minute counters after this grant, for rate-limit headers: kind ("rpm"/"tpm") ->
    # (limit, remaining, seconds until the window resets). Only limited counters appear.
    windows: dict[str, tuple[int, int, float]] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class Denied:
    """Why not, and when to retry; ``retry_after_s`` is None when retrying cannot help."""

    reason: str  # rpm | tpm | concurrency | daily_tokens | monthly_tokens | max_tokens | disabled
    retry_after_s: float | None
    limit: int
    remaining: int
    reset_s: float | None


class _Refused(Exception):
    def __init__(self, denied: Denied) -> None:
        self.denied = denied


def _epoch(d: date) -> int:
    return int(datetime(d.year, d.month, d.day, tzinfo=timezone.utc).timestamp())


class QuotaManager:
    """Admission by quota for one store; ``clock`` returns epoch seconds (tests freeze it)."""

    def __init__(self, store: TenantStore, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock
        self._insert = pg_insert if store.backend == "postgresql" else sqlite_insert

    async def _bump(self, s, tenant_id: int, kind: str, window: int, delta: int, limit: int | None) -> int | None:
        """Add ``delta`` to one counter if the result stays within ``limit``; the new value, or None if refused."""
        if limit is not None and delta > limit:
            return None  # a fresh row would be inserted unchecked, so refuse before touching the table
        ins = self._insert(QuotaCounter).values(tenant_id=tenant_id, kind=kind, window=window, value=delta)
        new_value = QuotaCounter.value + ins.excluded.value
        stmt = ins.on_conflict_do_update(
            index_elements=[QuotaCounter.tenant_id, QuotaCounter.kind, QuotaCounter.window],
            set_={"value": new_value},
            where=(new_value <= limit) if limit is not None else None,
        ).returning(QuotaCounter.value)
        return (await s.execute(stmt)).scalar_one_or_none()

    async def _value(self, s, tenant_id: int, kind: str, window: int) -> int:
        v = await s.scalar(select(QuotaCounter.value).where(
            QuotaCounter.tenant_id == tenant_id, QuotaCounter.kind == kind, QuotaCounter.window == window))
        return int(v or 0)

    async def try_acquire(self, tenant_id: int, requests: int = 1, tokens: int = 0,
                          batch: bool = False) -> Granted | Denied:
        """Reserve ``requests`` and ``tokens`` (prompt + max new tokens) for a tenant, or say why not."""
        if requests < 0 or tokens < 0:
            raise ValueError("requests and tokens must be >= 0")
        now = self.clock()
        minute = int(now // 60 * 60)
        today = datetime.fromtimestamp(now, timezone.utc).date()
        day, month = _epoch(today), _epoch(today.replace(day=1))
        try:
            async with self.store.sessions.begin() as s:
                row = (await s.execute(
                    select(Tenant.status, Quota).outerjoin(Quota, Quota.tenant_id == Tenant.id)
                    .where(Tenant.id == tenant_id)
                )).first()
                if row is None:
                    raise NotFound(f"unknown tenant id {tenant_id}")
                status, q = row
                cfg = QuotaConfig() if q is None else QuotaConfig(
                    q.requests_per_minute, q.tokens_per_minute, q.max_concurrency, q.max_tokens_per_request,
                    q.daily_tokens, q.monthly_tokens, q.max_batch_queue_tokens, q.batch_discount)
                if status != "active":
                    return Denied("disabled", None, 0, 0, None)
                if cfg.max_tokens_per_request is not None and tokens > cfg.max_tokens_per_request:
                    return Denied("max_tokens", None, cfg.max_tokens_per_request, cfg.max_tokens_per_request, None)
                billed = cfg.billed(tokens, batch)
                day_end = _epoch(date.fromordinal(today.toordinal() + 1))
                # (reason, kind, window, delta, limit, reset at): always this order, so concurrent
                # acquires lock counter rows in the same order and cannot deadlock.
                checks = [
                    ("rpm", "rpm", minute, requests, cfg.requests_per_minute, minute + 60),
                    ("tpm", "tpm", minute, tokens, cfg.tokens_per_minute, minute + 60),
                    ("concurrency", "conc", CONCURRENCY_WINDOW, requests, cfg.max_concurrency, None),
                    ("daily_tokens", "day", day, billed, cfg.daily_tokens, day_end),
                    ("monthly_tokens", "month", month, billed, cfg.monthly_tokens, _epoch(next_month(today))),
                ]
                windows: dict[str, tuple[int, int, float]] = {}
                for reason, kind, window, delta, limit, reset_at in checks:
                    # Unlimited per-minute counters are skipped (nothing reads them); the concurrency and
                    # budget counters are always kept so a limit set later starts from the truth.
                    if limit is None and kind in ("rpm", "tpm"):
                        continue
                    value = await self._bump(s, tenant_id, kind, window, delta, limit)
                    if value is not None and kind in ("rpm", "tpm"):
                        windows[kind] = (int(limit), max(0, int(limit) - int(value)), max(0.0, reset_at - now))
                    if value is None:
                        used = await self._value(s, tenant_id, kind, window)
                        reset_s = None if reset_at is None else max(0.0, reset_at - now)
                        retry = CONCURRENCY_RETRY_S if reset_s is None else reset_s
                        if delta > limit:
                            retry = None  # bigger than the whole limit: waiting will not help
                        # Raising rolls back the counters this acquire already bumped.
                        raise _Refused(Denied(reason, retry, int(limit), max(0, int(limit) - used), reset_s))
                return Granted(tenant_id, requests, tokens, billed, batch, cfg.batch_discount, minute, day, month,
                               True, windows)
        except _Refused as refused:
            return refused.denied

    async def settle(self, grant: Granted, usage: UsageRecord) -> int:
        """Replace the reservation by the actual usage and append it to the ledger; returns billed tokens."""
        if usage.tenant_id != grant.tenant_id:
            raise ValueError("usage is for another tenant than the grant")
        actual = usage.prompt_tokens + usage.completion_tokens
        cfg = QuotaConfig(batch_discount=grant.batch_discount)
        billed = cfg.billed(actual, grant.batch)
        row = TenantStore.usage_row(replace(usage, batch=grant.batch), billed)
        async with self.store.sessions.begin() as s:
            await self._give_back(s, grant, actual, billed)
            s.add(row)
        return billed

    async def release(self, grant: Granted) -> None:
        """Cancel a reservation for a request that never ran (nothing is billed, nothing is logged)."""
        async with self.store.sessions.begin() as s:
            await self._give_back(s, grant, 0, 0)

    async def _give_back(self, s, grant: Granted, actual: int, billed: int) -> None:
        t = grant.tenant_id
        # Same counter order as try_acquire (rpm is never given back: the request did happen).
        await self._bump(s, t, "tpm", grant.minute, actual - grant.tokens, None)
        await self._bump(s, t, "conc", CONCURRENCY_WINDOW, -grant.requests, None)
        await self._bump(s, t, "day", grant.day, billed - grant.billed, None)
        await self._bump(s, t, "month", grant.month, billed - grant.billed, None)

    async def counter(self, tenant_id: int, kind: str, window: int) -> int:
        async with self.store.sessions() as s:
            return await self._value(s, tenant_id, kind, window)

    async def reserve_batch_queue(self, tenant_id: int, tokens: int) -> Granted | Denied:
        """Hold ``tokens`` of the tenant's queued-batch allowance (``max_batch_queue_tokens``)."""
        try:
            async with self.store.sessions.begin() as s:
                limit = await s.scalar(select(Quota.max_batch_queue_tokens).where(Quota.tenant_id == tenant_id))
                if await self._bump(s, tenant_id, "bq", 0, tokens, limit) is None:
                    used = await self._value(s, tenant_id, "bq", 0)
                    retry = None if tokens > limit else CONCURRENCY_RETRY_S
                    raise _Refused(Denied("batch_queue_tokens", retry, int(limit), max(0, int(limit) - used), None))
                return Granted(tenant_id, 0, tokens, 0, True, 0.0, 0, 0, 0, False)
        except _Refused as refused:
            return refused.denied

    async def release_batch_queue(self, tenant_id: int, tokens: int) -> None:
        async with self.store.sessions.begin() as s:
            await self._bump(s, tenant_id, "bq", 0, -tokens, None)
