"""Requests that run no model (file uploads, ``/tokenize``, ``/detokenize``) admitted like any other: they count
against the tenant's request rate and concurrency, a ``429`` with ``Retry-After`` past them (counted in
``moegate_rejections``). They still cost the server work (an upload's bytes; a chat template rendered, images
decoded and remote ones fetched to count tokens), which a tenant past its rate must not get for free."""

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from gateway.admission import QUOTAS, SETTLEMENTS
from gateway.auth import PRINCIPAL
from gateway.errors import APIError
from gateway.metrics import METRICS


@contextlib.asynccontextmanager
async def admitted(request: web.Request) -> AsyncIterator[None]:
    """Hold one request of the caller's tenant (no tokens) while the block runs; its concurrency slot is free again
    after it (the request rate keeps it)."""
    app, principal = request.app, request[PRINCIPAL]
    try:
        grant = await app[SETTLEMENTS].acquire(app[QUOTAS], principal.tenant.id, 0)
    except APIError as refused:
        app[METRICS].rejections.labels(principal.tenant.name, principal.priority_class.name,
                                       refused.code or str(refused.status)).inc()
        raise
    try:
        yield
    finally:
        app[SETTLEMENTS].run(app[QUOTAS].release(grant))
