"""Small HTTP helpers every route module shares: JSON replies and the ``limit`` query parameter."""

import msgspec
from aiohttp import web

from gateway.errors import APIError


def json_response(body: dict, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(body), content_type="application/json")


def query_limit(request: web.Request, default: int = 20, most: int = 10_000) -> int:
    """The ``limit`` query parameter of a list endpoint; a 400 naming it if it is not an integer in range."""
    raw = request.query.get("limit", str(default))
    try:
        limit = int(raw)
    except ValueError:
        raise APIError(400, f"limit must be an integer, got {raw!r}", param="limit") from None
    if not 1 <= limit <= most:
        raise APIError(400, f"limit must be between 1 and {most}", param="limit")
    return limit
