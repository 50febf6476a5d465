"""Every request refused with a 4xx, counted per tenant in ``/metrics`` (``moegate_rejections``).

Quota and overload refusals are counted where they are decided (``gateway.app``); this middleware counts the
rest: bodies and schemas refused as bad input, unknown models, and so on, by their error code. A tenant
flooding the server with requests it refuses shows up in the metrics as one that is served would.
"""

from aiohttp import web

from gateway.auth import PRINCIPAL
from gateway.errors import APIError
from gateway.metrics import METRICS

_COUNTED_ELSEWHERE = {429, 503}  # quotas and overload: counted by reason in the handler


@web.middleware
async def count_refusals(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as err:
        principal = request.get(PRINCIPAL)
        if principal is not None and 400 <= err.status < 500 and err.status not in _COUNTED_ELSEWHERE:
            request.app[METRICS].rejections.labels(principal.tenant.name, principal.priority_class.name,
                                                   err.code or "invalid_request").inc()
        raise
