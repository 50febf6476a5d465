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

Only limited counters are touched at acquire time: a tenant with no limits is
admitted without any database work, and its settles (batched by the gateway's
usage ledger, ``settle_many``) still add the billed tokens to the daily and
monthly counters, so a budget set later starts from the truth. Limits and
tenant status are cached for ``policy_ttl_s`` (0 = read on every acquire).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from datetime import date, datetime, timezone
from typing import Callable

from sqlalchemy import BigInteger, bindparam, insert, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from tenants.models import Quota, QuotaCounter, Tenant, Usage
from tenants.store import NotFound, QuotaConfig, TenantStore, UsageRecord, _quota_config, next_month
from tenants.ttl_cache import RefreshingCache

CONCURRENCY_WINDOW = 0
CONCURRENCY_RETRY_S = 1.0  # nobody knows when an in-flight request ends; ask clients to come back soon


def _counter_upserts(dialect_insert):
    """The counter upsert, built once per manager: (unchecked, checked against the ``upper`` parameter).

    Each returns the counter's new value, or no row where the checked one refused. Built from the
    Core table with the values as execution parameters, so a bump builds no statement: building one
    per call (``excluded`` is a fresh alias of the table, with reference cycles) cost event-loop time
    and fed the cyclic garbage collector on every acquire and ledger flush.
    """
    table = QuotaCounter.__table__
    stmts = []
    for checked in (False, True):
        ins = dialect_insert(table)
        new_value = table.c.value + ins.excluded.value
        stmts.append(ins.on_conflict_do_update(
            index_elements=[table.c.tenant_id, table.c.kind, table.c.window],
            set_={"value": new_value},
            where=(new_value <= bindparam("upper", type_=BigInteger)) if checked else None,
        ).returning(table.c.value))
    return tuple(stmts)


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
    day_reserved: bool = True  # whether ``billed`` was reserved on the daily counter (only when it is limited)
    month_reserved: bool = True
    cache_share: float | None = None  # the tenant's share of the engine's prefix-cache tiers (QuotaConfig)


@dataclass(slots=True, frozen=True)
class Denied:
    """Why not, and when to retry; ``retry_after_s`` is None when retrying cannot help."""

    reason: str  # rpm | tpm | concurrency | daily_tokens | monthly_tokens | max_tokens | disabled
    retry_after_s: float | None
    limit: int
    remaining: int
    reset_s: float | None


_KIND_ORDER = ("rpm", "tpm", "conc", "day", "month")  # the order every transaction bumps a tenant's counters in


def _needs_counters(cfg: QuotaConfig) -> bool:
    """Whether admitting needs the database: some limit is checked against a shared counter."""
    return any(v is not None for v in (cfg.requests_per_minute, cfg.tokens_per_minute, cfg.max_concurrency,
                                       cfg.daily_tokens, cfg.monthly_tokens))


class _Refused(Exception):
    def __init__(self, denied: Denied | Granted) -> None:
        self.denied = denied  # a Granted: a dry run's answer, its counters rolled back


def _epoch(d: date) -> int:
    return int(datetime(d.year, d.month, d.day, tzinfo=timezone.utc).timestamp())


