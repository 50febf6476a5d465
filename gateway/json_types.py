"""Request bodies decoded with JSON's own types: an integral number (``2.0``) is taken for an integer field,
as JSON Schema counts it one, and nothing else is converted (``"5"`` is not a number, ``1`` not a boolean)."""

import msgspec

_JSON_NAMES = {bool: "bool", int: "int", float: "float", str: "str", type(None): "null", list: "array", dict: "object"}


def decode_typed(data: bytes, cls):
    """``data`` decoded as ``cls``; a ``msgspec.ValidationError`` naming the place where a value has another
    JSON type than the field's (msgspec's lax mode would convert ``"5"``, ``"true"``, ``1`` and ``"null"``).

    Strict first (nearly every body passes it, at no extra cost); a body that fails it is decoded in lax
    mode and compared with its plain JSON value, so only integral numbers for integer fields get through.
    """
    try:
        return msgspec.json.decode(data, type=cls)
    except msgspec.ValidationError as strict_error:
        try:
            lax = msgspec.json.decode(data, type=cls, strict=False)
        except msgspec.ValidationError:
            raise strict_error from None
    place = _converted(msgspec.json.decode(data), msgspec.to_builtins(lax), "$")
    if place is not None:
        path, expected, given = place
        raise msgspec.ValidationError(f"Expected `{expected}`, got `{given}` - at `{path}`")
    return lax


def _converted(raw, decoded, path: str) -> tuple[str, str, str] | None:
    """(path, the field's type, the JSON type sent) of the first value lax decoding converted to another JSON
    type, other than an integral number to an integer or an integer to a float; None if there is none."""
    if isinstance(raw, dict) and isinstance(decoded, dict):
        for key, value in raw.items():
            if key in decoded:
                found = _converted(value, decoded[key], f"{path}.{key}" if path == "$" or key.isidentifier()
                                   else f"{path}[...]")
                if found:
                    return found
        return None
    if isinstance(raw, list) and isinstance(decoded, list):
        for i, (value, out) in enumerate(zip(raw, decoded)):
            found = _converted(value, out, f"{path}[{i}]")
            if found:
                return found
        return None
    kinds = (type(raw), type(decoded))
    if kinds[0] is kinds[1] or kinds in ((float, int), (int, float)):
        return None
    return path, _JSON_NAMES.get(kinds[1], kinds[1].__name__), _JSON_NAMES.get(kinds[0], kinds[0].__name__)
