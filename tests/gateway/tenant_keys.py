"""A tenant and its API key in a test's policy database (the first thing most gateway tests need)."""

from tenants.store import TenantStore


async def new_tenant_key(db_url: str, name: str = "t", **quota) -> str:
    """Create tenant ``name`` (with ``quota``, TenantStore.set_quota's fields, if given); returns a new key."""
    store = TenantStore.open(db_url)
    try:
        await store.create_tenant(name)
        key = (await store.create_key(name))[1]
        if quota:
            await store.set_quota(name, **quota)
        return key
    finally:
        await store.close()
