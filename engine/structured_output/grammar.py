"""StructuredOutput -> llguidance grammar, checked and cached.

llguidance was chosen over xgrammar by measurement (benchmarks/structured_output_backends.py, recorded in
docs/decisions/structured-output-library.md): it builds its token masks lazily, so preparing a schema costs about a millisecond
whatever the vocabulary (xgrammar's compile grows with it: ~35 ms at 32k tokens), its per-step masks cost
about the same, and every output it allowed was valid JSON, while xgrammar let raw control characters
into strings (text that strict JSON parsers, Python's included, refuse).

Compiling a schema costs time and memory that grow with it (a 3,000-property schema takes about a second, a
12,000-property one crashes the library's compiler), so a schema is bounded in size before it is compiled,
compiled under ``GRAMMAR_LIMITS`` and checked by building a matcher over a byte-level vocabulary (the library's
compiler releases the GIL: callers run this on a worker thread). The library's own messages may carry a native
backtrace; ``client_message`` keeps those from clients.
"""

import json

import llguidance

from engine.core.structured_output_spec import StructuredOutput
from engine.structured_output.byte_budget_cache import ByteBudgetCache
from engine.structured_output.lexeme_bounds import check_literal, check_regex, check_schema
from engine.structured_output.satisfiable import unsatisfiable_reason

# Compact JSON: with flexible whitespace a model (a random one certainly) can emit spaces and newlines
# without end, and clients parse the compact form the same.
_JSON_OPTIONS = {"whitespace_flexible": False}
_ANY_OBJECT = json.dumps({"type": "object"})
# The largest schema (JSON text) compiled. Compile time grows faster than the schema (about 4,000 plain
# properties fit; they take ~1 s on one core), and memory with it.
MAX_SCHEMA_BYTES = 128 * 1024
# The library's resource limits, everywhere a grammar is compiled or run. verbose_errors off: its detailed
# errors quote parser state, not for clients.
GRAMMAR_LIMITS = dict(verbose_errors=False)
# Checked grammars kept, by the bytes of their schema and grammar text.
GRAMMAR_CACHE_BYTES = 16 * 1024 * 1024
_GRAMMARS: ByteBudgetCache[str] = ByteBudgetCache(GRAMMAR_CACHE_BYTES)


def limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**GRAMMAR_LIMITS)


def client_message(error: str) -> str:
    """The grammar library's error as a client may see it: never a native panic or backtrace."""
    if "panic" in error or "backtrace" in error.lower():
        return "the grammar library could not compile it (it is too large or too complex)"
    return " ".join(error.split())[:300] or "refused by the grammar library"


class _ByteTokenizer:
    """A vocabulary of the 256 bytes and an end token: enough for the library to compile and check a grammar."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text):
        return list(text if isinstance(text, bytes) else text.encode())


_BYTES = None


def _byte_tokenizer() -> llguidance.LLTokenizer:
    global _BYTES
    if _BYTES is None:
        _BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
    return _BYTES


def _checked(grammar: str) -> str:
    """``grammar`` if a matcher over bytes compiles it (the same limits as the engine's); ValueError if not."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0, limits=limits())
    if matcher.is_error():
        raise ValueError(client_message(matcher.get_error()))
    return grammar


def _compile_schema(schema: str) -> str:
    """A schema's llguidance grammar; ValueError (what a client may read) if it cannot be enforced."""
    if len(schema) > MAX_SCHEMA_BYTES:
        raise ValueError(f"the schema is {len(schema):,} bytes of JSON; at most {MAX_SCHEMA_BYTES:,} are compiled")
    # JSON Schema's boolean schemas, which llguidance takes only as objects: true is {}, false allows nothing.
    value = json.loads(schema)
    if value is True:
        schema = "{}"
    elif value is False:
        raise ValueError("the schema `false` allows no value at all")
    check_schema(value)  # before compiling: a long lexeme costs every step its request is in
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except ValueError as e:
        raise ValueError(client_message(str(e))) from None
    _checked(grammar)
    try:
        reason = unsatisfiable_reason(schema)
    except RecursionError:
        raise ValueError("the schema is nested too deeply") from None
    if reason:
        raise ValueError(reason)
    return grammar


def _compile_text(kind: str, text: str) -> str:
    """A regex's or a Lark grammar's llguidance grammar; ValueError (what a client may read) if it is refused."""
    if len(text) > MAX_SCHEMA_BYTES:
        raise ValueError(f"the {kind} is {len(text):,} bytes; at most {MAX_SCHEMA_BYTES:,} are compiled")
    try:
        grammar = llguidance.grammar_from(kind, text)
    except ValueError as e:
        raise ValueError(client_message(str(e))) from None
    return _checked(grammar)


def _compile(spec: StructuredOutput) -> str:
    if spec.regex is not None:
        check_regex(spec.regex)
        return _compile_text("regex", spec.regex)
    if spec.choice is not None:  # one Lark rule of quoted literals: no escaping rules of a regex to get wrong
        for i, choice in enumerate(spec.choice):
            check_literal(choice, f"choice {i}")
        return _compile_text("lark", "start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return _compile_schema(_ANY_OBJECT if spec.json_object else spec.json_schema)


def cached_grammar(spec: StructuredOutput) -> str | None:
    """``spec``'s grammar if it was checked before (no compile)."""
    return _GRAMMARS.get(spec.cache_key)


def grammar_of(spec: StructuredOutput) -> str:
    """The grammar enforcing ``spec`` (cached by ``spec.cache_key``); ValueError saying why it is refused.
    Compiling may take a second or more for a large schema: call it off an event loop or an engine step."""
    key = spec.cache_key
    grammar = _GRAMMARS.get(key)
    if grammar is None:
        grammar = _compile(spec)
        _GRAMMARS.put(key, grammar, len(key) + len(grammar))
    return grammar
