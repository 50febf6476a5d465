"""Admin endpoints to load and unload LoRA adapters while the server runs (vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``, for the operator only).

They are served only when the server has an admin token (``MOEGATE_ADMIN_TOKEN``), and only to
``Authorization: Bearer <admin token>``: a tenant's API key never reaches them. They live outside ``/v1/`` so a
tenant key is never even looked up for them.

``POST /admin/load_lora_adapter`` ``{"lora_name", "lora_path", "tenant" | "public": true}`` checks the directory,
registers the adapter in the policy database (as ``moegate admin adapter add``) and gives it to every engine; if
the directory or an engine refuses it, nothing stays written. ``POST /admin/unload_lora_adapter``
``{"lora_name"}`` deletes it from the database and removes it from every engine: new requests naming it get the
unknown-model 404 at once, requests already running under it finish under it, then each engine frees its slot
and host copy.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from aiohttp import web

from engine.serving.async_engine import EngineError
from gateway.auth import require_token
from gateway.completion import engine_down
from gateway.errors import APIError, read_body
from gateway.lora_adapters import ADAPTERS
from gateway.replica_router import replicas_of
from gateway.replies import json_response
from tenants.adapters import AdapterInfo
from tenants.store import Conflict, NotFound, StoreError

ADMIN_TOKEN = web.AppKey("admin_token", str)
ENGINE = web.AppKey("admin_engine", object)  # the gateway's engine (its replicas)
SERVED_MODEL = web.AppKey("admin_served_model", Callable[[], str])  # the base model's name as clients use it


def body_fields(raw: bytes, allowed: dict[str, type | tuple[type, ...]]) -> dict:
    """The JSON object body with only ``allowed`` fields of their types (a 400 naming the first bad one)."""
    try:
        body = json.loads(raw or b"null")
    except ValueError:
        raise APIError(400, "the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    for key, value in body.items():
        want = allowed.get(key)
        if want is None:
            raise APIError(400, f"unknown field {key!r} (expected: {', '.join(allowed)})", param=key)
        kinds = want if isinstance(want, tuple) else (want,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise APIError(400, f"{key!r} must be a {' or '.join(k.__name__ for k in kinds)}", param=key)
    return body


def _required(body: dict, key: str) -> str:
    value = body.get(key)
    if not value:
        raise APIError(400, f"{key!r} is required", param=key)
    return value


def _card(info: AdapterInfo, engines: int) -> dict:
    return {"object": "lora_adapter", "name": info.name, "path": info.path, "owner": info.owner, "rank": info.rank,
            "target_modules": info.target_modules.split(","), "base_model": info.base_model, "engines": engines}


def _check_adapter_dir(path: str):
    """``check_adapter_dir``, imported here: its module loads torch, which the gateway's process otherwise never
    imports (2-4 s and some 300 MB added to every gateway start)."""
    from engine.lora.peft_format import check_adapter_dir

    return check_adapter_dir(path)


async def load_adapter(request: web.Request) -> web.Response:
    require_token(request, request.app[ADMIN_TOKEN], "admin")
    body = body_fields(await read_body(request), {"lora_name": str, "lora_path": str, "tenant": str, "public": bool})
    name, path = _required(body, "lora_name"), _required(body, "lora_path")
    if ("tenant" in body) == bool(body.get("public")):
        raise APIError(400, "give the adapter an owner: 'tenant': NAME, or 'public': true for every tenant",
                       param="tenant")
    try:  # config, header and values, off the event loop; nothing is written if the directory is not an adapter
        summary = await asyncio.to_thread(_check_adapter_dir, path)
    except ValueError as e:
        raise APIError(400, f"adapter {name!r} cannot be added: {e}", param="lora_path",
                       code="invalid_adapter") from None
    catalog = request.app[ADAPTERS]
    try:
        info = await catalog.adapters.add(name, path, body.get("tenant"), summary.rank, summary.target_modules,
                                          summary.base_model, served_models=[request.app[SERVED_MODEL]()])
    except Conflict as e:
        raise APIError(409, str(e), param="lora_name", code="adapter_exists") from None
    except NotFound as e:
        raise APIError(404, str(e), param="tenant", code="tenant_not_found") from None
    except StoreError as e:  # a name or path the database cannot hold
        raise APIError(400, str(e), param="lora_path" if str(e).startswith("adapter path") else "lora_name") from None
    replicas = replicas_of(request.app[ENGINE])
    try:
        await catalog.ensure_loaded(replicas, info.name, info.path)
    except (ValueError, EngineError) as e:  # an engine refuses it (a rank above its max_lora_rank ...) or is gone
        await catalog.adapters.remove(info.name)
        await catalog.unload(replicas, name=info.name)  # from the engines that did take it
        if isinstance(e, EngineError):
            raise engine_down(e) from None
        raise APIError(400, f"the engine cannot serve {path!r}: {e}", param="lora_path",
                       code="adapter_unavailable") from None
    catalog.changed()
    return json_response(_card(info, sum(1 for _, r in replicas if not r.dead and r.info is not None)))


async def unload_adapter(request: web.Request) -> web.Response:
    require_token(request, request.app[ADMIN_TOKEN], "admin")
    body = body_fields(await read_body(request), {"lora_name": str})
    name = _required(body, "lora_name")
    catalog = request.app[ADAPTERS]
    try:
        await catalog.adapters.remove(name)
    except NotFound as e:
        raise APIError(404, str(e), param="lora_name", code="adapter_not_found") from None
    catalog.changed()  # new requests naming it: the unknown-model 404 from now on
    engines = await catalog.unload(replicas_of(request.app[ENGINE]), name=name)
    return json_response({"object": "lora_adapter", "name": name, "deleted": True, "engines": engines})


def add_routes(app: web.Application, token: str | None, engine, served_model: Callable[[], str]) -> None:
    """Serve the endpoints when ``token`` is set (no token: no admin endpoints at all). ``served_model()``: the
    base model's name as clients use it, which no adapter's name may read as."""
    if not token:
        return
    app[ADMIN_TOKEN] = token
    app[ENGINE] = engine
    app[SERVED_MODEL] = served_model
    app.router.add_post("/admin/load_lora_adapter", load_adapter)
    app.router.add_post("/admin/unload_lora_adapter", unload_adapter)
