"""LoRA adapters through the API: a request's ``model`` names the base model or an adapter its tenant may use.

The adapters and who may use them live in the policy database (``tenants.adapters``; ``moegate admin adapter``).
Per tenant, the usable ones are cached for ``ttl_s`` (so a grant, a revoke or a new adapter applies within it).
An adapter the tenant may not use is the same ``404 model_not_found`` as a model that does not exist.

Engines learn an adapter with ``add_lora`` the first time a request needs it there (once per replica and engine
process: a restarted engine starts from its configuration again; concurrent requests wait for the one call). What an
engine's configuration names (``lora_adapters``) counts as given to it at its start: it is unloaded and given again
like any other, and unloaded within ``ttl_s`` if the database does not hold it under that directory.
Where the database holds adapters when the server starts, local replicas are started with ``enable_lora``.

Removal unloads: the admin endpoint (``gateway.admin_lora``) calls ``remove_lora`` on every engine given the adapter
at once; an adapter removed from the database another way (``moegate admin adapter remove``) is removed from the
engines within ``ttl_s`` (``forget_removed``, run by the gateway every ``ttl_s``). Requests already running under
it finish under it; the engine then frees its slot and host copy.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from engine.serving.async_engine import EngineError
from gateway.completion import engine_down
from gateway.errors import APIError
from gateway.replica_router import replicas_of
from tenants.adapters import AdapterStore
from tenants.store import TenantStore
from tenants.ttl_cache import RefreshingCache

logger = logging.getLogger(__name__)


def unknown_model(model: str, served: str) -> APIError:
    """The 404 of a model that does not exist, or of an adapter the caller may not use (the same body)."""
    return APIError(404, f"model {model!r} does not exist; this server serves {served!r}", param="model",
                    code="model_not_found")


class AdapterCatalog:
    """The gateway's view of the adapters: who may use which (cached per tenant), which replica has which."""

    def __init__(self, store: TenantStore, ttl_s: float) -> None:
        self.adapters = AdapterStore(store)
        self._usable: RefreshingCache[dict[str, str]] = RefreshingCache(ttl_s)
        # replica -> (the Ready of its engine process, {adapter name: its add_lora call}): a restart resets it.
        self._given: dict[int, tuple[object, dict[tuple[str, str], asyncio.Future]]] = {}

    async def usable(self, tenant_id: int) -> dict[str, str]:
        """Adapter name -> directory, for every adapter tenant ``tenant_id`` may use (cached)."""
        return await self._usable.get(tenant_id, lambda: self.adapters.usable(tenant_id))

    async def resolve(self, tenant_id: int, model: str | None, base: str) -> tuple[str | None, str | None]:
        """(adapter name, its directory) for a request's ``model``: (None, None) for the base model (or no model
        given); the unknown-model 404 for anything else this tenant may not use."""
        if model is None or model == base:
            return None, None
        path = (await self.usable(tenant_id)).get(model)
        if path is None:
            raise unknown_model(model, base)
        return model, path

    async def configure(self, replicas) -> None:
        """Before the engines start: where the database holds adapters, each local replica serves LoRA
        (``enable_lora``), so that requests can name them. None is named in its configuration: each is given
        with ``add_lora`` on first use, so an adapter that cannot be served (its files gone or changed since it
        was added, made for another base model, a rank above ``max_lora_rank``) fails its own requests with one
        line and never stops an engine from starting."""
        if not await self.adapters.list():
            return
        for _, replica in replicas:
            config = replica.config
            if getattr(replica, "address", None) is not None or config.engine_ranks > 1 or config.data_parallel_size > 1:
                continue  # a remote engine has its own flags; multi-process engines serve no adapters yet
            if not config.lora_enabled:
                config.enable_lora = True
                logger.info("engine replica serves LoRA: the policy database holds adapters")

    def changed(self) -> None:
        """The database's adapters changed from this gateway: every tenant's view applies from the next request."""
        self._usable.clear()

    def _given_to(self, replica) -> dict[tuple[str, str], asyncio.Future]:
        """The adapters given to ``replica``'s current engine process (a new process starts from those its
        configuration names)."""
        info, given = self._given.get(id(replica), (None, {}))
        if info is not replica.info:
            given = {}
            for key in replica.config.lora_adapter_paths.items():  # added by the engine itself at its start
                given[key] = asyncio.get_running_loop().create_future()
                given[key].set_result(None)
            self._given[id(replica)] = (replica.info, given)
        return given

    async def unload(self, replicas, keep: dict[str, str] | None = None, name: str | None = None) -> int:
        """``remove_lora`` on every live replica for adapter ``name`` (None: every adapter given to it that
        ``keep``, name -> directory, no longer holds under the same directory). Returns how many engines removed
        one. A replica gone meanwhile is skipped (a restarted engine starts without it)."""
        calls, keys = [], []
        for _, replica in replicas:
            if replica.dead or replica.info is None:
                continue
            given = self._given_to(replica)
            for key, call in list(given.items()):
                gone = key[0] == name if name is not None else keep.get(key[0]) != key[1]
                if gone and call.done() and call.exception() is None:
                    del given[key]
                    calls.append(replica.remove_lora(key[0]))
                    keys.append(key)
        removed = 0
        for key, result in zip(keys, await asyncio.gather(*calls, return_exceptions=True)):
            if isinstance(result, BaseException):
                logger.warning("adapter %r could not be removed from an engine: %s", key[0], result)
            else:
                removed += 1
        return removed

    async def forget_removed(self, replicas) -> int:
        """Unload what the database no longer holds (removed by ``moegate admin adapter remove``)."""
        if not any(given for _, given in self._given.values()):
            return 0
        held = {a.name: a.path for a in await self.adapters.list()}
        return await self.unload(replicas, keep=held)

    async def ensure_loaded(self, replicas, name: str, path: str) -> None:
        """Have every live replica serve adapter ``name`` from ``path`` (``add_lora`` where it was not given it
        yet). A replica given ``name`` from another directory is given ``path`` instead if the database holds the
        adapter there now (removed and added again from the command line, not yet forgotten by
        ``forget_removed``); if the database holds the other directory, this caller's view is the stale one and
        the replica keeps what it serves. A replica that cannot serve it is a ValueError with its one line."""
        calls = []
        held: dict[str, str] | None = None  # the database's adapters, read once, only if a replica disagrees
        for _, replica in replicas:
            if replica.dead or replica.info is None:
                continue
            given = self._given_to(replica)  # a new engine process knows only its configuration
            other = [key for key, c in given.items()
                     if key[0] == name and key[1] != path and c.done() and c.exception() is None]
            if other:
                if held is None:
                    held = {a.name: a.path for a in await self.adapters.list()}
                    self._usable.clear()  # the database changed under every cached view: read it again
                if held.get(name) != path:
                    continue
                logger.info("adapter %r is at %s in the database now: replacing %s on an engine", name, path,
                            other[0][1])
                for key in other:
                    del given[key]
                await replica.remove_lora(name)
            call = given.get((name, path))
            if call is None or (call.done() and call.exception() is not None):
                call = given[(name, path)] = asyncio.ensure_future(replica.add_lora(name, path))
            calls.append(call)
        if calls:
            # Shielded: one request that goes away does not cancel the call others wait on.
            await asyncio.gather(*(asyncio.shield(c) for c in calls))

    async def serve_on(self, engine, name: str, path: str) -> None:
        """``ensure_loaded`` on the gateway's engine (every replica), its failures as API errors: an adapter an
        engine cannot serve (its one line) is a 400 naming ``model``, an engine that is gone a 503."""
        try:
            await self.ensure_loaded(replicas_of(engine), name, path)
        except EngineError as e:
            raise engine_down(e) from None
        except ValueError as e:
            logger.warning("adapter %r could not be given to an engine: %s", name, e)
            raise APIError(400, f"model {name!r} cannot be served now: {e}", param="model",
                           code="adapter_unavailable") from None


ADAPTERS = web.AppKey("adapters", AdapterCatalog)
