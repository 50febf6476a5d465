"""Responses API responses in the policy database, per tenant, for a retention period.

A stored response is found only by its own tenant and only until it expires (``retention_s`` after it was
made, or after the latest response that continued it: storing a response moves its chain's expiry on);
``purge_expired`` deletes the expired rows (the gateway runs it periodically). A conversation is a chain of
rows, each holding only its own request's input items and its output, linked to the response it continued
(``previous_response_id``), so a conversation of n steps stores each item once, not n times; ``chain`` reads
one back, up to ``max_depth`` responses. Rows are encoded and decoded on a worker thread, one row per call of
the JSON codec, so a long conversation never holds the event loop (each row is at most one request's input
and output). Every method is one transaction.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import NamedTuple

import msgspec
from sqlalchemy import delete, func, literal, select, update

from tenants.models import StoredResponse, utcnow
from tenants.storage_cap import OverStorageCap, check_room
from tenants.store import TenantStore

MAX_CHAIN_DEPTH = 1024  # responses one conversation may chain through previous_response_id


@dataclass(slots=True, frozen=True)
class SavedResponse:
    id: str
    tenant_id: int
    response: dict  # the response object, as it was returned (its output items included)
    inputs: list[dict]  # the input items its own request sent (not those of the responses it continued)
    parent_id: str | None  # the response it continued
    created_at: datetime
    expires_at: datetime

    @property
    def items(self) -> list[dict]:
        """Its inputs, then its output items."""
        return self.inputs + self.response["output"]


class ChainBroken(LookupError):
    """A response of the conversation, ``missing``, was deleted (or expired before the retention moved on)."""

    def __init__(self, missing: str) -> None:
        super().__init__(missing)
        self.missing = missing


class ChainTooLong(ValueError):
    """The conversation continues more than ``max_depth`` earlier responses."""


def conversation(chain: list[SavedResponse]) -> list[dict]:
    """A chain's items in order (oldest response first): each response's inputs, then its output."""
    return [item for saved in chain for item in saved.items]


class StoredResponsesFull(OverStorageCap):
    """A response that would take its tenant's stored responses past their cap (``stored_response_bytes``)."""


