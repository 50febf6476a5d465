"""How long a text a grammar's single token-level pattern (lexeme) spells out, bounded before it is compiled.

The grammar library's lexer works on one lexeme as an expression whose size grows with the text it spells out:
a literal of n characters, or a counted repetition such as ``a{n}`` or ``(ab){n}``. Every mask it computes
(one per generated token, inside the engine's step, where every other request waits) takes time in proportion
to that size, and the library's fuel limits do not bound it: measured on the demo model's 1,315-token vocabulary,
``(ab){100000}`` held each step about 200 ms and its first mask seconds, ``a{1000}`` 0.5 ms. So the counted
length of every regex, literal choice, JSON schema ``pattern``, ``const``, ``enum`` value and property name is
bounded by ``MAX_LEXEME_CHARS`` before compiling; unbounded loops (``*``, ``+``) cost the lexer nothing per
repetition and are not counted, and neither are JSON strings' ``minLength`` / ``maxLength`` (compiled as loops).
"""

import json
from typing import Any

# About 2 ms per mask on the demo vocabulary at the bound (0.4 us per counted character), so a request's grammar
# can cost a step only a little more than the model's own work for it.
MAX_LEXEME_CHARS = 4096


def _class_end(regex: str, i: int) -> int:
    """The index after the character class that opens at ``regex[i] == '['`` (classes nest in this syntax)."""
    depth, i = 0, i
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            depth += 1
            i += 1
            # A ']' (after an optional '^') right at a class's start is a literal.
            if i < len(regex) and regex[i] == "^":
                i += 1
            if i < len(regex) and regex[i] == "]":
                i += 1
            continue
        if c == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


def _escape_end(regex: str, i: int) -> int:
    """The index after the escape at ``regex[i] == '\\'``: ``\\p{..}``, ``\\x{..}``, ``\\u{..}`` hold braces."""
    if i + 1 < len(regex) and regex[i + 1] in "pPxuU" and i + 2 < len(regex) and regex[i + 2] == "{":
        end = regex.find("}", i + 3)
        return len(regex) if end < 0 else end + 1
    if i + 1 < len(regex) and regex[i + 1] == "x":
        return min(i + 4, len(regex))
    return i + 2


def _counted(regex: str, i: int) -> tuple[int, int] | None:
    """(the count a ``{n}``, ``{n,}`` or ``{n,m}`` at ``regex[i]`` repeats by at most (n when open), the index after
    it); None if no counted repetition starts there."""
    end = regex.find("}", i)
    if end < 0:
        return None
    parts = regex[i + 1:end].replace(" ", "").split(",")
    if len(parts) > 2 or not parts[0].isdigit() or (len(parts) == 2 and parts[1] and not parts[1].isdigit()):
        return None
    return int(parts[-1] if len(parts) == 2 and parts[1] else parts[0]), end + 1


def regex_chars(regex: str) -> int:
    """The counted length of ``regex`` (Rust ``regex`` syntax): a sequence adds its parts, an alternation takes its
    longest branch, ``{n}`` / ``{n,m}`` multiply by their largest count, ``*``, ``+`` and ``?`` by one (loops), a
    character, escape or class counts one. For a regex without ``*`` and ``+`` it is the longest match's length.
    Iterative (a stack of open groups), so thousands of nested groups cannot exhaust Python's stack."""

    def quantified(value: int, i: int) -> tuple[int, int]:
        while i < len(regex):  # quantifiers, possibly stacked, possibly lazy
            if regex[i] in "*+?":
                i += 1
            elif regex[i] == "{" and (count := _counted(regex, i)) is not None:
                value, i = value * count[0], count[1]
            else:
                break
        return value, i

    groups = [[0, 0]]  # per open group: [its longest finished branch, the branch so far]
    i = 0
    while i < len(regex):
        c = regex[i]
        if c == "(":
            i += 1
            if regex.startswith("?", i):  # (?:..), (?P<name>..), (?<name>..), (?flags:..), (?flags)
                while i < len(regex) and regex[i] not in ":)>":
                    i += 1
                if i < len(regex) and regex[i] == ")":  # flags only: no group
                    i += 1
                    continue
                i += 1
            groups.append([0, 0])
            continue
        if c == "|":
            top = groups[-1]
            top[0], top[1] = max(top[0], top[1]), 0
            i += 1
            continue
        if c == ")":
            if len(groups) == 1:  # unbalanced: the library refuses the regex; count on as an alternation
                groups[0] = [max(groups[0]), 0]
                i += 1
                continue
            best, total = groups.pop()
            value, i = quantified(max(best, total), i + 1)
        elif c == "[":
            value, i = quantified(1, _class_end(regex, i))
        elif c == "\\":
            value, i = quantified(1, _escape_end(regex, i))
        else:
            value, i = quantified(1, i + 1)
        groups[-1][1] += value
    while len(groups) > 1:  # unclosed groups: the library refuses the regex
        best, total = groups.pop()
        groups[-1][1] += max(best, total)
    return max(groups[0])


