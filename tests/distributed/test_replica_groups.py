"""Two engine replicas, each split over 2 ranks (tensor parallel), whose MoE layers divide the experts among all 4
ranks (gloo, 1 thread each): each replica generates transformers' greedy tokens for its own requests, for each
family whose split replicas differ (``DP_FAMILIES``: a dense first layer with MLA, sliding layers with biases, the
all-gather dispatch; test_engine_ranks checks every family whose split engine differs) and both dispatches,
while the other replica's batches differ in size every step or it has no work at all; and a follower rank of one
replica that dies fails both replicas with the rank named."""

import os
import random
import signal
import time

import pytest

from tests.distributed.ranks import free_port, run_ranks_each
from tests.distributed.test_engine_ranks import DP_FAMILIES, ENGINE, POOL, engine_tokens, replica_group_configs
from tests.distributed.test_tensor_parallel import GATHER_FAMILY, VOCAB, family_checkpoints
from tests.engine.models.test_vs_transformers import hf_greedy
from tests.hf_models import make_hf_model
from tests.processes import rank_pids

REPLICAS, SPLIT = 2, 2


def _replica(rank: int, world: int, address: str, model_dir: str, prompts, max_tokens, dispatch, pool):
    """Replica ``rank``'s engine process (it starts its own follower rank): its tokens and what it holds."""
    from engine import LLM, SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens[rank]]
    llm = LLM(model_dir, **{**ENGINE, **pool}, tensor_parallel_size=SPLIT, enable_expert_parallel=True, expert_dispatch=dispatch,
              data_parallel_size=world, data_parallel_rank=rank, distributed_init_method=address)
    try:
        got = [out.token_ids for out in llm.generate(prompts[rank], params)]
        stats = llm.engine.stats()
        model = llm.engine.model
        moe = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
        held = {"experts": moe.experts.w13.shape[0], "first_expert": moe.first_expert,
                "kv_heads": model.num_local_kv_heads, "tp": (model.tp.rank, model.tp.size)}
    finally:
        llm.engine.close()
    return {"got": got, "held": held, "by_rank": stats.expert_load_by_rank, "preemptions": stats.num_preemptions,
            "hits": stats.prefix_hit_tokens}


@pytest.fixture(scope="module")
def replica_runs(tmp_path_factory):
    """Each engine family's two split replicas (its own random checkpoint, seed and prompts), all in one pair of engine
    processes: {family: (seed, experts in the model, transformers' tokens per replica, {replica: (status, value)})}."""
    runs, refs = {}, {}
    for family, (seed, model_dir, hf, rng) in family_checkpoints(tmp_path_factory, "dp-tp", DP_FAMILIES).items():
        shared = [rng.randrange(1, VOCAB - 1) for _ in range(9)]
        prompts = {0: [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (23, 5, 13, 2)] + [shared + [3], shared + [5]],
                   1: [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (7, 3)]}
        max_tokens = {0: [9, 12, 6, 10, 6, 6], 1: [3, 4]}
        dispatch = "all_gather" if family == GATHER_FAMILY else "all_to_all"
        num_experts = getattr(hf.config, "num_local_experts", None) or hf.config.num_experts
        runs[family] = (model_dir, prompts, max_tokens, dispatch, POOL.get(family, {}))
        refs[family] = (seed, num_experts,
                        {r: [hf_greedy(hf, p, n) for p, n in zip(prompts[r], max_tokens[r])] for r in prompts})
    results = run_ranks_each(_replica, REPLICAS, runs, timeout_s=520)  # the processes' start-up paid once
    return {family: (*refs[family], results[family]) for family in runs}


