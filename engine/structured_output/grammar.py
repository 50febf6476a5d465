"""StructuredOutput -> llguidance grammar, validated without a tokenizer and cached.

llguidance was chosen over xgrammar by measurement (benchmarks/structured_output_backends.py, recorded in
docs/decisions/structured-output-library.md): it builds its token masks lazily, so preparing a schema costs about a millisecond
whatever the vocabulary (xgrammar's compile grows with it: ~35 ms at 32k tokens), its per-step masks cost
about the same, and every output it allowed was valid JSON, while xgrammar let raw control characters
into strings (text that strict JSON parsers, Python's included, refuse).
"""

import functools
import json

import llguidance

from engine.core.structured_output import StructuredOutput

# Compact JSON: with flexible whitespace a model (a random one certainly) can emit spaces and newlines
# without end, and clients parse the compact form the same.
_JSON_OPTIONS = {"whitespace_flexible": False}
_ANY_OBJECT = json.dumps({"type": "object"})


def _checked(build, *args) -> str:
    """``build(*args)``'s grammar if llguidance takes it; ValueError (the library's message) if not."""
    try:
        grammar = build(*args)
    except ValueError as e:
        raise ValueError(str(e)) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(error)
    return grammar


@functools.lru_cache(maxsize=1024)
def _grammar_for_schema(schema: str) -> str:
    """A schema's llguidance grammar; ValueError (the library's message) if it cannot be enforced."""
    # JSON Schema's boolean schemas, which llguidance takes only as objects: true is {}, false allows nothing.
    if json.loads(schema) is True:
        schema = "{}"
    elif json.loads(schema) is False:
        raise ValueError("the schema `false` allows no value at all")
    return _checked(lambda text: llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS), schema)


@functools.lru_cache(maxsize=1024)
def _grammar_for(kind: str, text: str) -> str:
    """A regex's or a Lark grammar's llguidance grammar; ValueError (the library's message) if it is refused."""
    return _checked(llguidance.grammar_from, kind, text)


def grammar_of(spec: StructuredOutput) -> str:
    """The grammar enforcing ``spec`` (cached by its text); ValueError saying why it is refused."""
    if spec.regex is not None:
        return _grammar_for("regex", spec.regex)
    if spec.choice is not None:  # one Lark rule of quoted literals: no escaping rules of a regex to get wrong
        return _grammar_for("lark", "start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return _grammar_for_schema(_ANY_OBJECT if spec.json_object else spec.json_schema)
