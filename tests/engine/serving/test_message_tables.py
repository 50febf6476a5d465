"""Each side of the engine process's pipe hands every message type of the protocol to a handler of its own: the
engine loop each ``ToEngine`` kind, the async client each ``FromEngine`` kind (a kind added to the protocol without
a handler fails here, not as a dropped message in a running server). The handlers themselves run in
test_engine_process.py and the gateway's tests, over a real engine process."""

import typing

from engine.serving.async_engine import DISPATCH, AsyncEngine
from engine.serving.engine_loop import HANDLERS, EngineLoop
from engine.serving.protocol import FromEngine, ToEngine


def test_the_engine_loop_has_a_handler_for_every_message_the_gateway_sends():
    assert set(HANDLERS) == set(typing.get_args(ToEngine))
    assert all(getattr(EngineLoop, h.__name__) is h for h in HANDLERS.values())


def test_the_async_client_has_a_handler_for_every_message_the_engine_sends():
    assert set(DISPATCH) == set(typing.get_args(FromEngine))
    assert all(getattr(AsyncEngine, h.__name__) is h for h in DISPATCH.values())