class ResponseStore:
    def __init__(self, store: TenantStore, retention_s: float, max_depth: int = MAX_CHAIN_DEPTH) -> None:
        if not retention_s > 0:
            raise ValueError(f"retention_s must be > 0, got {retention_s}")
        self.store, self.retention_s, self.max_depth = store, retention_s, max_depth

    async def put(self, tenant_id: int, response: dict, inputs: list[dict] | msgspec.Raw, parent_id: str | None = None,
                  ancestors: tuple[str, ...] | list[str] = (), max_stored_bytes: int | None = None) -> SavedResponse:
        """Store ``response`` (which continued ``parent_id``) with the input items its request sent; the
        ``ancestors`` (its chain's ids) then expire no sooner than it does. ``max_stored_bytes``:
        StoredResponsesFull (nothing stored) if the tenant's responses would hold more with this one, its own
        output included; checked and stored as one step for every gateway sharing the database."""
        response_json, input_json, size = await asyncio.to_thread(_encode, response, inputs)
        now = utcnow()
        expires = now + timedelta(seconds=self.retention_s)
        row = StoredResponse(id=response["id"], tenant_id=tenant_id, parent_id=parent_id, response_json=response_json,
                             input_json=input_json, stored_bytes=size, created_at=now,
                             expires_at=expires)
        async with self.store.sessions.begin() as s:
            await check_room(s, tenant_id, size, max_stored_bytes, self._stored_bytes, StoredResponsesFull)
            s.add(row)
            if ancestors:
                await s.execute(update(StoredResponse).where(
                    StoredResponse.tenant_id == tenant_id, StoredResponse.id.in_(list(ancestors)),
                    StoredResponse.expires_at < expires).values(expires_at=expires))
        return SavedResponse(row.id, tenant_id, response, inputs, parent_id, row.created_at, row.expires_at)

    async def get(self, tenant_id: int, response_id: str) -> SavedResponse | None:
        """The tenant's unexpired response ``response_id``; None if there is none (another tenant's included)."""
        async with self.store.sessions() as s:
            row = (await s.execute(select(StoredResponse).where(
                StoredResponse.id == response_id, StoredResponse.tenant_id == tenant_id,
                StoredResponse.expires_at > utcnow()))).scalar_one_or_none()
            rows = [] if row is None else [_raw(row)]
        return (await asyncio.to_thread(decode_rows, rows))[0] if rows else None

    async def chain(self, tenant_id: int, response_id: str) -> list[SavedResponse] | None:
        """The conversation that ends with the tenant's response ``response_id``, oldest response first; None if
        there is no such response. ``ChainBroken`` if an earlier one is gone, ``ChainTooLong`` past
        ``max_depth``."""
        rows = await self.chain_rows(tenant_id, response_id)
        return None if rows is None else await asyncio.to_thread(decode_rows, rows)

    async def chain_rows(self, tenant_id: int, response_id: str) -> list[StoredRow] | None:
        """``chain``'s rows as stored, for the caller to decode with ``decode_rows`` on a thread of its own (where
        what it builds from them is freed too)."""
        r = StoredResponse
        now = utcnow()
        live = (r.tenant_id == tenant_id) & (r.expires_at > now)
        links = select(r.id, r.parent_id, literal(0).label("depth")).where(r.id == response_id, live) \
            .cte("links", recursive=True)
        links = links.union_all(select(r.id, r.parent_id, (links.c.depth + 1).label("depth"))
                                .join(links, r.id == links.c.parent_id).where(live, links.c.depth < self.max_depth))
        async with self.store.sessions() as s:
            found = (await s.execute(select(r, links.c.depth).join(links, r.id == links.c.id)
                                     .order_by(links.c.depth.desc()))).all()
            rows = [_raw(row) for row, _ in found]
        if not rows:
            return None
        oldest_parent, depth = rows[0].parent_id, found[0][1]
        if oldest_parent is not None:
            if depth >= self.max_depth:
                raise ChainTooLong(f"the conversation continues more than {self.max_depth} responses")
            raise ChainBroken(oldest_parent)
        return rows

    async def stored_bytes(self, tenant_id: int) -> int:
        """Bytes the tenant's unexpired responses hold."""
        async with self.store.sessions() as s:
            return await self._stored_bytes(s, tenant_id)

    @staticmethod
    async def _stored_bytes(s, tenant_id: int) -> int:
        return int(await s.scalar(select(func.coalesce(func.sum(StoredResponse.stored_bytes), 0)).where(
            StoredResponse.tenant_id == tenant_id, StoredResponse.expires_at > utcnow())))

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


class StoredRow(NamedTuple):
    """A stored response's row, its JSON not yet decoded."""

    id: str
    tenant_id: int
    response_json: str
    input_json: str
    parent_id: str | None
    created_at: datetime
    expires_at: datetime


def _raw(row: StoredResponse) -> StoredRow:
    return StoredRow(row.id, row.tenant_id, row.response_json, row.input_json, row.parent_id, row.created_at,
                     row.expires_at)


def _encode(response: dict, inputs: list[dict] | msgspec.Raw) -> tuple[str, str, int]:
    """(the response's JSON, the inputs' JSON, their size in bytes); inputs already encoded are ``msgspec.Raw``."""
    response_json, input_json = msgspec.json.encode(response), msgspec.json.encode(inputs)
    return response_json.decode(), input_json.decode(), len(response_json) + len(input_json)


def decode_rows(rows: list[StoredRow]) -> list[SavedResponse]:
    """Rows as saved responses; for a worker thread: one decode per row, so the event loop gets the interpreter
    between rows."""
    return [SavedResponse(row.id, row.tenant_id, msgspec.json.decode(row.response_json),
                          msgspec.json.decode(row.input_json), row.parent_id, row.created_at, row.expires_at)
            for row in rows]
