"""``/admin/replicas``: the engine replicas, and how many serve (for the operator only, as ``gateway.admin_lora``).

``GET /admin/replicas`` lists each replica (name, state: serving, draining, starting or down; requests it holds;
requests routed to it since it joined) and the bound. ``POST /admin/replicas`` ``{"count": N}`` grows or shrinks
the fleet to N serving replicas (``gateway.replica_scaling``; leaving replicas drain for ``drain_timeout_s``, default
the gateway's ``--drain-timeout``) and answers once that is done: 400 naming ``count``
for a count outside 1 to the bound, 409 ``scaling_disabled`` where the server was started without room to scale
(``moegate serve --max-data-parallel-size``), 503 if a new replica failed to start (the fleet is then as before).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from engine.serving.async_engine import EngineError
from gateway.admin_lora import ADMIN_TOKEN, body_fields
from gateway.app_keys import CONFIG, ENGINE, SCALER, SUPERVISORS
from gateway.auth import require_token
from gateway.completion import engine_down
from gateway.errors import APIError, read_body
from gateway.replica_router import replicas_of
from gateway.replies import json_response

MAX_DRAIN_TIMEOUT_S = 3600.0


def _listing(request: web.Request, extra: dict | None = None) -> web.Response:
    scaler = request.app.get(SCALER)
    if scaler is not None:
        replicas, most = scaler.describe(), scaler.max_replicas
    else:  # a fixed fleet: each replica as /health sees it
        replicas = [{"replica": name, "state": "down" if r.dead else "starting" if r.info is None else "serving"}
                    for name, r in replicas_of(request.app[ENGINE])]
        most = len(replicas)
    serving = sum(r["state"] == "serving" for r in replicas)
    return json_response({"object": "replicas", "count": serving, "max_count": most, "scalable": scaler is not None,
                          "replicas": replicas, **(extra or {})})


async def list_replicas(request: web.Request) -> web.Response:
    require_token(request, request.app[ADMIN_TOKEN], "admin")
    return _listing(request)


async def set_replicas(request: web.Request) -> web.Response:
    require_token(request, request.app[ADMIN_TOKEN], "admin")
    body = body_fields(await read_body(request), {"count": int, "drain_timeout_s": (int, float)})
    count = body.get("count")
    if count is None:
        raise APIError(400, "'count' is required", param="count")
    scaler = request.app.get(SCALER)
    if scaler is None:
        raise APIError(409, "this server's replicas are fixed: start it with --max-data-parallel-size above "
                            "--data-parallel-size to scale while serving", param="count", code="scaling_disabled")
    if not 1 <= count <= scaler.max_replicas:
        raise APIError(400, f"'count' must be between 1 and {scaler.max_replicas}, got {count}", param="count")
    drain_timeout_s = body.get("drain_timeout_s", request.app[CONFIG].drain_timeout_s)
    if not 0 <= drain_timeout_s <= MAX_DRAIN_TIMEOUT_S:
        raise APIError(400, f"'drain_timeout_s' must be between 0 and {MAX_DRAIN_TIMEOUT_S:g}",
                       param="drain_timeout_s")
    # Shielded: a client that hangs up (its handler cancelled) must not leave a replica half added or drained.
    change = asyncio.ensure_future(scaler.set_count(count, request.app[SUPERVISORS], drain_timeout_s))
    try:
        done = await asyncio.shield(change)
    except EngineError as e:
        raise engine_down(e) from None
    return _listing(request, {"added": done["added"], "removed": done["removed"], "seconds": done["seconds"]})


def add_routes(app: web.Application, token: str | None) -> None:
    """Serve the endpoints when ``token`` is set (no admin token: no admin endpoints); ``app[SCALER]``, where
    set, scales the replicas (else they are fixed)."""
    if not token:
        return
    app.router.add_get("/admin/replicas", list_replicas)
    app.router.add_post("/admin/replicas", set_replicas)
