"""The tenant store: async CRUD over tenants, keys, quotas, classes and the usage ledger.

Every public method is one transaction: it either commits all its rows or
none. Methods return plain frozen dataclasses (never live ORM objects), so
callers can keep them after the session is gone. Bad input raises
``StoreError`` (a ``ValueError``) with a one-line message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from datetime import date, datetime, timedelta

from sqlalchemy import case, func, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from tenants import keys as keylib
from tenants.db import backend, create_engine_for
from tenants.models import (
    DEFAULT_MAX_STORED_FILE_BYTES, DEFAULT_STORED_RESPONSE_BYTES, QUOTA_LIMIT_FIELDS, ApiKey, Deployment, PriorityClass,
    Quota, Tenant, Usage, utcnow,
)
from tenants.names import valid_name
from tenants.policy import ClassInfo


class StoreError(ValueError):
    """Bad input to the store; the message is one line meant for a user."""


class NotFound(StoreError):
    pass


class Conflict(StoreError):
    pass


def _checked(kind: str, value: str, column) -> str:
    """``value`` checked against its column's length and tenants.names' rules, as a StoreError."""
    try:
        return valid_name(kind, value, column.type.length)
    except ValueError as e:
        raise StoreError(str(e)) from None


@dataclass(slots=True, frozen=True)
class TenantInfo:
    id: int
    name: str
    priority_class: str
    weight: float
    status: str
    created_at: datetime
    updated_at: datetime


@dataclass(slots=True, frozen=True)
class KeyInfo:
    id: int
    tenant_id: int
    tenant: str
    label: str | None
    prefix: str
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None
    expires_at: datetime | None = None


@dataclass(slots=True, frozen=True)
class QuotaConfig:
    """A tenant's limits; ``None`` means unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrency: int | None = None
    max_tokens_per_request: int | None = None
    daily_tokens: int | None = None
    monthly_tokens: int | None = None
    max_batch_queue_tokens: int | None = None
    batch_discount: float = 0.5
    # Share (0 < s <= 1) of each engine's host and disk prefix-cache tiers (and of its vision-encoder cache) the
    # tenant's blocks (images) may hold; past it, its new ones evict its own oldest ones. None: the tiers are one
    # LRU shared by every tenant (the encoder cache applies the engine's --encoder-cache-tenant-share).
    cache_share: float | None = None
    # Bytes the tenant's stored files (/v1/files) may take together; None: no cap.
    max_stored_file_bytes: int | None = DEFAULT_MAX_STORED_FILE_BYTES
    # Bytes of stored Responses API responses the tenant may keep; past it, a response asking to be stored is
    # refused (a 400 saying to delete old ones or send store: false). None: no limit.
    stored_response_bytes: int | None = DEFAULT_STORED_RESPONSE_BYTES
    # Images one chat request may carry, and decoded pixels (width x height) one image may have; None: the
    # gateway's limits (--max-images-per-request, --max-image-pixels). A tenant's limit only tightens the
    # gateway's: the lower of the two applies.
    max_images_per_request: int | None = None
    max_image_pixels: int | None = None

    def __post_init__(self) -> None:
        for name in QUOTA_LIMIT_FIELDS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise StoreError(f"{name} must be a non-negative integer or none, got {value!r}")
        if not (isinstance(self.batch_discount, (int, float)) and 0 <= self.batch_discount <= 1):
            raise StoreError(f"batch_discount must be between 0 and 1, got {self.batch_discount!r}")
        if self.cache_share is not None and not (
                isinstance(self.cache_share, (int, float)) and not isinstance(self.cache_share, bool)
                and 0 < self.cache_share <= 1):
            raise StoreError(f"cache_share must be greater than 0 and at most 1 (or none), got {self.cache_share!r}")

    def billed(self, tokens: int, batch: bool) -> int:
        """Tokens charged against budgets: batch requests pay the discounted share, rounded up."""
        return math.ceil(tokens * self.batch_discount) if batch else tokens


