"""GatewayConfig refuses a parser name it has no parser for (a library user's "none" is None): an error when the
config is built, naming the field, rather than a 500 on every chat later."""

import random

import pytest

from gateway.config import GatewayConfig
from gateway.tool_parsers import REASONING_PARSERS, TOOL_PARSERS


@pytest.mark.parametrize("field, known", [("tool_call_parser", TOOL_PARSERS), ("reasoning_parser", REASONING_PARSERS)])
def test_parser_names_are_checked_when_the_config_is_built(field, known):
    for value in (None, "auto", random.choice(sorted(known))):
        assert getattr(GatewayConfig(**{field: value}), field) == value
    for value in ("none", "", f"x{random.randrange(10**6)}"):
        with pytest.raises(ValueError, match=field):
            GatewayConfig(**{field: value})
