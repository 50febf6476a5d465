"""OpenAI's ``prompt_cache_breakpoint`` on a content part (chat's and the Responses API's): its type, and the
limit of ``MAX_BREAKPOINTS`` a request may set.

A breakpoint marks where a reusable prompt prefix ends. This server's prefix cache keeps every full block of
every prompt per tenant whether marked or not (``gateway.prefix_index``), so a breakpoint changes neither what
is cached nor an answer: it is checked as OpenAI checks it, and kept where the request's items are stored.
"""

from collections.abc import Iterable
from typing import Literal

import msgspec

from gateway.errors import APIError

MAX_BREAKPOINTS = 4  # per request, as OpenAI's API counts them (a stored conversation's earlier ones not counted)


class PromptCacheBreakpoint(msgspec.Struct, forbid_unknown_fields=True):
    """``{"mode": "explicit", "ttl": "30m" | "12h"}``; ``ttl`` left out inherits the request's."""

    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


def check_breakpoint_count(parts: Iterable[tuple[str, object]]) -> None:
    """400 naming the first breakpoint past ``MAX_BREAKPOINTS`` among ``parts``: (place, part) of every content part
    the request itself sends, in order."""
    count = 0
    for place, part in parts:
        if getattr(part, "prompt_cache_breakpoint", None) is None:
            continue
        count += 1
        if count > MAX_BREAKPOINTS:
            raise APIError(400, f"{place}.prompt_cache_breakpoint is this request's breakpoint number {count}: a "
                                f"request may set at most {MAX_BREAKPOINTS} prompt cache breakpoints (those of a "
                                "conversation stored under previous_response_id do not count); keep the ones that "
                                "end the prefixes you reuse and remove the rest",
                           param=f"{place}.prompt_cache_breakpoint", code="invalid_value")
