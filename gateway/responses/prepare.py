"""A ``POST /v1/responses`` body made ready to run: decoded and checked, after its stored conversation, as
the chat request it runs as, with its own input items encoded as they will be stored.

``prepare`` builds everything from the body's bytes and the stored rows in one call, which the route runs on a
worker thread when the body is large or continues a stored conversation: the tens of thousands of objects a
long conversation decodes into are made and freed there, and never held by the event loop (which would pay
for freeing them, and the garbage collector's walks over them, between other tenants' chunks).
"""

from typing import Any, NamedTuple

import msgspec

from gateway.openai_schema import ChatCompletionRequest, NonEmptyText, decode_json
from gateway.responses import stored_items
from gateway.responses.request import (
    FunctionTool, MaxOutputTokens, ResponsesRequest, decode_request, stored_input_items, stored_output_items,
)
from gateway.responses.translate import chat_request
from tenants.response_store import StoredRow


class Prepared(NamedTuple):
    req: ResponsesRequest  # its ``input`` emptied: the items are in ``chat`` and ``inputs``
    tools: list[FunctionTool]
    chat: ChatCompletionRequest
    inputs: msgspec.Raw  # this request's input items as stored (each with an id), encoded
    places: list[str | None]  # each chat message's source (input[k], instructions, previous_response_id)


class Head(msgspec.Struct):
    """The fields the route needs before the rest of the body is decoded (each checked again by ``prepare``).
    Typed as ``ResponsesRequest`` types them, so that a value it refuses is no head at all: the route then asks
    nothing of the store for it (a max_output_tokens past its bound is not counted against the tenant's
    stored-response cap, an empty previous_response_id is not looked up), and ``prepare`` names the field."""

    previous_response_id: NonEmptyText | None = None
    store: bool | None = None
    max_output_tokens: MaxOutputTokens | None = None


# Stored bytes counted for each output token a response may make before it runs (the rest of its stored size is
# its body's, counted whole, and RESPONSE_OVERHEAD_BYTES of ids, usage and status); the store checks the exact
# size when it stores (docs/decisions/stored-responses-cap.md).
STORED_BYTES_PER_OUTPUT_TOKEN = 4
RESPONSE_OVERHEAD_BYTES = 1024


def stored_bound(body_bytes: int, max_output_tokens: int | None, default_output_tokens: int) -> int:
    """Bytes a request of ``body_bytes`` is counted as storing before it runs: its body, and its output at up to
    ``max_output_tokens`` (``default_output_tokens`` where it sets none, as admission reserves tokens)."""
    output = max_output_tokens if max_output_tokens is not None else default_output_tokens
    return body_bytes + RESPONSE_OVERHEAD_BYTES + STORED_BYTES_PER_OUTPUT_TOKEN * output


class _RawHead(msgspec.Struct):
    """``Head``'s fields as sent, whatever their JSON values (the rest of the body skipped)."""

    previous_response_id: Any = None
    store: Any = None
    max_output_tokens: Any = None


def head(data: bytes) -> Head | None:
    """The body's ``Head``, read without building the rest; None where it does not decode (``prepare`` then
    names what is wrong with the body). Its fields are typed by ``decode_json`` as ``prepare`` types them (a
    whole-number float such as ``5.0`` is the integer): a head refused where the body is taken would run the
    request without its stored conversation and past the stored-response cap's check."""
    try:
        raw = msgspec.json.decode(data, type=_RawHead)
        return decode_json(msgspec.json.encode(raw), Head)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError):
        return None


def prepare(data: bytes, history: list[StoredRow]) -> Prepared:
    """The request in ``data`` after the stored conversation ``history`` (its rows, oldest first); a 400 naming
    the field if the body is bad."""
    req, items, tools = decode_request(data)
    earlier = [item for row in history
               for item in (*stored_input_items(row.input_json), *stored_output_items(row.response_json))]
    places: list[str | None] = []
    chat = chat_request(req, earlier + items, tools, len(earlier), places)
    inputs = msgspec.Raw(msgspec.json.encode(stored_items.stored(items)))
    return Prepared(msgspec.structs.replace(req, input=[]), tools, chat, inputs, places)