@dataclass(slots=True, frozen=True)
class UsageRecord:
    """One finished request, as the gateway reports it."""

    tenant_id: int
    request_id: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0
    key_id: int | None = None
    batch: bool = False
    finish_reason: str | None = None
    http_status: int = 200
    started_at: datetime | None = None
    finished_at: datetime | None = None
    adapter: str | None = None  # the LoRA adapter the request ran under (its ``model``); None: the base model
    priority_class: str | None = None  # the class it ran in
    slo_met: bool | None = None  # whether it met its class's objectives; None: the class had none


USAGE_GROUPS = ("day", "key", "model", "adapter", "tenant", "class")


def _tenant_info(t: Tenant) -> TenantInfo:
    return TenantInfo(t.id, t.name, t.priority_class, t.weight, t.status, t.created_at, t.updated_at)


def _class_info(c: PriorityClass) -> ClassInfo:
    return ClassInfo(c.name, c.priority, c.default_weight, c.preemptible, c.may_preempt, c.ttft_slo_ms, c.itl_slo_ms,
                     c.slo_action)


def _quota_config(q: Quota | None) -> QuotaConfig:
    if q is None:
        return QuotaConfig()
    return QuotaConfig(**{f.name: getattr(q, f.name) for f in fields(QuotaConfig)})


