"""Whether a JSON schema admits any finite value at all.

A recursive ``$ref`` with no way out (an object whose required property is the object itself) describes only
infinite values. The grammar library accepts it and lets a model write ``{"a":{"a":...`` until ``max_tokens``, so
such a schema is refused when it is checked instead. The analysis is a least fixpoint over the schema's local
``$ref`` targets: a target is finite once some way through it ends, assuming only targets already shown finite.
Keywords it does not model are taken as satisfiable (the grammar library judges them).
"""

import json

def unsatisfiable_reason(schema_text: str) -> str | None:
    """Why no finite JSON value matches the schema, or None when one may."""
    root = json.loads(schema_text)
    finite: dict[str, bool] = {}  # local $ref -> shown finite (so far)
    while True:  # each round shows at least one more target finite, or ends
        before = dict(finite)
        result = _finite(root, root, finite, set())
        if finite == before:
            return None if result else ("the schema allows only infinite values (a $ref that always "
                                        "recurses, with no required way out)")


def _resolve(root, ref: str):
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _finite(node, root, finite: dict[str, bool], seen: set[str]) -> bool:
    """One round: each $ref target is looked into once (``seen``); a target not yet shown finite counts as
    infinite meanwhile, so a cycle that must go through itself never ends."""
    if node is True or not isinstance(node, dict):
        return node is not False
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = _resolve(root, ref)
        if target is None:
            return True  # not a local reference: the grammar library says what it makes of it
        if not finite.get(ref, False) and ref not in seen:
            seen.add(ref)
            if _finite(target, root, finite, seen):
                finite[ref] = True
        if not finite.get(ref, False):
            return False
    if "enum" in node or "const" in node:
        return True
    if isinstance(node.get("allOf"), list) and not all(_finite(s, root, finite, seen) for s in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and node[key] and not any(_finite(s, root, finite, seen) for s in node[key]):
            return False
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    if types is None:
        # No type given: an object or array description still leaves scalars, unless the structure says otherwise.
        return _object_finite(node, root, finite, seen) or _array_finite(node, root, finite, seen) or not (
            "properties" in node or "items" in node)
    if any(t not in ("object", "array") for t in types):  # a scalar (or a type the grammar library judges)
        return True
    return ("object" in types and _object_finite(node, root, finite, seen)) or (
        "array" in types and _array_finite(node, root, finite, seen))


def _object_finite(node, root, finite, seen) -> bool:
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    extra = node.get("additionalProperties", True)
    for name in required:
        schema = properties.get(name, extra) if isinstance(name, str) else True
        if not _finite(schema, root, finite, seen):
            return False
    return True


def _array_finite(node, root, finite, seen) -> bool:
    min_items = node.get("minItems", 0)
    if not isinstance(min_items, int) or min_items <= 0:
        return True
    prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
    items = node.get("items", True)
    needed = [prefix[i] if i < len(prefix) else items for i in range(min(min_items, len(prefix) + 1))]
    return all(_finite(s, root, finite, seen) for s in needed)
