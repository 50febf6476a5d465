"""Releasing a request that has not started (what a router asks before moving it to another replica).

The engine drops a request only while it waits with nothing computed or generated; the others go on as if it
had never come (greedy tokens equal a run without it), and every block is free at the end. Through the engine
process: the answer comes back over the pipe, and the released id can be sent again.
"""

import asyncio
import contextlib
import random

import pytest

from engine import LLM, SamplingParams
from engine.core.config import EngineConfig
from engine.serving.async_engine import AsyncEngine
from tests.hf_models import make_hf_model

pytestmark = pytest.mark.timeout(120)
VOCAB = 211


def _greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("release-model"))
    make_hf_model("qwen3_moe", path, seed=random.randrange(2**31), vocab_size=VOCAB)
    return path


def test_only_a_request_that_has_not_started_is_released(model_dir):
    rng = random.Random()
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(3, 20))] for _ in range(4)]
    llm = LLM(model=model_dir, dtype="float32", device="cpu", max_num_seqs=1, num_kv_blocks=64, block_size=4)
    engine = llm.engine
    running = engine.add_request(prompts[0], _greedy(12))
    waiting = engine.add_request(prompts[1], _greedy(6))
    kept = engine.add_request(prompts[2], _greedy(6))
    several = engine.add_request(prompts[3], _greedy(4, n=2))
    assert not engine.release("no-such-request")
    first_step = engine.step()  # one slot: the first request runs, the others wait
    assert engine.scheduler.num_running == 1
    assert not engine.release(running)  # it has computed its prompt and sampled a token
    assert not engine.release(several)  # n > 1: refused whatever its copies' state
    assert engine.release(waiting)
    assert not engine.release(waiting)  # gone: unknown now
    tokens: dict[tuple[str, int], list[int]] = {}  # (request, choice) -> its tokens (steps give deltas)
    steps = [first_step]
    while engine.has_unfinished():
        steps.append(engine.step())
    for out in (out for step in steps for out in step):
        tokens.setdefault((out.request_id, out.index), []).extend(out.token_ids)
    assert {rid for rid, _ in tokens} == {running, kept, several}  # nothing of the released one
    assert [len(tokens[running, 0]), len(tokens[kept, 0]), len(tokens[several, 0]), len(tokens[several, 1])] == [12, 6, 4, 4]
    engine.scheduler.kv.pool.check_all_free()
    # The others' tokens are those of a run without the released request (a second engine, same model and
    # settings: one request at a time, so the same batch shapes and the same floating-point sums).
    alone = LLM(model=model_dir, dtype="float32", device="cpu", max_num_seqs=1, num_kv_blocks=64, block_size=4).generate(
        [prompts[0], prompts[2]], [_greedy(12), _greedy(6)])
    assert [tokens[running, 0], tokens[kept, 0]] == [o.token_ids for o in alone]


def test_release_through_the_engine_process(model_dir):
    rng = random.Random()
    prompt = [rng.randrange(1, VOCAB - 1) for _ in range(8)]

    async def scenario():
        engine = AsyncEngine(EngineConfig(model=model_dir, device="cpu", max_num_seqs=1, num_kv_blocks=64,
                                          block_size=4, cpu_threads=1))
        await engine.start()
        try:
            first = engine.generate(prompt, _greedy(600), "first")  # runs throughout (one slot)
            await anext(first)  # running, with output
            second = engine.generate(prompt, _greedy(5), "second", stream=False)  # quiet: no output until it ends
            second_out = asyncio.ensure_future(anext(second, None))
            await asyncio.sleep(0.05)
            assert await engine.release("second") is True
            assert await engine.release("first") is False
            assert not second_out.done()  # nothing more comes for a released request
            second_out.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await second_out
            await second.aclose()
            # The refused request goes on; closed, it frees the slot.
            more = [await anext(first) for _ in range(3)]
            assert [o.num_output_tokens for o in more] == [more[0].num_output_tokens + i for i in range(3)]
            await first.aclose()
            # The released id is free again in that engine: sent anew, the request runs to its end.
            again = [o async for o in engine.generate(prompt, _greedy(5), "second")]
            assert again[-1].finished and again[-1].num_output_tokens == 5
        finally:
            await engine.shutdown()
        assert await engine.release("first") is False  # a stopped engine releases nothing

    asyncio.run(scenario())
