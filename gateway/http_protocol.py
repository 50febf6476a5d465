"""Connection-level behaviour of the HTTP server that aiohttp offers no setting for.

- Requests too malformed to reach the app: aiohttp answers them with a 400
  whose text, and whose logged traceback, quote the offending bytes; for a bad
  header line next to ``Authorization``, the caller's API key went into the log
  and back over the wire. The gateway's answer names only the kind of error,
  and logs one line.
- A body that cannot be read (a Content-Encoding that does not decode): the
  handler answers it with a 400 (``gateway.errors.unreadable_body``), then
  aiohttp, skipping what is left of the body, meets the same error again and
  would log it as an unhandled exception with its traceback. It is logged as
  one line.
- A cap on open connections: past it a new connection is closed at once, so
  idle or half-sent connections cannot take every file descriptor (idle ones
  are closed after the keep-alive timeout, which aiohttp applies from the
  connection's start).
- A request whose body stalled past the body timeout (``close_without_lingering``):
  its connection is closed as soon as the 408 is written. aiohttp would
  otherwise keep reading and discarding the rest of the body for its
  ``lingering_time`` (10 s) first, so a client that trickles or stalls its
  body held its connection (counted against the cap) 10 s past its refusal.
  Lingering stays on for every other response: a client still sending a
  large body when it is refused (401, 413, 429) reads its answer instead of
  a connection reset, which ``lingering_time`` for the whole server would cost.

aiohttp has no hook for any of these, so ``RequestHandler``'s methods are replaced
for this process when the app is created (``install``).
"""

import logging
from http import HTTPStatus

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

import msgspec

logger = logging.getLogger(__name__)
_aiohttp_handle_error = RequestHandler.handle_error
_aiohttp_connection_made = RequestHandler.connection_made
_aiohttp_log_exception = RequestHandler.log_exception
_aiohttp_finish_response = RequestHandler.finish_response
_max_connections: int | None = None
_CLOSE_AT_ONCE = web.RequestKey("close_without_lingering", bool)


def close_without_lingering(request: web.BaseRequest) -> None:
    """Close ``request``'s connection as soon as its response is written, without reading what is left of its
    body (for a body that stalled: waiting on it longer only lets the client hold the connection)."""
    request[_CLOSE_AT_ONCE] = True


def _handle_error(self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None):
    if not isinstance(exc, HttpProcessingError) or status >= 500:
        return _aiohttp_handle_error(self, request, status, exc, message)
    logger.info("malformed HTTP request from %s: %s %s", request.remote, status, type(exc).__name__)
    body = {"error": {"message": f"malformed HTTP request ({HTTPStatus(status).phrase}: {type(exc).__name__}); "
                                 "check the request line and headers", "type": "invalid_request_error",
                      "param": None, "code": "malformed_request"}}
    response = web.Response(status=status, body=msgspec.json.encode(body), content_type="application/json")
    response.force_close()
    return response


def _log_exception(self, *args, **kw) -> None:
    exc = kw.get("exc_info")
    if isinstance(exc, web.RequestPayloadError):
        logger.info("unreadable request body: %s", getattr(exc.__cause__, "message", exc))
        return
    _aiohttp_log_exception(self, *args, **kw)


def _connection_made(self, transport) -> None:
    _aiohttp_connection_made(self, transport)
    server = self._manager
    if _max_connections is not None and server is not None and len(server.connections) > _max_connections:
        logger.warning("connection from %s closed: %d connections are open, the limit is %d",
                       transport.get_extra_info("peername"), len(server.connections) - 1, _max_connections)
        self.force_close()
        transport.close()


async def _finish_response(self, request, resp, start_time):
    result = await _aiohttp_finish_response(self, request, resp, start_time)
    if request.get(_CLOSE_AT_ONCE):
        # The response is written (the transport flushes it before closing); force_close also tells start()
        # not to linger over the unread body.
        self.force_close()
    return result


def install(max_connections: int | None = None) -> None:
    """Replace aiohttp's answer to unparseable requests and its log of unreadable bodies, cap open connections,
    and let a handler skip the lingering close (``close_without_lingering``), in this process."""
    global _max_connections
    _max_connections = max_connections
    RequestHandler.handle_error = _handle_error
    RequestHandler.connection_made = _connection_made
    RequestHandler.log_exception = _log_exception
    RequestHandler.finish_response = _finish_response
