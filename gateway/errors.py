"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

import asyncio
import logging
import re
import uuid

import msgspec
from aiohttp import web
from sqlalchemy.exc import SQLAlchemyError

from gateway import http_protocol

logger = logging.getLogger(__name__)


# An error's message quotes what the client sent (a model name, a field, an enum value) to say what was wrong;
# the client has it already, so a long value is shown by its start and its length, never in full.
ECHO_CHARS = 256  # a run this long without a space or a quote is a value, not the server's words
_KEPT_CHARS = 128  # of a long value: shown at its start
_LONG_RUN = re.compile(r"""[^\s'"`]{%d,}""" % ECHO_CHARS)
MAX_MESSAGE_CHARS = 2048  # past this (a long value with spaces in it), the message keeps its head and tail


def capped(message: str) -> str:
    """``message`` with every long value it quotes cut to its start and its length (one place for every error:
    a body with a multi-megabyte bad value is not echoed back whole), and then, if still long, its middle."""
    if len(message) <= ECHO_CHARS:
        return message
    message = _LONG_RUN.sub(lambda m: f"{m[0][:_KEPT_CHARS]}... ({len(m[0])} characters)", message)
    if len(message) > MAX_MESSAGE_CHARS:
        head, tail = message[:MAX_MESSAGE_CHARS // 2], message[-MAX_MESSAGE_CHARS // 4:]
        message = f"{head}... ({len(message) - len(head) - len(tail)} characters left out) ...{tail}"
    return message


class APIError(Exception):
    """An error a client can act on; becomes a JSON response with ``status``. The message and ``param`` are
    ``capped``: they quote what the client sent up to a few hundred characters."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        message = capped(message)
        param = capped(param) if param is not None else None
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def error_response(err: APIError) -> web.Response:
    body = {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
    return web.Response(status=err.status, body=msgspec.json.encode(body), content_type="application/json", headers=err.headers)


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Every failure leaves as OpenAI-shaped JSON; no traceback ever reaches a client."""
    try:
        return await handler(request)
    except APIError as err:
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        type_ = "not_found_error" if exc.status == 404 else "invalid_request_error"
        kept = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}  # 405 says what is
        return error_response(APIError(exc.status, exc.reason or "request failed", type_, headers=kept))
    except SQLAlchemyError:
        # The policy database is down or saturated: nothing was admitted, so retrying is safe.
        logger.exception("policy database error on %s %s", request.method, request.path)
        return error_response(APIError(503, "the policy database is unavailable; retry shortly", "server_error",
                                       code="database_unavailable", headers={"Retry-After": "2"}))
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(APIError(500, "internal server error", "server_error"))


BODY_TIMEOUT_S = web.AppKey("body_timeout_s", float)


async def read_body(request: web.Request) -> bytes:
    """The whole request body; a 408 if it does not arrive within the app's ``BODY_TIMEOUT_S`` (a client
    that sends headers and then trickles or stalls does not keep a handler and a connection forever)."""
    timeout = request.app.get(BODY_TIMEOUT_S)
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise stalled_body(request, f"the request body did not arrive within {timeout:g} s") from None
    except web.RequestPayloadError as e:
        raise unreadable_body(e) from None
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, f"the request body is larger than this server's limit of {request.client_max_size} "
                            "bytes; send a shorter one (large offline work goes through /v1/files and /v1/batches)",
                       code="request_too_large") from None


def stalled_body(request: web.Request, message: str) -> APIError:
    """408 for a body that did not arrive in time. The connection is closed once the 408 is written, without
    the lingering read aiohttp would give the rest of the body: the client already had the body timeout."""
    http_protocol.close_without_lingering(request)
    return APIError(408, message, code="request_timeout", headers={"Connection": "close"})


def unreadable_body(err: web.RequestPayloadError) -> APIError:
    """400 for a body aiohttp could not read: one its Content-Encoding (gzip, deflate) cannot decode, or a
    broken chunked encoding. The connection is closed: what is left of the body cannot be skipped safely."""
    cause = err.__cause__ or err
    return APIError(400, f"the request body could not be read ({getattr(cause, 'message', cause)}); send it "
                         "uncompressed, or compressed as its Content-Encoding header says", code="invalid_body",
                    headers={"Connection": "close"})


REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID = web.RequestKey("request_id", str)
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@web.middleware
async def request_id_middleware(request: web.Request, handler):
    """Outermost: every response, errors included, carries the caller's X-Request-Id or a fresh one."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    request_id = given if _SAFE_ID.match(given) else uuid.uuid4().hex
    request[REQUEST_ID] = request_id  # streams set the header themselves: theirs leave before this returns
    response = await handler(request)
    if not response.prepared:
        response.headers[REQUEST_ID_HEADER] = request_id
    return response
