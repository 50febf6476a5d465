"""A whole (not streamed) reply's body, built off the event loop when it holds many logprobs.

Building a reply's logprobs is pure Python in proportion to its tokens times their top tokens: measured, 128
choices of 60 tokens with 20 top logprobs each (161,000 entries) took 1.4 s to build and 0.15 s to encode, time in
which every other tenant's stream on the gateway waited (its event loop held the whole while). Such a body is built
on a worker thread, where the interpreter passes to the event loop every few milliseconds; for a live reply it is
encoded there too, a choice per encoder call (the encoder keeps the interpreter for a whole call).
"""

import asyncio
from collections.abc import Callable

import msgspec

from gateway.choices import Choices

# Logprob positions (a generated or prompt token's, with however many top tokens) past which a reply is built on a
# worker thread; below, the thread's hop would cost more than the building.
OFF_LOOP_POSITIONS = 256

_encode = msgspec.json.Encoder().encode


def logprob_positions(whole: Choices) -> int:
    """Generated and prompt positions with logprobs across every choice of ``whole``."""
    return sum(len(lp.tokens) for out in whole.outputs if out is not None
               for lp in (out.logprobs, out.prompt_logprobs) if lp is not None)


def encode_by_choice(response: dict) -> bytes:
    """``response`` as JSON, each of its ``choices`` encoded by a call of its own."""
    return _encode({**response, "choices": [msgspec.Raw(_encode(c)) for c in response["choices"]]})


async def whole_body(whole: Choices, render: Callable[[], dict]) -> dict:
    """``render()``, on a worker thread if ``whole`` holds many logprobs."""
    if logprob_positions(whole) > OFF_LOOP_POSITIONS:
        return await asyncio.to_thread(render)
    return render()


async def whole_body_json(whole: Choices, render: Callable[[], dict]) -> bytes:
    """``render()`` as JSON, built and encoded on a worker thread if ``whole`` holds many logprobs."""
    if logprob_positions(whole) > OFF_LOOP_POSITIONS:
        return await asyncio.to_thread(lambda: encode_by_choice(render()))
    return _encode(render())
