"""``--distributed-executor-backend ray`` on a local Ray cluster of three 1-CPU nodes (loopback only): an engine
split over 2 ranks, each a Ray actor of one placement group, lands on two nodes (no node has room for both) and
generates exactly the single-process engine's greedy tokens; then a node holding one of its ranks is removed while
requests run: every request admitted is answered (its tokens, or the 503 a failed engine gets today), none hangs,
and the restarted engine is placed again on the nodes left and serves the same tokens.

Slow (a Ray cluster starts in 15-30 s on two busy cores): marked ``ray``, skipped without Ray installed
(``pip install -e '.[ray]'``)."""

import asyncio
import random
import time

import pytest

from tests.distributed.ray_cluster import WAIT_S, cluster  # noqa: F401 (the fixture)

pytestmark = pytest.mark.ray

VOCAB = 97
ENGINE = dict(device="cpu", cpu_threads=1, block_size=16, num_kv_blocks=48, max_num_batched_tokens=64,
              max_num_seqs=8, distributed_timeout_s=5)


@pytest.mark.timeout(150)
def test_tp2_over_ray_nodes_gives_the_single_process_tokens_and_survives_a_lost_node(cluster, tmp_path):
    from engine import LLM
    from engine.core.config import EngineConfig
    from engine.core.sampling_params import SamplingParams
    from engine.serving.async_engine import EngineError
    from engine.serving.ray_engine import RayEngine
    from gateway.completion import engine_down
    from tests.hf_models import make_hf_model

    seed = random.randrange(2**31)
    rng = random.Random(seed)
    make_hf_model("qwen3_moe", str(tmp_path), seed=seed, vocab_size=VOCAB, num_layers=2)
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (7, 3, 12, 5)]
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    alone = LLM(str(tmp_path), **{**ENGINE, "cpu_threads": None})  # this process: its thread count left alone
    want = [out.token_ids for out in alone.generate(prompts, short)]
    alone.engine.close()
    config = EngineConfig(model=str(tmp_path), **ENGINE, tensor_parallel_size=2, enable_expert_parallel=True,
                          distributed_executor_backend="ray")

    async def tokens(engine, prompt, params) -> list[int]:
        return [t async for out in engine.generate(prompt, params) for t in out.token_ids]

    async def scenario():
        engine = RayEngine(config)
        await asyncio.wait_for(engine.start(), WAIT_S)
        try:
            nodes = [node for node, _ in engine.group.placement]
            assert len(set(nodes)) == 2, f"both ranks on one node of 1 CPU: {nodes} (seed={seed})"
            got = await asyncio.wait_for(asyncio.gather(*(tokens(engine, p, short) for p in prompts)), WAIT_S)
            assert list(got) == want, f"seed={seed}"

            # A node holding a rank leaves while every request is decoding (the head node stays: it holds Ray's
            # own control services).
            streams = [engine.generate(p, long) for p in prompts]
            firsts = await asyncio.wait_for(asyncio.gather(*(s.__anext__() for s in streams)), WAIT_S)
            assert all(out.token_ids for out in firsts)
            head = cluster.head_node.node_id
            victim = next(n for n in cluster.worker_nodes if n.node_id in nodes)
            cluster.remove_node(victim, allow_graceful=False)

            async def rest(stream) -> object:
                try:
                    return [t async for out in stream for t in out.token_ids]
                except EngineError as e:
                    return e

            start = time.monotonic()
            answers = await asyncio.wait_for(asyncio.gather(*(rest(s) for s in streams)), WAIT_S)
            failed = [a for a in answers if isinstance(a, EngineError)]
            assert failed, f"every request finished after its rank's node left: {answers} (seed={seed})"
            for a in answers:  # each one answered: its remaining tokens, or the gateway's 503
                assert isinstance(a, list) or engine_down(a).status == 503, a
            while engine.lost is None and time.monotonic() - start < 15:  # which rank: from Ray, within a second
                await asyncio.sleep(0.1)
            assert engine.dead and engine.lost and "rank" in engine.lost, (engine.dead_detail, engine.lost)
            assert time.monotonic() - start < 15, "the lost rank was noticed late"
            with pytest.raises(EngineError):  # until the supervisor restarts it
                await asyncio.wait_for(tokens(engine, prompts[0], short), WAIT_S)

            await asyncio.wait_for(engine.restart(), WAIT_S)  # what the gateway's supervisor does
            placed = {node for node, _ in engine.group.placement}
            assert victim.node_id not in placed and len(placed) == 2 and head in placed, placed
            again = await asyncio.wait_for(asyncio.gather(*(tokens(engine, p, short) for p in prompts)), WAIT_S)
            assert list(again) == want, f"seed={seed}"
        finally:
            await asyncio.wait_for(engine.shutdown(), WAIT_S)

    asyncio.run(scenario())
