"""How deeply a decoded request body nests, bounded for every field at once.

Free-form fields (a JSON schema in ``response_format``, a tool's ``parameters``, ``chat_template_kwargs``) are
walked later by recursive code: the chat template's renderer, ``json.dumps``, the grammar compiler. A value nested
hundreds of levels deep would exhaust Python's recursion there (a 500), so a body nested deeper than
``MAX_NESTING`` is a 400 naming the field, at decode, before anything else reads it. The walk is iterative and
stops at the first value past the bound.
"""

import msgspec

from gateway.errors import APIError

# Levels of objects and arrays, counted from the body itself. OpenAI allows 10 levels of nesting in a strict
# JSON schema; the body adds a few levels around it (tools[0].function.parameters), so 64 leaves ample room.
MAX_NESTING = 64


def _children(value):
    if isinstance(value, dict):
        return value.items()
    if isinstance(value, (list, tuple)):
        return enumerate(value)
    if isinstance(value, msgspec.Struct):
        return ((name, getattr(value, name)) for name in value.__struct_fields__)
    return ()


def _path(parts: tuple) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def too_deep(value, limit: int = MAX_NESTING) -> str | None:
    """The path (``tools[0].function.parameters``, at most three steps) to the first container nested deeper
    than ``limit``; None if nothing is."""
    stack = [(value, 1, ())]  # the body is level 1
    while stack:
        node, depth, path = stack.pop()
        for key, child in _children(node):
            if isinstance(child, (dict, list, tuple, msgspec.Struct)):
                where = path + (key,) if len(path) < 3 else path
                if depth + 1 > limit:
                    return _path(where)
                stack.append((child, depth + 1, where))
    return None


def check_nesting(body, limit: int = MAX_NESTING) -> None:
    """400 naming the field if ``body`` (a decoded request) nests deeper than ``limit`` levels."""
    where = too_deep(body, limit)
    if where is not None:
        raise APIError(400, f"{where} is nested more than {limit} levels deep; flatten it (a JSON schema can "
                            "name a shared part once in $defs and $ref it)", param=where)
