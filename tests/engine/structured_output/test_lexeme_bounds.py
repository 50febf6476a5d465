"""The counted length of a regex against Python's own regex parser, on fresh random regexes; and which grammars
the bound refuses, with words naming the part at fault."""

import random
import re

import pytest

try:
    from re import _parser as sre_parse  # Python 3.11+
except ImportError:  # pragma: no cover
    import sre_parse

from engine.core.structured_output_spec import StructuredOutput
from engine.structured_output.grammar import grammar_of
from engine.structured_output.lexeme_bounds import MAX_LEXEME_CHARS, check_schema, regex_chars


def _random_regex(rng: random.Random, depth: int = 0) -> str:
    """A regex of literals, escapes, classes, groups, alternations and bounded quantifiers (no ``*``, ``+`` or
    anchors: there Python's longest match and the counted length agree)."""
    parts = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(6 if depth < 3 else 3)
        if kind == 0:
            atom = rng.choice("abcxyz-_ ")
        elif kind == 1:
            atom = rng.choice([r"\d", r"\w", r"\.", r"\{", r"\|", r"\(", r"\[", r"\]"])
        elif kind == 2:
            atom = rng.choice(["[a-c]", "[^x]", "[]a]", "[{}|()]", r"[\]\\]", "[0-9a-f]"])
        elif kind == 3:
            atom = "(" + _random_regex(rng, depth + 1) + ")"
        elif kind == 4:
            atom = "(?:" + _random_regex(rng, depth + 1) + "|" + _random_regex(rng, depth + 1) + ")"
        else:
            atom = "(" + "|".join(_random_regex(rng, depth + 1) for _ in range(rng.randint(2, 3))) + ")"
        quantifier = rng.randrange(5)
        if quantifier == 1:
            atom += "{%d}" % rng.randint(0, 40)
        elif quantifier == 2:
            low = rng.randint(0, 20)
            atom += "{%d,%d}" % (low, low + rng.randint(0, 30))
        elif quantifier == 3:
            atom += "?"
        parts.append(atom)
    return "".join(parts)


def test_counted_length_is_pythons_longest_match():
    rng = random.Random()
    for _ in range(400):
        regex = _random_regex(rng)
        re.compile(regex)
        assert regex_chars(regex) == sre_parse.parse(regex).getwidth()[1], regex


@pytest.mark.parametrize("regex,chars", [
    ("a*", 1), ("(ab)+", 2), ("a{3,}", 3), ("(?i)abc", 3), (r"\p{L}{5}", 5), (r"\x{41}{4}", 4), ("(?P<n>ab){7}", 14),
])
def test_loops_count_once_and_escapes_are_one_character(regex, chars):
    assert regex_chars(regex) == chars


@pytest.mark.parametrize("spec,named", [
    (StructuredOutput(regex="(ab){100000}"), "regular expression"),
    (StructuredOutput(regex="((a{100}){100}){100}"), "regular expression"),
    (StructuredOutput(regex="x" * (MAX_LEXEME_CHARS + 1)), "regular expression"),
    (StructuredOutput(choice=["yes", "a" * (MAX_LEXEME_CHARS + 1)]), "choice 1"),
    (StructuredOutput(json_schema='{"type": "string", "pattern": "^a{10000}$"}'), "pattern"),
    (StructuredOutput(json_schema='{"type": "object", "properties": {"k": {"const": "%s"}}}' % ("z" * 5000)),
     "properties.k.const"),
    (StructuredOutput(json_schema='{"enum": ["ok", "%s"]}' % ("q" * 5000)), "enum[1]"),
    (StructuredOutput(json_schema='{"type": "object", "properties": {"%s": {"type": "integer"}}}' % ("p" * 5000)),
     "property name"),
])
def test_a_long_lexeme_is_refused_before_compiling(spec, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        grammar_of(spec)


@pytest.mark.parametrize("spec", [
    StructuredOutput(regex=r"\d{4}-\d{2}-\d{2}"),
    StructuredOutput(regex="[a-z ]{1,%d}" % MAX_LEXEME_CHARS),
    StructuredOutput(regex="(yes|no)+"),
    StructuredOutput(choice=["a" * MAX_LEXEME_CHARS]),
    StructuredOutput(json_schema='{"type": "string", "minLength": 100000}'),
    # Data keywords are not compiled: a long default or example is no lexeme.
    StructuredOutput(json_schema='{"type": "string", "default": "%s", "examples": [{"pattern": "a{99999}"}]}'
                     % ("d" * 9000)),
    # Definitions' names are no lexemes, whatever they are called.
    StructuredOutput(json_schema='{"$defs": {"const": {"enum": [%s]}}, "$ref": "#/$defs/const"}'
                     % ", ".join(f'"v{i}"' for i in range(2000))),
])
def test_usual_grammars_pass(spec):
    assert grammar_of(spec)


def test_a_deep_schema_is_walked_without_recursion():
    schema = {"type": "string", "pattern": "a{%d}" % (MAX_LEXEME_CHARS + 1)}
    for _ in range(50_000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(ValueError, match="pattern"):
        check_schema(schema)


def test_deeply_nested_groups_are_counted_without_recursion():
    depth = random.randrange(20_000, 60_000)
    assert regex_chars("(" * depth + "ab" + ")" * depth + "{3}") == 6
    with pytest.raises(ValueError):  # the grammar library's own nesting limit: a plain refusal
        grammar_of(StructuredOutput(regex="(" * depth + "a" + ")" * depth))
    with pytest.raises(ValueError, match="regular expression"):
        grammar_of(StructuredOutput(regex="(" * depth + "a{5000}" + ")" * depth))


def test_a_refusal_names_the_place_in_the_schema():
    name = "".join(random.choice("abcdef") for _ in range(6))
    schema = {"type": "object", "properties": {name: {"prefixItems": [
        {"type": "string"}, {"type": "string", "pattern": "b{%d}" % (MAX_LEXEME_CHARS + 1)}]}}}
    with pytest.raises(ValueError, match=re.escape(f"the schema's properties.{name}.prefixItems[1].pattern")):
        check_schema(schema)
    with pytest.raises(ValueError, match=re.escape(f"the schema's top.properties.{name}.prefixItems[1].pattern")):
        check_schema(schema, "top")