class QuotaManager:
    """Admission by quota for one store; ``clock`` returns epoch seconds (tests freeze it)."""

    def __init__(self, store: TenantStore, clock: Callable[[], float] = time.time, policy_ttl_s: float = 0.0) -> None:
        self.store = store
        self.clock = clock
        self.policy_ttl_s = policy_ttl_s
        # tenant -> (status, limits), when ``policy_ttl_s`` > 0 (how long a changed quota may take to apply)
        self._policy = RefreshingCache(policy_ttl_s) if policy_ttl_s > 0 else None
        self._upsert, self._upsert_within = _counter_upserts(pg_insert if store.backend == "postgresql" else sqlite_insert)

    async def _load_policy(self, tenant_id: int) -> tuple[str, QuotaConfig]:
        async with self.store.sessions() as s:
            return await self._read_policy(s, tenant_id)

    async def _read_policy(self, s, tenant_id: int) -> tuple[str, QuotaConfig]:
        """(status, limits) of a tenant, read in session ``s``."""
        row = (await s.execute(
            select(Tenant.status, Quota).outerjoin(Quota, Quota.tenant_id == Tenant.id).where(Tenant.id == tenant_id)
        )).first()
        if row is None:
            raise NotFound(f"unknown tenant id {tenant_id}")
        status, q = row
        return status, _quota_config(q)

    async def _bump(self, s, tenant_id: int, kind: str, window: int, delta: int, limit: int | None) -> int | None:
        """Add ``delta`` to one counter if the result stays within ``limit``; the new value, or None if refused."""
        if limit is not None and delta > limit:
            return None  # a fresh row would be inserted unchecked, so refuse before touching the table
        row = {"tenant_id": tenant_id, "kind": kind, "window": window, "value": delta}
        if limit is None:
            return (await s.execute(self._upsert, row)).scalar_one_or_none()
        return (await s.execute(self._upsert_within, {**row, "upper": limit})).scalar_one_or_none()

    async def _value(self, s, tenant_id: int, kind: str, window: int) -> int:
        v = await s.scalar(select(QuotaCounter.value).where(
            QuotaCounter.tenant_id == tenant_id, QuotaCounter.kind == kind, QuotaCounter.window == window))
        return int(v or 0)

    async def limits(self, tenant_id: int) -> QuotaConfig:
        """The tenant's limits, through the policy cache."""
        load = lambda: self._load_policy(tenant_id)  # noqa: E731
        status_cfg = await (self._policy.get(tenant_id, load) if self._policy is not None else load())
        return status_cfg[1]

    async def cache_share(self, tenant_id: int) -> float | None:
        """The tenant's share of the engine's prefix-cache tiers (None: shared LRU), through the policy cache."""
        return (await self.limits(tenant_id)).cache_share

    def try_acquire_cached(self, tenant_id: int, requests: int = 1, tokens: int = 0,
                           batch: bool = False) -> Granted | Denied | None:
        """``try_acquire``'s answer where the cached policy alone decides it (an active tenant with no
        limit counted in the database), without awaiting; None where ``try_acquire`` must run.

        Saves the gateway a task and a turn of the event loop per request of such a tenant.
        """
        if self._policy is None or requests < 0 or tokens < 0:
            return None
        hit = self._policy.cached(tenant_id, lambda: self._load_policy(tenant_id))
        return None if hit is None else self._admit_uncounted(hit[0], tenant_id, requests, tokens, batch)

    def _admit_uncounted(self, policy: tuple[str, QuotaConfig], tenant_id: int, requests: int, tokens: int,
                         batch: bool) -> Granted | Denied | None:
        status, cfg = policy
        if status != "active" or _needs_counters(cfg):
            return None
        # No limit to check: nothing to write until the settle (which the ledger batches).
        if cfg.max_tokens_per_request is not None and tokens > cfg.max_tokens_per_request:
            return Denied("max_tokens", None, cfg.max_tokens_per_request, cfg.max_tokens_per_request, None)
        minute, day, month, _, _ = self._windows()
        return Granted(tenant_id, requests, tokens, cfg.billed(tokens, batch), batch, cfg.batch_discount,
                       minute, day, month, False, {}, day_reserved=False, month_reserved=False,
                       cache_share=cfg.cache_share)

    def _windows(self) -> tuple[int, int, int, date, float]:
        """(minute, day, month window starts, today, now) at this moment."""
        now = self.clock()
        today = datetime.fromtimestamp(now, timezone.utc).date()
        return int(now // 60 * 60), _epoch(today), _epoch(today.replace(day=1)), today, now

    async def try_acquire(self, tenant_id: int, requests: int = 1, tokens: int = 0,
                          batch: bool = False, dry_run: bool = False) -> Granted | Denied:
        """Reserve ``requests`` and ``tokens`` (prompt + max new tokens) for a tenant, or say why not.
        ``dry_run``: only say (the counters' transaction is rolled back; nothing to release)."""
        if requests < 0 or tokens < 0:
            raise ValueError("requests and tokens must be >= 0")
        policy = None
        if self._policy is not None:
            policy = await self._policy.get(tenant_id, lambda: self._load_policy(tenant_id))
            admitted = self._admit_uncounted(policy, tenant_id, requests, tokens, batch)
            if admitted is not None:
                return admitted
        minute, day, month, today, now = self._windows()
        try:
            async with self.store.sessions.begin() as s:
                # Cached limits (when a TTL is set) or the limits as of this transaction.
                status, cfg = policy if policy is not None else await self._read_policy(s, tenant_id)
                if status != "active":
                    return Denied("disabled", None, 0, 0, None)
                if cfg.max_tokens_per_request is not None and tokens > cfg.max_tokens_per_request:
                    return Denied("max_tokens", None, cfg.max_tokens_per_request, cfg.max_tokens_per_request, None)
                billed = cfg.billed(tokens, batch)
                day_end = _epoch(date.fromordinal(today.toordinal() + 1))
                # (reason, kind, window, delta, limit, reset at): always this order, so concurrent
                # acquires lock counter rows in the same order and cannot deadlock. Unlimited counters
                # are skipped: the settle brings the budget counters up to date, and nothing reads the others.
                checks = [
                    ("rpm", "rpm", minute, requests, cfg.requests_per_minute, minute + 60),
                    ("tpm", "tpm", minute, tokens, cfg.tokens_per_minute, minute + 60),
                    ("concurrency", "conc", CONCURRENCY_WINDOW, requests, cfg.max_concurrency, None),
                    ("daily_tokens", "day", day, billed, cfg.daily_tokens, day_end),
                    ("monthly_tokens", "month", month, billed, cfg.monthly_tokens, _epoch(next_month(today))),
                ]
                windows: dict[str, tuple[int, int, float]] = {}
                for reason, kind, window, delta, limit, reset_at in checks:
                    if limit is None:
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
                granted = Granted(tenant_id, requests, tokens, billed, batch, cfg.batch_discount, minute, day, month,
                                  cfg.max_concurrency is not None, windows, day_reserved=cfg.daily_tokens is not None,
                                  month_reserved=cfg.monthly_tokens is not None, cache_share=cfg.cache_share)
                if dry_run:
                    raise _Refused(granted)  # rolls back what this call bumped
                return granted
        except _Refused as refused:
            return refused.denied

    async def settle(self, grant: Granted, usage: UsageRecord) -> int:
        """Replace the reservation by the actual usage and append it to the ledger; returns billed tokens."""
        return (await self.settle_many([(grant, usage)]))[0]

    async def settle_many(self, items: list[tuple[Granted, UsageRecord | None]]) -> list[int]:
        """Settle (usage given) or release (usage None) many grants in one transaction; billed tokens of each.

        Counter corrections are summed per counter row first, then applied in one fixed order
        (tenant, then the order ``try_acquire`` uses), so a flush and acquires never deadlock.
        """
        deltas: dict[tuple[int, int, int], int] = {}  # (tenant, kind order, window) -> change
        rows, billed_each = [], []

        def add(tenant: int, kind: int, window: int, change: int) -> None:
            if change:
                deltas[(tenant, kind, window)] = deltas.get((tenant, kind, window), 0) + change

        for grant, usage in items:
            actual = billed = 0
            if usage is not None:
                if usage.tenant_id != grant.tenant_id:
                    raise ValueError("usage is for another tenant than the grant")
                actual = usage.prompt_tokens + usage.completion_tokens
                billed = QuotaConfig(batch_discount=grant.batch_discount).billed(actual, grant.batch)
                rows.append(TenantStore.usage_values(replace(usage, batch=grant.batch), billed))
            billed_each.append(billed)
            t = grant.tenant_id
            # rpm is never given back (the request did happen); tpm only where it was reserved.
            if grant.windows.get("tpm") is not None:
                add(t, 1, grant.minute, actual - grant.tokens)
            if grant.concurrent:
                add(t, 2, CONCURRENCY_WINDOW, -grant.requests)
            add(t, 3, grant.day, billed - (grant.billed if grant.day_reserved else 0))
            add(t, 4, grant.month, billed - (grant.billed if grant.month_reserved else 0))
        if not deltas and not rows:
            return billed_each
        async with self.store.sessions.begin() as s:
            for (tenant, kind, window), change in sorted(deltas.items()):
                await self._bump(s, tenant, _KIND_ORDER[kind], window, change, None)
            if rows:
                # The Core table, not the mapped class: an executemany with no ORM bulk-insert bookkeeping.
                await s.execute(insert(Usage.__table__), rows)
        return billed_each

    async def release(self, grant: Granted) -> None:
        """Cancel a reservation for a request that never ran (nothing is billed, nothing is logged)."""
        await self.settle_many([(grant, None)])

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

    def add_billed(self, c, tenant_id: int, billed: int) -> None:
        """On synchronous connection ``c`` (``SyncTransactions``): add settled billed tokens (no reservation
        behind them) to today's budgets."""
        today = datetime.fromtimestamp(self.clock(), timezone.utc).date()
        for kind, window in (("day", _epoch(today)), ("month", _epoch(today.replace(day=1)))):
            c.execute(self._upsert, {"tenant_id": tenant_id, "kind": kind, "window": window, "value": billed})

    async def bump_batch_queue(self, s, tenant_id: int, tokens: int) -> None:
        """In session ``s``: change the tenant's queued batch tokens (negative to give back)."""
        await self._bump(s, tenant_id, "bq", 0, tokens, None)

    async def release_batch_queue(self, tenant_id: int, tokens: int) -> None:
        async with self.store.sessions.begin() as s:
            await self._bump(s, tenant_id, "bq", 0, -tokens, None)
