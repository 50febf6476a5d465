"""A stored response's input items, as ``GET /v1/responses/{response_id}/input_items`` lists them.

Items are given ids when they are stored (clients may leave them out), and are listed in OpenAI's item shapes:
a message's content as parts (``input_text``, or ``output_text`` for the assistant's), every item with a
status.
"""

import msgspec

from gateway.responses.builder import new_item_id

_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def with_id(item: dict) -> dict:
    """The stored item: an input item as decoded (``type`` set), with an id of its own if it had none, without
    a reasoning item's ``encrypted_content`` (another server's, which this one can neither read nor render)."""
    kind = item.get("type") or "message"
    stored = {**item, "type": kind, "id": item.get("id") or new_item_id(_ID_PREFIX[kind])}
    stored.pop("encrypted_content", None)
    return stored


def stored(items: list) -> list[dict]:
    """A request's decoded input items as they are stored."""
    return [with_id(item) for item in msgspec.to_builtins(items)]


def listed(item: dict) -> dict:
    """A stored item as the list shows it."""
    out = {k: v for k, v in item.items() if v is not None}
    out["status"] = out.get("status") or "completed"
    for field in ("content", "output"):
        if isinstance(out.get(field), list) and out["type"] != "reasoning":
            out[field] = [_listed_part(part) for part in out[field]]
    if out["type"] == "message" and isinstance(out["content"], str):
        if out["role"] == "assistant":
            out["content"] = [{"type": "output_text", "text": out["content"], "annotations": []}]
        else:
            out["content"] = [{"type": "input_text", "text": out["content"]}]
    return out


def _listed_part(part: dict) -> dict:
    """A content part as OpenAI lists it: without null fields (rows stored before parts omitted theirs kept them),
    an ``input_image``'s ``detail`` ``"auto"`` where none was sent (OpenAI's default; clients' types require it:
    the openai client reads a user message whose image has no detail as an output message)."""
    out = {k: v for k, v in part.items() if v is not None}
    if out.get("type") == "input_image":
        out.setdefault("detail", "auto")
    return out


def page(items: list[dict], order: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
    """(one page of ``items`` in ``order``, starting after the item ``after``, at most ``limit``; whether more
    follow)."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [i["id"] for i in ordered]
        ordered = ordered[ids.index(after) + 1:] if after in ids else []
    return [listed(i) for i in ordered[:limit]], len(ordered) > limit
