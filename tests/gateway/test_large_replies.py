"""Whole replies with many logprobs are built (and, live, encoded) on a worker thread; small ones on the event loop;
the JSON is the same document the standard library writes, on fresh random bodies."""

import asyncio
import json
import random
import string
import threading

from engine.core.logprob_outputs import Logprobs
from engine.core.outputs import RequestOutput
from gateway.choices import Choices
from gateway.large_replies import OFF_LOOP_POSITIONS, encode_by_choice, whole_body, whole_body_json


def _whole(n: int, positions: int) -> Choices:
    choices = Choices([3], n, whole=True)
    for i in range(n):
        lp = Logprobs([1] * positions, [-1.0] * positions, [[2]] * positions, [[-2.0]] * positions, ["a"] * positions,
                      [["b"]] * positions)
        choices.add(0, RequestOutput("r", [1] * positions, "a" * positions, True, "length", 3, 0, positions, index=i,
                                     logprobs=lp))
    return choices


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(6 if depth < 3 else 4)
    if kind == 0:
        return "".join(rng.choice(string.printable + "é€\u2028😀") for _ in range(rng.randrange(8)))
    if kind == 1:
        return rng.uniform(-9999, 0)
    if kind == 2:
        return rng.randrange(-2**40, 2**40)
    if kind == 3:
        return rng.choice([None, True, False])
    if kind == 4:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randrange(4))}


def test_encoding_by_choice_is_the_same_json():
    rng = random.Random()
    for _ in range(200):
        response = {"id": "x", "choices": [_random_value(rng) for _ in range(rng.randrange(4))],
                    "usage": _random_value(rng)}
        assert json.loads(encode_by_choice(response)) == json.loads(json.dumps(response))


def test_many_logprobs_are_built_off_the_loop_and_few_on_it():
    async def thread_of(whole: Choices, as_json: bool) -> tuple[str, object]:
        seen = []

        def render() -> dict:
            seen.append(threading.current_thread())
            return {"id": "r", "choices": [{"index": i} for i in range(whole.n)]}

        out = await (whole_body_json if as_json else whole_body)(whole, render)
        return seen[0], out

    async def scenario():
        loop_thread = threading.current_thread()
        big = _whole(random.randint(2, 4), OFF_LOOP_POSITIONS // 2 + 1)  # positions of every choice count
        small = _whole(1, OFF_LOOP_POSITIONS)
        for as_json in (False, True):
            thread, out = await thread_of(big, as_json)
            assert thread is not loop_thread
            assert (json.loads(out) if as_json else out)["choices"] == [{"index": i} for i in range(big.n)]
            thread, out = await thread_of(small, as_json)
            assert thread is loop_thread

    asyncio.run(scenario())