class TenantStore:
    """Async access to the tenants schema (which must already be migrated)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.backend = engine.dialect.name
        self.sessions = async_sessionmaker(engine, expire_on_commit=False)

    @classmethod
    def open(cls, url: str, **engine_kwargs) -> TenantStore:
        backend(url)  # validates the URL before any connection is tried
        return cls(create_engine_for(url, **engine_kwargs))

    async def close(self) -> None:
        await self.engine.dispose()

    # -- tenants -----------------------------------------------------------------------------------------

    async def _tenant(self, s: AsyncSession, ref: str | int) -> Tenant:
        cond = Tenant.id == ref if isinstance(ref, int) else Tenant.name == ref
        tenant = (await s.execute(select(Tenant).where(cond))).scalar_one_or_none()
        if tenant is None:
            raise NotFound(f"unknown tenant {ref!r}")
        return tenant

    async def _class(self, s: AsyncSession, name: str) -> PriorityClass:
        cls_ = await s.get(PriorityClass, name)
        if cls_ is None:
            raise NotFound(f"unknown priority class {name!r}")
        return cls_

    async def create_tenant(self, name: str, priority_class: str = "standard", weight: float | None = None) -> TenantInfo:
        """Create a tenant (and its empty, unlimited quota row); the weight defaults to the class's."""
        name = _checked("tenant name", name, Tenant.name)
        if weight is not None and not weight > 0:
            raise StoreError(f"weight must be > 0, got {weight}")
        async with self.sessions.begin() as s:
            cls_ = await self._class(s, priority_class)
            if (await s.execute(select(Tenant.id).where(Tenant.name == name))).first():
                raise Conflict(f"tenant {name!r} already exists")
            now = utcnow()
            tenant = Tenant(name=name, priority_class=cls_.name, weight=weight or cls_.default_weight,
                            status="active", created_at=now, updated_at=now)
            s.add(tenant)
            await self._flush_unique(s, f"tenant {name!r} already exists")
            s.add(Quota(tenant_id=tenant.id, batch_discount=0.5))
            return _tenant_info(tenant)

    async def _flush_unique(self, s: AsyncSession, message: str) -> None:
        # A concurrent writer can win the race past our existence check; the unique index decides.
        try:
            await s.flush()
        except IntegrityError as e:
            raise Conflict(message) from e

    async def get_tenant(self, ref: str | int) -> TenantInfo:
        async with self.sessions() as s:
            return _tenant_info(await self._tenant(s, ref))

    async def list_tenants(self) -> list[TenantInfo]:
        async with self.sessions() as s:
            rows = (await s.execute(select(Tenant).order_by(Tenant.name))).scalars()
            return [_tenant_info(t) for t in rows]

    async def cache_salt(self, tenant_id: int) -> str:
        """The tenant's secret prefix-cache salt (``RequestPolicy.cache_salt``); NotFound for an unknown id. Never
        part of ``TenantInfo``, so nothing that shows tenants shows it."""
        async with self.sessions() as s:
            salt = await s.scalar(select(Tenant.cache_salt).where(Tenant.id == tenant_id))
        if salt is None:
            raise NotFound(f"unknown tenant id {tenant_id}")
        return salt

    async def deployment_id(self) -> str:
        """This database's random identity (written by its migrations): what engines' disk prefix-cache tiers
        record, so a server on another database never reads their files."""
        async with self.sessions() as s:
            found = await s.scalar(select(Deployment.id))
        if found is None:
            raise StoreError("the database has no deployment identity: run `moegate db upgrade`")
        return found

    async def update_tenant(self, ref: str | int, *, name: str | None = None, priority_class: str | None = None,
                            weight: float | None = None) -> TenantInfo:
        if weight is not None and not weight > 0:
            raise StoreError(f"weight must be > 0, got {weight}")
        if name is not None:
            name = _checked("tenant name", name, Tenant.name)
        async with self.sessions.begin() as s:
            tenant = await self._tenant(s, ref)
            if priority_class is not None:
                tenant.priority_class = (await self._class(s, priority_class)).name
            if weight is not None:
                tenant.weight = weight
            if name is not None and name != tenant.name:
                if (await s.execute(select(Tenant.id).where(Tenant.name == name))).first():
                    raise Conflict(f"tenant {name!r} already exists")
                tenant.name = name
            tenant.updated_at = utcnow()
            await self._flush_unique(s, f"tenant {name!r} already exists")
            return _tenant_info(tenant)

    async def set_tenant_status(self, ref: str | int, active: bool) -> TenantInfo:
        async with self.sessions.begin() as s:
            tenant = await self._tenant(s, ref)
            tenant.status = "active" if active else "disabled"
            tenant.updated_at = utcnow()
            return _tenant_info(tenant)

    # -- keys --------------------------------------------------------------------------------------------

    async def create_key(self, tenant_ref: str | int, label: str | None = None,
                         expires_at: datetime | None = None) -> tuple[KeyInfo, str]:
        """Make a new key (valid until ``expires_at``, naive UTC, if given); the returned plaintext is the
        only copy that will ever exist."""
        if expires_at is not None and expires_at <= utcnow():
            raise ValueError("a key's expiry must be in the future")
        if label is not None:
            label = _checked("key label", label, ApiKey.label)
        plaintext = keylib.generate_key()
        async with self.sessions.begin() as s:
            tenant = await self._tenant(s, tenant_ref)
            key = ApiKey(tenant_id=tenant.id, label=label, prefix=keylib.display_prefix(plaintext),
                         key_hash=keylib.hash_key(plaintext), created_at=utcnow(), expires_at=expires_at)
            s.add(key)
            await s.flush()
            return self._key_info(key, tenant.name), plaintext

    @staticmethod
    def _key_info(k: ApiKey, tenant_name: str) -> KeyInfo:
        return KeyInfo(k.id, k.tenant_id, tenant_name, k.label, k.prefix, k.created_at, k.last_used_at, k.revoked_at,
                       k.expires_at)

    async def list_keys(self, tenant_ref: str | int | None = None, include_revoked: bool = True) -> list[KeyInfo]:
        async with self.sessions() as s:
            q = select(ApiKey, Tenant.name).join(Tenant, Tenant.id == ApiKey.tenant_id).order_by(ApiKey.id)
            if tenant_ref is not None:
                q = q.where(ApiKey.tenant_id == (await self._tenant(s, tenant_ref)).id)
            if not include_revoked:
                q = q.where(ApiKey.revoked_at.is_(None))
            return [self._key_info(k, name) for k, name in (await s.execute(q)).all()]

    async def revoke_key(self, ref: int | str) -> KeyInfo:
        """Revoke by id or by display prefix (which must then match exactly one live key)."""
        async with self.sessions.begin() as s:
            q = select(ApiKey, Tenant.name).join(Tenant, Tenant.id == ApiKey.tenant_id)
            if isinstance(ref, int):
                rows = (await s.execute(q.where(ApiKey.id == ref))).all()
            else:
                rows = (await s.execute(q.where(ApiKey.prefix == ref, ApiKey.revoked_at.is_(None)))).all()
            if not rows:
                raise NotFound(f"unknown api key {ref!r}")
            if len(rows) > 1:
                raise StoreError(f"api key prefix {ref!r} is ambiguous: revoke by id")
            key, tenant_name = rows[0]
            if key.revoked_at is None:
                key.revoked_at = utcnow()
            return self._key_info(key, tenant_name)

    async def authenticate(self, plaintext: str, include_disabled: bool = False) -> tuple[TenantInfo, KeyInfo] | None:
        """The tenant and key for a presented key, or None if unknown, revoked or the tenant is disabled.

        With ``include_disabled`` a disabled tenant's key still resolves (the gateway answers 403, not 401).
        """
        if not keylib.looks_like_key(plaintext):
            return None
        async with self.sessions.begin() as s:
            row = (await s.execute(
                select(ApiKey, Tenant).join(Tenant, Tenant.id == ApiKey.tenant_id)
                .where(ApiKey.key_hash == keylib.hash_key(plaintext))
            )).first()
            if row is None:
                return None
            key, tenant = row
            if key.revoked_at is not None or (tenant.status != "active" and not include_disabled):
                return None
            if key.expires_at is not None and key.expires_at <= utcnow():
                return None
            key.last_used_at = utcnow()
            return _tenant_info(tenant), self._key_info(key, tenant.name)

    # -- quotas ------------------------------------------------------------------------------------------

    async def get_quota(self, tenant_ref: str | int) -> QuotaConfig:
        async with self.sessions() as s:
            tenant = await self._tenant(s, tenant_ref)
            return _quota_config(await s.get(Quota, tenant.id))

    async def set_quota(self, tenant_ref: str | int, **changes: int | float | None) -> QuotaConfig:
        """Change only the named limits; a value of None makes that limit unlimited."""
        unknown = set(changes) - {f.name for f in fields(QuotaConfig)}
        if unknown:
            raise StoreError(f"unknown quota field(s): {', '.join(sorted(unknown))}")
        if changes.get("max_image_pixels") == 0:  # the server's --max-image-pixels takes 1 and up, as here
            raise StoreError("max_image_pixels must be at least 1 (or none); to refuse a tenant's images, set "
                             "max_images_per_request to 0")
        if changes.get("batch_discount", 0.5) is None:
            changes["batch_discount"] = 0.5  # "none" on the discount means back to the default
        async with self.sessions.begin() as s:
            tenant = await self._tenant(s, tenant_ref)
            row = await s.get(Quota, tenant.id)
            current = _quota_config(row)
            merged = QuotaConfig(**{f.name: changes.get(f.name, getattr(current, f.name)) for f in fields(QuotaConfig)})
            if row is None:
                row = Quota(tenant_id=tenant.id)
                s.add(row)
            for f in fields(QuotaConfig):
                setattr(row, f.name, getattr(merged, f.name))
            return merged

    # -- priority classes --------------------------------------------------------------------------------

    async def list_classes(self) -> list[ClassInfo]:
        async with self.sessions() as s:
            rows = (await s.execute(select(PriorityClass).order_by(PriorityClass.priority, PriorityClass.name))).scalars()
            return [_class_info(c) for c in rows]

    async def get_class(self, name: str) -> ClassInfo:
        async with self.sessions() as s:
            return _class_info(await self._class(s, name))

    async def create_class(self, name: str, priority: int, default_weight: float = 1.0, preemptible: bool = True,
                           may_preempt: bool = False) -> ClassInfo:
        info = self._valid_class(name, priority, default_weight, preemptible, may_preempt)
        async with self.sessions.begin() as s:
            if await s.get(PriorityClass, info.name) is not None:
                raise Conflict(f"priority class {info.name!r} already exists")
            s.add(PriorityClass(name=info.name, priority=info.priority, default_weight=info.default_weight,
                                preemptible=info.preemptible, may_preempt=info.may_preempt))
            await self._flush_unique(s, f"priority class {info.name!r} already exists")
            return info

    @staticmethod
    def _valid_class(name, priority, default_weight, preemptible, may_preempt) -> ClassInfo:
        try:
            return ClassInfo(_checked("class name", name, PriorityClass.name), priority, default_weight, preemptible,
                             may_preempt)
        except ValueError as e:
            raise StoreError(str(e)) from e

    async def update_class(self, name: str, *, priority: int | None = None, default_weight: float | None = None,
                           preemptible: bool | None = None, may_preempt: bool | None = None) -> ClassInfo:
        async with self.sessions.begin() as s:
            c = await self._class(s, name)
            info = self._valid_class(
                c.name,
                c.priority if priority is None else priority,
                c.default_weight if default_weight is None else default_weight,
                c.preemptible if preemptible is None else preemptible,
                c.may_preempt if may_preempt is None else may_preempt,
            )
            c.priority, c.default_weight, c.preemptible, c.may_preempt = (
                info.priority, info.default_weight, info.preemptible, info.may_preempt)
            return _class_info(c)

    async def set_class_objectives(self, name: str, **changes) -> ClassInfo:
        """Change a class's objectives: any of ``ttft_slo_ms``, ``itl_slo_ms`` (None clears one) and
        ``slo_action``; what is not named stays."""
        unknown = set(changes) - {"ttft_slo_ms", "itl_slo_ms", "slo_action"}
        if unknown:
            raise StoreError(f"unknown objective setting(s): {', '.join(sorted(unknown))}")
        async with self.sessions.begin() as s:
            c = await self._class(s, name)
            current = _class_info(c)
            try:
                info = ClassInfo(current.name, current.priority, current.default_weight, current.preemptible,
                                 current.may_preempt, **{k: changes.get(k, getattr(current, k))
                                                         for k in ("ttft_slo_ms", "itl_slo_ms", "slo_action")})
            except ValueError as e:
                raise StoreError(str(e)) from e
            c.ttft_slo_ms, c.itl_slo_ms, c.slo_action = info.ttft_slo_ms, info.itl_slo_ms, info.slo_action
            return info

    # -- usage ledger ------------------------------------------------------------------------------------

    @staticmethod
    def usage_values(record: UsageRecord, billed_tokens: int) -> dict:
        """The ``usage`` table row of one record, as plain values (for a Core bulk insert)."""
        for name in ("prompt_tokens", "completion_tokens", "cached_prompt_tokens"):
            if getattr(record, name) < 0:
                raise StoreError(f"{name} must be >= 0")
        finished = record.finished_at or utcnow()
        return dict(
            tenant_id=record.tenant_id, key_id=record.key_id, request_id=record.request_id, model=record.model,
            prompt_tokens=record.prompt_tokens, cached_prompt_tokens=record.cached_prompt_tokens,
            completion_tokens=record.completion_tokens, billed_tokens=billed_tokens, batch=record.batch,
            finish_reason=record.finish_reason, http_status=record.http_status, adapter=record.adapter,
            priority_class=record.priority_class, slo_met=record.slo_met,
            started_at=record.started_at or finished, finished_at=finished, day=finished.date(),
        )

    async def record_usage(self, records: list[UsageRecord]) -> None:
        """Append finished requests to the ledger (billing at each tenant's batch discount), in one transaction."""
        if not records:
            return
        async with self.sessions.begin() as s:
            discounts = dict((await s.execute(
                select(Quota.tenant_id, Quota.batch_discount)
                .where(Quota.tenant_id.in_({r.tenant_id for r in records}))
            )).all())
            rows = [self.usage_values(r, QuotaConfig(batch_discount=discounts.get(r.tenant_id, 0.5))
                                      .billed(r.prompt_tokens + r.completion_tokens, r.batch)) for r in records]
            await s.execute(insert(Usage), rows)

    async def usage_summary(self, tenant_ref: str | int | None = None, since: date | None = None,
                            until: date | None = None, by: str = "day") -> list[dict]:
        """Sums of the ledger grouped by ``day``, ``key``, ``model``, ``adapter`` (none: the base model) or
        ``tenant``, live and batch apart
        (``kind``); ``until`` is inclusive."""
        if by not in USAGE_GROUPS:
            raise StoreError(f"--by must be one of {', '.join(USAGE_GROUPS)}, got {by!r}")
        if since and until and since > until:
            raise StoreError(f"--since {since} is after --until {until}")
        group_col = {"day": Usage.day, "key": ApiKey.prefix, "model": Usage.model, "adapter": Usage.adapter,
                     "tenant": Tenant.name, "class": Usage.priority_class}[by]
        met = case((Usage.slo_met.is_(True), 1), else_=0)
        q = (
            select(
                group_col.label(by),
                case((Usage.batch, "batch"), else_="live").label("kind"),
                func.count(Usage.id).label("requests"),
                func.sum(Usage.prompt_tokens).label("prompt_tokens"),
                func.sum(Usage.cached_prompt_tokens).label("cached_prompt_tokens"),
                func.sum(Usage.completion_tokens).label("completion_tokens"),
                func.sum(Usage.billed_tokens).label("billed_tokens"),
                # Objectives: requests judged against one, those that met theirs, and the completion tokens of
                # the requests that met theirs or had none (goodput; a failed request's tokens are not good).
                func.count(Usage.slo_met).label("slo_requests"),
                func.sum(met).label("slo_met"),
                func.sum(case(((Usage.http_status == 200) & Usage.slo_met.isnot(False), Usage.completion_tokens),
                              else_=0)).label("goodput_tokens"),
            )
            .select_from(Usage)
            .join(Tenant, Tenant.id == Usage.tenant_id)
            .outerjoin(ApiKey, ApiKey.id == Usage.key_id)
            .group_by(group_col, Usage.batch)
            .order_by(group_col, Usage.batch)
        )
        async with self.sessions() as s:
            if tenant_ref is not None:
                q = q.where(Usage.tenant_id == (await self._tenant(s, tenant_ref)).id)
            if since is not None:
                q = q.where(Usage.day >= since)
            if until is not None:
                q = q.where(Usage.day <= until)
            out = []
            for row in (await s.execute(q)).mappings():
                item = {k: (int(v) if k not in (by, "kind") and v is not None else v) for k, v in row.items()}
                if by == "day" and item["day"] is not None and not isinstance(item["day"], str):
                    item["day"] = item["day"].isoformat()
                item["attainment"] = round(item["slo_met"] / item["slo_requests"], 4) if item["slo_requests"] else None
                out.append(item)
            return out

    async def billed_since(self, tenant_id: int, since: date) -> int:
        """The ledger's billed tokens for a tenant from a day on (what daily/monthly budgets are checked against)."""
        async with self.sessions() as s:
            total = (await s.execute(
                select(func.coalesce(func.sum(Usage.billed_tokens), 0))
                .where(Usage.tenant_id == tenant_id, Usage.day >= since)
            )).scalar_one()
            return int(total)


def month_start(d: date) -> date:
    return d.replace(day=1)


def next_month(d: date) -> date:
    return (d.replace(day=28) + timedelta(days=4)).replace(day=1)


__all__ = [
    "Conflict", "KeyInfo", "NotFound", "QuotaConfig", "StoreError", "TenantInfo", "TenantStore", "UsageRecord",
    "month_start", "next_month",
]
