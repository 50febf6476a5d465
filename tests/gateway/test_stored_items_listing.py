"""A stored Responses conversation's input items as ``GET /v1/responses/{id}/input_items`` lists them
(``gateway.responses.stored_items.listed``), read by the official ``openai`` client's own types: a user's message
with an ``input_image`` part is the client's input message with an input image (``detail`` as sent, else
``"auto"``, OpenAI's default), whether stored before parts omitted their unset fields (``file_id`` and ``detail``
kept as null) or after (left out), and a ``prompt_cache_breakpoint`` is kept as sent."""

import random

import msgspec
from openai._models import construct_type
from openai.types.responses import ResponseInputImage, ResponseInputText
from openai.types.responses.response_input_message_item import ResponseInputMessageItem
from openai.types.responses.response_item import ResponseItem

from gateway.responses import stored_items
from gateway.responses.request import input_items


def _old_row(item: dict) -> dict:
    """The item as rows stored before parts omitted their defaults: every field of an input_image part, null ones
    included."""
    parts = [{"type": "input_image", "image_url": None, "file_id": None, "detail": None, **p}
             if p["type"] == "input_image" else p for p in item["content"]]
    return {**item, "content": parts}


def test_listed_image_messages_are_the_clients_input_messages():
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    for _ in range(20):
        parts, want = [], []
        for _ in range(rng.randint(1, 4)):
            breakpoint = rng.choice([None, {"mode": "explicit"}, {"mode": "explicit", "ttl": rng.choice(["30m", "12h"])}])
            extra = {"prompt_cache_breakpoint": breakpoint} if breakpoint else {}
            if rng.random() < 0.5:
                detail = rng.choice([None, "auto", "low", "high", "original"])
                url = f"data:image/png;base64,{rng.randbytes(6).hex()}"
                parts.append({"type": "input_image", "image_url": url, **({"detail": detail} if detail else {}), **extra})
                want.append(("input_image", url, detail or "auto", breakpoint))
            else:
                text = rng.randbytes(4).hex()
                parts.append({"type": "input_text", "text": text, **extra})
                want.append(("input_text", text, None, breakpoint))
        stored = stored_items.stored(input_items([{"role": "user", "content": parts}]))[0]
        for row in (stored, _old_row(msgspec.json.decode(msgspec.json.encode(stored)))):
            item = construct_type(type_=ResponseItem, value=stored_items.listed(row))
            assert isinstance(item, ResponseInputMessageItem), (seed, row, type(item))
            got = []
            for part in item.content:
                assert isinstance(part, (ResponseInputImage, ResponseInputText)), (seed, part)
                bp = part.prompt_cache_breakpoint
                bp = None if bp is None else {k: v for k, v in bp.model_dump().items() if v is not None}
                got.append((part.type, part.image_url, part.detail, bp) if part.type == "input_image"
                           else (part.type, part.text, None, bp))
            assert got == want, seed
