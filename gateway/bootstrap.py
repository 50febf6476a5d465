"""First start on an empty policy database: a `default` tenant and one key, shown once."""

from tenants.store import TenantStore


async def ensure_default_tenant(database_url: str) -> str | None:
    """Create tenant `default` with one API key if the database has no tenant; returns the key, or None."""
    store = TenantStore.open(database_url)
    try:
        if await store.list_tenants():
            return None
        await store.create_tenant("default")
        _, plaintext = await store.create_key("default", label="created by moegate serve")
        return plaintext
    finally:
        await store.close()