@pytest.mark.timeout(560)  # the first family's test builds every family's results (module fixture)
@pytest.mark.parametrize("family", DP_FAMILIES)
def test_split_replicas_sharing_experts_generate_transformers_tokens(family, replica_runs):
    """Replica 0 prefills in chunks (16 tokens a step), is preempted and hits its prefix cache; replica 1 runs out
    of work after a few steps, so for most steps it and its follower join replica 0's expert collectives with
    empty steps. World rank w holds the w-th contiguous run of about E/4 experts; each replica splits its heads."""
    seed, num_experts, want, results = replica_runs[family]
    assert sorted(results) == [0, 1] and all(s == "ok" for s, _ in results.values()), (family, seed, results)
    base, extra = divmod(num_experts, REPLICAS * SPLIT)
    per_rank = [base + (w < extra) for w in range(REPLICAS * SPLIT)]
    for replica in (0, 1):
        value = results[replica][1]
        assert value["got"] == want[replica], f"replica {replica} family={family} seed={seed}"
        world_rank = replica * SPLIT  # the engine process is its replica's rank 0
        held = value["held"]
        assert held["tp"] == (0, SPLIT)
        assert (held["first_expert"], held["experts"]) == (sum(per_rank[:world_rank]), per_rank[world_rank]), held
        assert value["by_rank"] is not None and len(value["by_rank"]) == REPLICAS * SPLIT and sum(value["by_rank"]) > 0
    busy = results[0][1]
    assert busy["preemptions"] > 0 and busy["hits"] > 0, (seed, busy)


@pytest.mark.timeout(240)
def test_a_dead_follower_fails_both_split_replicas_and_they_restart(tmp_path):
    """Replica 1's follower rank is killed while both replicas idle: replica 1's engine process notices by itself
    and fails, replica 0 fails at its next word with it, both naming the ranks, with no request needed; the
    gateway's supervisors restart both, which serve again."""
    import asyncio

    from engine.core.sampling_params import SamplingParams
    from engine.serving.async_engine import AsyncEngine, EngineError

    seed = random.randrange(2**31)
    hf = make_hf_model("mixtral", str(tmp_path), seed=seed, vocab_size=VOCAB, num_layers=2)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5]]
    want = [hf_greedy(hf, p, 5) for p in prompts]
    address = f"tcp://127.0.0.1:{free_port()}"
    configs = replica_group_configs(str(tmp_path), REPLICAS, address, tensor_parallel_size=SPLIT)

    async def tokens(engine, prompt) -> list[int]:
        return await engine_tokens(engine, prompt, params)

    async def scenario():
        engines = [AsyncEngine(c) for c in configs]
        await asyncio.gather(*(e.start() for e in engines))
        try:
            both = await asyncio.wait_for(asyncio.gather(*(tokens(e, p) for e, p in zip(engines, prompts))), 60)
            assert list(both) == want, seed
            followers = rank_pids(engines[1]._process.pid)
            assert len(followers) == 1, followers
            os.kill(followers[0], signal.SIGKILL)  # while both idle: replica 1 notices, replica 0 through it
            start = time.monotonic()
            while not all(e.dead for e in engines) and time.monotonic() - start < 20:
                await asyncio.sleep(0.1)
            assert all(e.dead for e in engines) and time.monotonic() - start < 15, [e.dead for e in engines]
            assert "rank 3 of 4 exited" in engines[1].dead_detail and "of 4" in engines[0].dead_detail, [e.dead_detail for e in engines]
            assert {e.dead for e in engines} == {"the engine failed"}  # no internals
            with pytest.raises(EngineError):  # until the supervisors restart them
                await asyncio.wait_for(tokens(engines[0], prompts[0]), 30)
            await asyncio.gather(*(e.restart() for e in engines))  # the gateway's supervisors restart both
            again = await asyncio.wait_for(asyncio.gather(*(tokens(e, p) for e, p in zip(engines, prompts))), 60)
            assert list(again) == want, seed
            assert all(len(rank_pids(e._process.pid)) == 1 for e in engines)
        finally:
            await asyncio.gather(*(e.shutdown() for e in engines))

    asyncio.run(scenario())
