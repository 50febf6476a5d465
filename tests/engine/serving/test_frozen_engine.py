"""An engine process that stops reading its pipe (frozen: SIGSTOP) while requests keep coming must not hold the
gateway's event loop: requests to it are written from a thread of their own, so the other engines' requests,
health checks and the router's silence detection go on. Once it runs again (SIGCONT), what was sent reaches it
in order: each request gets its answer."""

import asyncio
import os
import random
import signal
import threading
import time

import pytest

from engine.core.config import EngineConfig
from engine.serving.async_engine import AsyncEngine, RequestRejectedError
from engine import SamplingParams
from tests.hf_models import make_hf_model


@pytest.mark.timeout(120)
def test_requests_to_a_frozen_engine_never_block_the_event_loop(tmp_path):
    rng = random.Random()
    make_hf_model("qwen3_moe", str(tmp_path), seed=rng.randrange(2**31), vocab_size=211)
    # Each request far longer than the context (the engine refuses it once it reads it) and, as msgpack, about
    # 60 KB: a few fill the pipe's buffer (64 KB on Linux), after which a write waits for the engine to read.
    prompts = [[rng.randrange(200, 211) for _ in range(30_000)] for _ in range(6)]

    async def main():
        engine = AsyncEngine(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=32,
                                          cpu_threads=1))
        await engine.start()
        gaps, last = [], time.monotonic()

        async def tick():
            nonlocal last
            while True:
                await asyncio.sleep(0.02)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        async def refused(prompt):
            with pytest.raises(RequestRejectedError):
                async for _ in engine.generate(prompt, SamplingParams(max_tokens=1)):
                    pass

        ticker = asyncio.create_task(tick())
        os.kill(engine.pid, signal.SIGSTOP)
        # Woken after 3 s whatever happens here: a held event loop cannot do it (it is the failure looked for).
        waker = threading.Timer(3.0, os.kill, (engine.pid, signal.SIGCONT))
        waker.start()
        try:
            sent = [asyncio.create_task(refused(p)) for p in prompts]
            await asyncio.sleep(1.5)  # the loop runs on while the writes wait
            assert max(gaps) < 0.5, f"the event loop was held {max(gaps):.2f} s"
        finally:
            os.kill(engine.pid, signal.SIGCONT)
            waker.cancel()  # or it may signal a process that has ended by then (an error in its thread)
        await asyncio.wait_for(asyncio.gather(*sent), 30)  # each reached the engine, in order, and was answered
        ticker.cancel()
        await engine.shutdown()

    asyncio.run(main())
