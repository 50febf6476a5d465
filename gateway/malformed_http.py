"""Answers to requests too malformed to reach the app, without repeating what the client sent.

aiohttp answers a request it cannot parse with a 400 whose text, and whose
logged traceback, quote the offending bytes: for a bad header line next to
``Authorization``, the caller's API key goes into the log and back over the
wire. The gateway's answer names only the kind of error, and logs one line.
aiohttp has no hook for this answer, so the method is replaced for this
process when the app is created (``install``).
"""

import logging
from http import HTTPStatus

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

import msgspec

logger = logging.getLogger(__name__)
_aiohttp_handle_error = RequestHandler.handle_error


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


def install() -> None:
    """Replace aiohttp's answer to unparseable requests in this process (idempotent)."""
    RequestHandler.handle_error = _handle_error
