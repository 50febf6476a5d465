"""At start, from the policy database: a `default` tenant and one key on an empty one (shown once), and the
deployment's identity for the engines' disk prefix-cache tiers."""

from tenants.store import TenantStore


async def bootstrap(database_url: str) -> tuple[str | None, str]:
    """Create tenant `default` with one API key if the database has no tenant; returns the key (or None) and the
    database's deployment id (``TenantStore.deployment_id``)."""
    store = TenantStore.open(database_url)
    try:
        deployment = await store.deployment_id()
        if await store.list_tenants():
            return None, deployment
        await store.create_tenant("default")
        _, plaintext = await store.create_key("default", label="created by moegate serve")
        return plaintext, deployment
    finally:
        await store.close()
