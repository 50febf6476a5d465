"""A ``POST /v1/responses`` body made ready to run: decoded and checked, after its stored conversation, as
the chat request it runs as, with its own input items encoded as they will be stored.

``prepare`` builds everything from the body's bytes and the stored rows in one call, which the route runs on a
worker thread when the body is large or continues a stored conversation: the tens of thousands of objects a
long conversation decodes into are made and freed there, and never held by the event loop (which would pay
for freeing them, and the garbage collector's walks over them, between other tenants' chunks).
"""

from typing import NamedTuple

import msgspec

from gateway.openai_schema import ChatCompletionRequest
from gateway.responses import stored_items
from gateway.responses.request import (
    FunctionTool, ResponsesRequest, decode_request, stored_input_items, stored_output_items,
)
from gateway.responses.translate import chat_request
from tenants.response_store import StoredRow


class Prepared(NamedTuple):
    req: ResponsesRequest  # its ``input`` emptied: the items are in ``chat`` and ``inputs``
    tools: list[FunctionTool]
    chat: ChatCompletionRequest
    inputs: msgspec.Raw  # this request's input items as stored (each with an id), encoded


class _Head(msgspec.Struct):
    """The fields the route needs before the rest of the body is decoded."""

    previous_response_id: str | None = None


def previous_response_id(data: bytes) -> str | None:
    """The body's ``previous_response_id``, read without building the rest (None where the body does not
    say, or does not decode: ``prepare`` then names what is wrong with it)."""
    try:
        return msgspec.json.decode(data, type=_Head).previous_response_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def prepare(data: bytes, history: list[StoredRow]) -> Prepared:
    """The request in ``data`` after the stored conversation ``history`` (its rows, oldest first); a 400 naming
    the field if the body is bad."""
    req, items, tools = decode_request(data)
    earlier = [item for row in history
               for item in (*stored_input_items(row.input_json), *stored_output_items(row.response_json))]
    chat = chat_request(req, earlier + items, tools)
    inputs = msgspec.Raw(msgspec.json.encode(stored_items.stored(items)))
    return Prepared(msgspec.structs.replace(req, input=[]), tools, chat, inputs)
