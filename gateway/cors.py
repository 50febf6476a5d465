"""Cross-origin requests from browsers (CORS), for the origins the operator allows (``--allowed-origins``).

None allowed (the default): no CORS headers at all, so a browser page of another origin cannot read the API's
answers. Allowed (a list of origins such as ``https://app.example.com``, or ``*`` for any): a browser's preflight
(``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) is answered here, before authentication
(browsers send it without the ``Authorization`` header), and every response to an allowed origin, errors and
streams included, carries ``Access-Control-Allow-Origin`` and exposes the headers clients read (request id,
rate limits, ``Retry-After``). Credentials (cookies) are never allowed: the API authenticates by its key.

A middleware and a response hook rather than the ``aiohttp-cors`` package: that package is configured route by
route, and the policy here is the same for every route.
"""

from aiohttp import web

ALLOWED_ORIGINS = web.AppKey("allowed_origins", frozenset)
ANY_ORIGIN = "*"
ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
# What a browser script may read besides the safelisted headers: the OpenAI SDKs read these.
EXPOSED_HEADERS = ("X-Request-Id, Retry-After, x-ratelimit-limit-requests, x-ratelimit-remaining-requests, "
                   "x-ratelimit-reset-requests, x-ratelimit-limit-tokens, x-ratelimit-remaining-tokens, "
                   "x-ratelimit-reset-tokens, x-should-retry")
PREFLIGHT_MAX_AGE_S = 600  # how long a browser may reuse a preflight's answer


def parse_origins(value: str | None) -> tuple[str, ...]:
    """``--allowed-origins``: ``*``, or origins separated by commas (``scheme://host[:port]``, no path); ValueError
    naming the first that is not one."""
    if value is None or not value.strip():
        return ()
    origins = tuple(o.strip().rstrip("/") for o in value.split(",") if o.strip())
    if ANY_ORIGIN in origins:
        return (ANY_ORIGIN,)
    for origin in origins:
        scheme, sep, host = origin.partition("://")
        if scheme not in ("http", "https") or not sep or not host or "/" in host:
            raise ValueError(f"--allowed-origins: {origin!r} is not an origin; give scheme://host[:port] "
                             "(e.g. https://app.example.com), several separated by commas, or *")
    return origins


def _allowed(request: web.Request) -> str | None:
    """The Access-Control-Allow-Origin value for this request (None: not a cross-origin request allowed here)."""
    origin = request.headers.get("Origin")
    allowed = request.app.get(ALLOWED_ORIGINS)
    if not origin or not allowed:
        return None
    if ANY_ORIGIN in allowed:
        return ANY_ORIGIN
    return origin if origin.rstrip("/") in allowed else None


@web.middleware
async def preflight(request: web.Request, handler):
    """Answer an allowed origin's preflight at once (no key needed); everything else goes on."""
    if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
        origin = _allowed(request)
        if origin is not None:
            headers = {"Access-Control-Allow-Origin": origin, "Access-Control-Allow-Methods": ALLOWED_METHODS,
                       "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S), "Vary": "Origin"}
            asked = request.headers.get("Access-Control-Request-Headers")
            if asked:  # any header: what a request may carry is checked when it comes
                headers["Access-Control-Allow-Headers"] = asked
            return web.Response(status=204, headers=headers)
    return await handler(request)


async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: an allowed origin's answer (a stream's too, before its headers leave) says so."""
    origin = _allowed(request)
    if origin is not None and "Access-Control-Allow-Origin" not in response.headers:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
        response.headers.add("Vary", "Origin")


def install(app: web.Application, origins: tuple[str, ...]) -> None:
    """Allow ``origins`` (see the module docstring; empty: nothing is added). Call before the app starts; the
    ``preflight`` middleware must be among the app's first."""
    app[ALLOWED_ORIGINS] = frozenset(origins)
    if origins:
        app.on_response_prepare.append(add_headers)
