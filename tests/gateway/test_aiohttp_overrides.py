"""``gateway/http_protocol.py`` replaces private methods of aiohttp's ``RequestHandler`` (aiohttp has no public
hook for them). This fails loudly when the installed aiohttp leaves the version range pyproject.toml pins, or
when a method it replaces, or a private attribute the replacements read, is gone or has another signature;
``tests/gateway/test_connections.py`` and ``test_hostile_input.py`` check what the replacements do."""

import inspect
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from gateway import http_protocol

# The signatures the replacements are written against: (parameter names, is a coroutine function).
EXPECTED = {
    "handle_error": (["self", "request", "status", "exc", "message"], False),
    "connection_made": (["self", "transport"], False),
    "log_exception": (["self", "args", "kw"], False),
    "finish_response": (["self", "request", "resp", "start_time"], True),
}


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def test_installed_aiohttp_is_in_the_pinned_range():
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    spec = next(d for d in pyproject["project"]["dependencies"] if re.match(r"aiohttp\b", d))
    lower = re.search(r">=\s*([\d.]+)", spec)
    upper = re.search(r"<\s*([\d.]+)", spec)
    assert lower and upper, f"pyproject.toml must pin aiohttp to a range with both bounds, not {spec!r}"
    installed = _version_tuple(version("aiohttp"))
    assert _version_tuple(lower.group(1)) <= installed < _version_tuple(upper.group(1)), (
        f"aiohttp {version('aiohttp')} is outside {spec!r}: check gateway/http_protocol.py against it")


def test_the_private_methods_replaced_still_exist_with_their_signatures():
    originals = {"handle_error": http_protocol._aiohttp_handle_error,
                 "connection_made": http_protocol._aiohttp_connection_made,
                 "log_exception": http_protocol._aiohttp_log_exception,
                 "finish_response": http_protocol._aiohttp_finish_response}
    assert set(originals) == set(EXPECTED)
    for name, (params, is_coroutine) in EXPECTED.items():
        original = originals[name]
        assert original.__module__ == "aiohttp.web_protocol", f"{name}: kept a replacement, not aiohttp's own"
        assert list(inspect.signature(original).parameters) == params, (
            f"aiohttp's RequestHandler.{name} is now {inspect.signature(original)}; "
            "gateway/http_protocol.py replaces it and must be rewritten for it")
        assert inspect.iscoroutinefunction(original) is is_coroutine, f"RequestHandler.{name}: sync/async changed"
    # What the replacements read or call besides the methods they wrap.
    assert "_manager" in RequestHandler.__slots__, "_connection_made reads RequestHandler._manager"
    assert callable(RequestHandler.force_close)
    assert isinstance(inspect.getattr_static(Server, "connections"), property), "_connection_made counts them"


def test_install_replaces_each_method_with_one_that_wraps_aiohttp_s():
    saved = {name: getattr(RequestHandler, name) for name in EXPECTED}
    saved_cap = http_protocol._max_connections
    try:
        http_protocol.install(max_connections=7)
        for name in EXPECTED:
            replaced = getattr(RequestHandler, name)
            assert replaced is getattr(http_protocol, f"_{name}"), name
            assert inspect.iscoroutinefunction(replaced) is EXPECTED[name][1], name
            assert list(inspect.signature(replaced).parameters)[:2] == EXPECTED[name][0][:2], name
    finally:
        for name, method in saved.items():
            setattr(RequestHandler, name, method)
        http_protocol._max_connections = saved_cap
