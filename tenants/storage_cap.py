"""A tenant's cap on bytes it stores (files, responses), checked and stored as one step for every gateway sharing
the database."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.models import Tenant


class OverStorageCap(Exception):
    """Something of ``size`` bytes that would take what the tenant stores (``used`` bytes) past ``limit``."""

    def __init__(self, used: int, size: int, limit: int) -> None:
        super().__init__(f"{used} bytes stored + {size} > {limit}")
        self.used, self.size, self.limit = used, size, limit


async def check_room(s: AsyncSession, tenant_id: int, size: int, limit: int | None,
                     stored_bytes: Callable[[AsyncSession, int], Awaitable[int]],
                     full: type[OverStorageCap]) -> None:
    """Raise ``full`` if ``size`` more bytes would take the tenant's ``stored_bytes(s, tenant_id)`` past
    ``limit`` (None: no cap, nothing checked). Call in the transaction that then stores them."""
    if limit is None:
        return
    # The check and the insert are one step for every gateway sharing the database: the tenant's row lock
    # (PostgreSQL) or the write lock BEGIN IMMEDIATE took (SQLite: FOR UPDATE renders as nothing there) holds
    # another store of the tenant's before its sum until this one commits.
    await s.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update())
    used = await stored_bytes(s, tenant_id)
    if used + size > limit:
        raise full(used, size, limit)
