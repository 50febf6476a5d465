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

aiohttp has no hook for either, so ``RequestHandler``'s methods are replaced
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
_max_connections: int | None = None


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


def install(max_connections: int | None = None) -> None:
    """Replace aiohttp's answer to unparseable requests and its log of unreadable bodies, and cap open connections,
    in this process."""
    global _max_connections
    _max_connections = max_connections
    RequestHandler.handle_error = _handle_error
    RequestHandler.connection_made = _connection_made
    RequestHandler.log_exception = _log_exception
