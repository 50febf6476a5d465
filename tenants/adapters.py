"""LoRA adapters in the policy database: who owns each, who else may use it, where its directory is.

A request names an adapter as its ``model``. A tenant may use an adapter it owns, one granted to it, or a
public one (no owner); for any other tenant the adapter does not exist. The directory is checked by the caller
before ``add`` (``engine.lora.peft_format.check_adapter_dir``, in ``moegate admin adapter add``), and its
summary stored with it. Every method is one transaction; bad input is a ``StoreError`` with one line.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, or_, select

from tenants.models import Adapter, AdapterGrant, Tenant, utcnow
from tenants.names import reads_as
from tenants.store import Conflict, NotFound, StoreError, TenantStore, _checked


@dataclass(slots=True, frozen=True)
class AdapterInfo:
    name: str
    path: str
    owner: str | None  # the owning tenant's name; None: public
    rank: int
    target_modules: str  # comma-separated, as check_adapter_dir found them
    base_model: str | None
    created_at: datetime
    granted: tuple[str, ...] = ()  # tenants it is granted to besides its owner


# What an adapter name may hold: ASCII letters and digits and these, so that no name can pass for another (or for
# the served model) with lookalike letters: Cyrillic or fullwidth ones, zero-width characters.
NAME_PUNCTUATION = "-_./:"


def _adapter_name(name: str, reserved: Iterable[str | None] = ()) -> str:
    """Names travel as ``NAME=DIR`` lists (``lora_adapters``) and as an API's ``model``: ASCII letters, digits and
    ``NAME_PUNCTUATION`` only, and never read as one of ``reserved`` (the served model's names: case aside)."""
    name = _checked("adapter name", name, Adapter.name)
    bad = next((c for c in name if not (c.isascii() and c.isalnum()) and c not in NAME_PUNCTUATION), None)
    if bad is not None:
        shown = bad if bad.isascii() and bad.isprintable() else f"U+{ord(bad):04X}"
        raise StoreError(f"adapter name {name!r} must not hold {shown!r} (use ASCII letters, digits, '-', '_', '.', "
                         "'/', ':')")
    model = reads_as(name, reserved)
    if model is not None:
        raise StoreError(f"adapter name {name!r} reads as the model {model!r}: requests naming it would be taken "
                         "for the base model's; choose another name")
    return name


class AdapterStore:
    def __init__(self, store: TenantStore) -> None:
        self.store = store

    async def add(self, name: str, path: str, owner: str | None, rank: int, target_modules: list[str] | tuple[str, ...],
                  base_model: str | None = None, served_models: Iterable[str] = ()) -> AdapterInfo:
        """Register adapter ``name`` at ``path`` (made absolute), owned by tenant ``owner`` (None: public).
        ``name`` must not read as ``served_models`` (the names clients use for the base model), ``base_model``
        (the adapter's own, as saved), nor its last path part."""
        reserved = [*served_models, base_model, base_model and base_model.rstrip("/").rsplit("/", 1)[-1]]
        name = _adapter_name(name, reserved)
        path = os.path.abspath(path)
        if "," in path or len(path) > Adapter.path.type.length:
            raise StoreError(f"adapter path must hold no ',' and be at most {Adapter.path.type.length} characters")
        async with self.store.sessions.begin() as s:
            owner_id = None if owner is None else (await self.store._tenant(s, owner)).id
            if (await s.execute(select(Adapter.id).where(Adapter.name == name))).first():
                raise Conflict(f"adapter {name!r} already exists")
            row = Adapter(name=name, path=path, owner_tenant_id=owner_id, rank=rank,
                          target_modules=",".join(target_modules), base_model=base_model, created_at=utcnow())
            s.add(row)
            await self.store._flush_unique(s, f"adapter {name!r} already exists")
            return AdapterInfo(name, path, owner, rank, row.target_modules, base_model, row.created_at)

    async def _adapter(self, s, name: str) -> Adapter:
        row = (await s.execute(select(Adapter).where(Adapter.name == name))).scalar_one_or_none()
        if row is None:
            raise NotFound(f"unknown adapter {name!r}")
        return row

    async def list(self, tenant: str | None = None) -> list[AdapterInfo]:
        """Every adapter (with its owner and grants), or those tenant ``tenant`` may use."""
        async with self.store.sessions() as s:
            q = select(Adapter).order_by(Adapter.name)
            if tenant is not None:
                tenant_id = (await self.store._tenant(s, tenant)).id
                q = q.where(or_(Adapter.owner_tenant_id.is_(None), Adapter.owner_tenant_id == tenant_id,
                                Adapter.id.in_(select(AdapterGrant.adapter_id).where(AdapterGrant.tenant_id == tenant_id))))
            rows = list((await s.execute(q)).scalars())
            names = dict((await s.execute(select(Tenant.id, Tenant.name))).all())
            grants: dict[int, list[str]] = {}
            for adapter_id, tenant_id in (await s.execute(
                    select(AdapterGrant.adapter_id, AdapterGrant.tenant_id).order_by(AdapterGrant.tenant_id))).all():
                grants.setdefault(adapter_id, []).append(names[tenant_id])
            return [AdapterInfo(r.name, r.path, names.get(r.owner_tenant_id), r.rank, r.target_modules, r.base_model,
                                r.created_at, tuple(sorted(grants.get(r.id, ())))) for r in rows]

    async def remove(self, name: str) -> None:
        """Delete the adapter and its grants; requests naming it get the unknown-model 404 from then on."""
        async with self.store.sessions.begin() as s:
            row = await self._adapter(s, name)
            # Explicitly: SQLite enforces ON DELETE CASCADE only with its foreign_keys pragma on.
            await s.execute(delete(AdapterGrant).where(AdapterGrant.adapter_id == row.id))
            await s.delete(row)

    async def grant(self, name: str, tenant: str) -> None:
        """Let ``tenant`` use adapter ``name``; granting again is a no-op."""
        async with self.store.sessions.begin() as s:
            row, tenant_row = await self._adapter(s, name), await self.store._tenant(s, tenant)
            if row.owner_tenant_id is None:
                raise StoreError(f"adapter {name!r} is public: every tenant may use it already")
            if row.owner_tenant_id == tenant_row.id:
                raise StoreError(f"tenant {tenant!r} owns adapter {name!r}: it may use it already")
            if await s.get(AdapterGrant, (row.id, tenant_row.id)) is None:
                s.add(AdapterGrant(adapter_id=row.id, tenant_id=tenant_row.id, created_at=utcnow()))
                await self.store._flush_unique(s, f"adapter {name!r} was being granted to {tenant!r} at the same "
                                                  "time; run the command again")

    async def revoke(self, name: str, tenant: str) -> None:
        """Take ``tenant``'s grant of adapter ``name`` away; NotFound if it had none."""
        async with self.store.sessions.begin() as s:
            row, tenant_row = await self._adapter(s, name), await self.store._tenant(s, tenant)
            result = await s.execute(delete(AdapterGrant).where(AdapterGrant.adapter_id == row.id,
                                                                AdapterGrant.tenant_id == tenant_row.id))
            if result.rowcount == 0:
                raise NotFound(f"adapter {name!r} is not granted to tenant {tenant!r}")

    async def usable(self, tenant_id: int) -> dict[str, str]:
        """The adapters tenant ``tenant_id`` may use: name -> directory (the gateway caches this per tenant)."""
        async with self.store.sessions() as s:
            rows = (await s.execute(select(Adapter.name, Adapter.path).where(or_(
                Adapter.owner_tenant_id.is_(None), Adapter.owner_tenant_id == tenant_id,
                Adapter.id.in_(select(AdapterGrant.adapter_id).where(AdapterGrant.tenant_id == tenant_id)))))).all()
            return dict(rows)