def _too_long(what: str, chars: int) -> ValueError:
    return ValueError(f"{what} spells out {chars:,} characters; at most {MAX_LEXEME_CHARS:,} are enforced (counting "
                      "each {n} repetition n times): bound the output's length with max_tokens instead")


def check_regex(regex: str, what: str = "the regular expression") -> None:
    """ValueError if ``regex`` counts more than ``MAX_LEXEME_CHARS`` characters (``regex_chars``)."""
    if (chars := regex_chars(regex)) > MAX_LEXEME_CHARS:
        raise _too_long(what, chars)


def check_literal(text: str, what: str) -> None:
    if len(text) > MAX_LEXEME_CHARS:
        raise _too_long(what, len(text))


# Keywords whose values are data, not schemas: nothing in them is compiled.
_DATA_KEYWORDS = frozenset({"default", "examples", "description", "title", "$comment"})


def _path(ref) -> str:
    """The dotted path a chain of ``(parent, segment)`` links spells (built only when a check fails: joined at each
    level, a deep schema's paths would cost time quadratic in its depth)."""
    parts = []
    while ref is not None:
        ref, segment = ref
        parts.append(segment)
    text = "".join(reversed(parts))
    return text[1:] if text.startswith(".") else text  # a key at the top: no dot before it


def check_schema(schema: Any, where: str = "") -> None:
    """ValueError if a JSON schema's ``pattern`` or ``patternProperties`` regex, ``const`` or ``enum`` value, or
    property name counts more than ``MAX_LEXEME_CHARS`` characters. Iterative: a deep schema cannot exhaust the
    stack here, and each node's place is a link to its parent's (``_path``)."""
    todo = [(schema, (None, where) if where else None)]
    while todo:
        node, at = todo.pop()
        if isinstance(node, list):
            todo.extend((v, (at, f"[{i}]")) for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            path = (at, f".{key}")
            if key in _DATA_KEYWORDS:
                continue
            if key == "pattern" and isinstance(value, str):
                check_regex(value, f"the schema's {_path(path)}")
            elif key == "const":
                check_literal(value if isinstance(value, str) else json.dumps(value), f"the schema's {_path(path)}")
            elif key == "enum" and isinstance(value, list):
                for i, v in enumerate(value):
                    check_literal(v if isinstance(v, str) else json.dumps(v), f"the schema's {_path(path)}[{i}]")
            elif key in ("$defs", "definitions", "dependentSchemas") and isinstance(value, dict):
                todo.extend((v, (path, f".{name}")) for name, v in value.items())  # names, not lexemes
            elif key in ("properties", "patternProperties") and isinstance(value, dict):
                for name in value:
                    if key == "properties":
                        check_literal(name, f"a property name in the schema's {_path(path)}")
                    else:
                        check_regex(name, f"a pattern in the schema's {_path(path)}")
                todo.extend((v, (path, f".{name}")) for name, v in value.items())
            else:
                todo.append((value, path))
