"""Responses API responses in the policy database, per tenant, for a retention period.

A stored response is found only by its own tenant and only until it expires (``retention_s`` after it was
made); ``purge_expired`` deletes the expired rows (the gateway runs it periodically). Every method is one
transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import msgspec
from sqlalchemy import delete, select

from tenants.models import StoredResponse, utcnow
from tenants.store import TenantStore

@dataclass(slots=True, frozen=True)
class SavedResponse:
    id: str
    tenant_id: int
    response: dict  # the response object, as it was returned
    conversation: list[dict]  # the conversation's input items and this response's output items, in order
    created_at: datetime
    expires_at: datetime


class ResponseStore:
    def __init__(self, store: TenantStore, retention_s: float) -> None:
        if not retention_s > 0:
            raise ValueError(f"retention_s must be > 0, got {retention_s}")
        self.store, self.retention_s = store, retention_s

    async def put(self, tenant_id: int, response: dict, conversation: list[dict]) -> SavedResponse:
        now = utcnow()
        row = StoredResponse(id=response["id"], tenant_id=tenant_id, response_json=msgspec.json.encode(response).decode(),
                             conversation_json=msgspec.json.encode(conversation).decode(), created_at=now,
                             expires_at=now + timedelta(seconds=self.retention_s))
        async with self.store.sessions.begin() as s:
            s.add(row)
        return SavedResponse(row.id, tenant_id, response, conversation, row.created_at, row.expires_at)

    async def get(self, tenant_id: int, response_id: str) -> SavedResponse | None:
        """The tenant's unexpired response ``response_id``; None if there is none (another tenant's included)."""
        async with self.store.sessions() as s:
            row = (await s.execute(select(StoredResponse).where(
                StoredResponse.id == response_id, StoredResponse.tenant_id == tenant_id,
                StoredResponse.expires_at > utcnow()))).scalar_one_or_none()
            if row is None:
                return None
            return SavedResponse(row.id, row.tenant_id, msgspec.json.decode(row.response_json),
                                 msgspec.json.decode(row.conversation_json), row.created_at, row.expires_at)

    async def delete(self, tenant_id: int, response_id: str) -> bool:
        """Delete the tenant's response; False if it had none by that id."""
        async with self.store.sessions.begin() as s:
            result = await s.execute(delete(StoredResponse).where(
                StoredResponse.id == response_id, StoredResponse.tenant_id == tenant_id))
            return result.rowcount > 0

    async def purge_expired(self, now: datetime | None = None) -> int:
        """Delete every response past its expiry; the number deleted."""
        async with self.store.sessions.begin() as s:
            result = await s.execute(delete(StoredResponse).where(StoredResponse.expires_at <= (now or utcnow())))
            return result.rowcount
