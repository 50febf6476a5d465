"""An engine split over 2 processes (gloo, 1 thread each) generates exactly the single-process engine's greedy
tokens, for each family whose split engine differs (``ENGINE_FAMILIES``; test_tensor_parallel checks every family's
split logits), with tensor parallelism and with the experts divided among the ranks; and a rank that dies
fails the engine within its timeout, with the rank named, after which a fresh engine serves again."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from tests.distributed.ranks import free_port, run_ranks, run_ranks_each
from tests.distributed.test_tensor_parallel import ENGINE_FAMILIES, GATHER_FAMILY, VOCAB, family_checkpoints
from tests.hf_models import make_hf_model
from tests.processes import rank_pids

# A KV pool of 14 blocks of 4 tokens for 6 requests, 16 tokens a step: long prompts are prefilled in chunks,
# requests are preempted and resumed, and two prompts share a prefix (prefix-cache hits). The last request
# generates longest, so the final steps decode one token: with the experts divided, one rank gets no tokens,
# and odd token counts split unevenly between the ranks.
ENGINE = dict(device="cpu", cpu_threads=1, block_size=4, num_kv_blocks=14, max_num_batched_tokens=16, max_num_seqs=4)
# gpt-oss's sliding layer keeps its own block tables, so one of its blocks holds one of its two layers, and the
# sliding layer's blocks go back to the pool as its window (8) passes them: 16 such blocks (about half the others'
# 14 blocks' memory) preempt and hit the prefix cache on this workload.
POOL = {"gpt_oss": dict(num_kv_blocks=16)}


def _generate_each_way(rank: int, world: int, address: str, model_dir: str, prompts, max_tokens, modes):
    from engine import LLM, SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    results = {}
    for name, extra in modes.items():
        llm = LLM(model_dir, **{**ENGINE, **extra})
        try:
            results[name] = [out.token_ids for out in llm.generate(prompts, params)]
            stats = llm.engine.stats()
            results[name + ":stats"] = (stats.num_preemptions, stats.prefix_hit_tokens, stats.expert_load_by_rank)
            if extra.get("enable_eplb"):  # what the expert load balancing did (tests/distributed/test_eplb.py)
                results[name + ":eplb"] = dict(
                    rebalances=stats.eplb_rebalances, replicated=stats.eplb_replicated_experts,
                    copied=stats.eplb_slots_copied, bytes=stats.eplb_bytes_moved,
                    reassigned=stats.eplb_slots_reassigned, by_rank=stats.expert_load_by_rank,
                    imbalance=stats.expert_imbalance, before=stats.eplb_imbalance_before,
                    after=stats.eplb_imbalance_after, ms=stats.eplb_last_rebalance_ms)
        finally:
            llm.engine.close()
    return results


MODES = {
    "tp": dict(tensor_parallel_size=2),
    "ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
}


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory):
    """Each engine family's workload (its own random checkpoint, seed and prompts) generated single, tp, ep (and
    ep_gather for GATHER_FAMILY) in one rank process: {family: (seed, max_tokens, modes, (status, value))}."""
    runs, seeds = {}, {}
    for family, (seed, model_dir, _, rng) in family_checkpoints(tmp_path_factory, "split", ENGINE_FAMILIES).items():
        seeds[family] = seed
        prompts, max_tokens = split_workload(rng)
        modes = {"single": {}, **MODES}
        if family == GATHER_FAMILY:  # the shared expert and a dense layer beside divided experts, the simpler dispatch
            modes["ep_gather"] = dict(tensor_parallel_size=2, enable_expert_parallel=True, expert_dispatch="all_gather")
        modes = {name: {**extra, **POOL.get(family, {})} for name, extra in modes.items()}
        runs[family] = (model_dir, prompts, max_tokens, modes)
    return generate_each_way(runs, seeds, timeout_s=520)


def split_workload(rng: random.Random) -> tuple[list[list[int]], list[int]]:
    """Prompts (long ones chunked, two sharing a prefix) and their max_tokens, for the ENGINE pool."""
    shared = [rng.randrange(1, VOCAB - 1) for _ in range(9)]
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (23, 5, 2, 13)]
    return prompts + [shared + [3], shared + [5, 7]], [6, 6, 5, 6, 6, 11]


def generate_each_way(runs: dict, seeds: dict, timeout_s: float) -> dict:
    """Every family's ``runs`` entry (model, prompts, max_tokens, modes) generated each way in one rank process
    (its start-up paid once): {family: (seed, max_tokens, modes, (status, value))}."""
    results = run_ranks_each(_generate_each_way, 1, runs, timeout_s=timeout_s)
    return {family: (seeds[family], runs[family][2], runs[family][3], results[family].get(0, ("missing", None)))
            for family in runs}


def check_each_way_generates_the_single_tokens(family: str, run: tuple) -> dict:
    """Assert one ``generate_each_way`` entry ran, and every mode gave the single process's tokens; its values."""
    seed, max_tokens, modes, (status, value) = run
    assert status == "ok", f"family={family} seed={seed}: {value}"
    single = value["single"]
    assert [len(t) for t in single] == max_tokens
    for name in modes:
        assert value[name] == single, f"{name} differs from one process (family={family} seed={seed})"
    return value


@pytest.mark.timeout(560)  # the first family's test builds every family's results (module fixture)
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_split_engines_generate_the_single_process_tokens(family, split_runs):
    value = check_each_way_generates_the_single_tokens(family, split_runs[family])
    seed, modes = split_runs[family][0], split_runs[family][2]
    preemptions, hits, _ = value["single:stats"]
    assert preemptions > 0 and hits > 0, f"the workload must preempt and hit the prefix cache (seed={seed})"
    for name in modes:
        assert value[name + ":stats"][:2] == value["single:stats"][:2], f"{name} family={family} seed={seed}"
    by_rank = value["ep:stats"][2]
    assert by_rank is not None and len(by_rank) == 2 and sum(by_rank) > 0


@pytest.mark.timeout(300)
def test_mimo_split_engines_generate_the_single_process_tokens(tmp_path):
    """MiMo-V2-Flash's layers differ in KV heads: the full one has one (replicated on both ranks), the two sliding
    ones two (one per rank) and sinks; split tensor and expert parallel, the engine gives the one process's tokens
    while it prefills in chunks, preempts and hits its prefix cache. (Three layers, so that the sliding layers are
    not half of them: every way keeps one cache group and the same pool, see cache_groups.)"""
    seed = random.randrange(2**31)
    make_hf_model("mimo_v2_flash", str(tmp_path), seed=seed, vocab_size=VOCAB)
    prompts, max_tokens = split_workload(random.Random(seed))
    runs = {"mimo_v2_flash": (str(tmp_path), prompts, max_tokens, {"single": {}, **MODES})}
    run = generate_each_way(runs, {"mimo_v2_flash": seed}, timeout_s=280)["mimo_v2_flash"]
    value = check_each_way_generates_the_single_tokens("mimo_v2_flash", run)
    preemptions, hits, _ = value["single:stats"]
    assert preemptions > 0 and hits > 0, f"the workload must preempt and hit the prefix cache (seed={seed})"


def _kill_a_rank(rank: int, world: int, address: str, model_dir: str, port: int):
    from engine import LLM, SamplingParams
    from engine.distributed.groups import CollectiveError

    # Rank 1 started by hand, as on another node: the torchrun variables and `moegate engine-rank`'s entry point.
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    command = [sys.executable, "-m", "engine.ranks.follower", "--device", "cpu", "--timeout", "5"]
    follower = subprocess.Popen(command, env=env)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(model_dir, **ENGINE, tensor_parallel_size=2, local_ranks=1, distributed_timeout_s=5,
              distributed_init_method=f"tcp://127.0.0.1:{port}")
    first = llm.generate([[1, 2, 3]], params)[0].token_ids
    follower.send_signal(signal.SIGKILL)
    follower.wait()
    start = time.monotonic()
    try:
        llm.generate([[4, 5, 6]], params)
        error = None
    except CollectiveError as e:
        error = str(e)
    elapsed = time.monotonic() - start
    llm.engine.close()
    again = LLM(model_dir, **ENGINE, tensor_parallel_size=2, distributed_timeout_s=5)  # this node starts rank 1
    tokens = again.generate([[1, 2, 3]], params)[0].token_ids
    again.engine.close()
    return {"error": error, "elapsed": elapsed, "first": first, "again": tokens}


@pytest.mark.timeout(180)
def test_a_dead_rank_fails_the_engine_within_the_timeout(tmp_path):
    make_hf_model("mixtral", str(tmp_path), seed=random.randrange(2**31), vocab_size=VOCAB, num_layers=2)
    results = run_ranks(_kill_a_rank, 1, str(tmp_path), free_port(), timeout_s=150)
    status, value = results.get(0, ("missing", None))
    assert status == "ok", value
    assert value["error"] is not None and "rank 0 of 2" in value["error"], value
    assert value["elapsed"] < 10, value
    assert value["again"] == value["first"] and len(value["first"]) == 4  # a fresh group serves the same tokens


@pytest.mark.timeout(180)
def test_the_serving_engine_reports_a_dead_rank_and_restarts_whole(tmp_path):
    import asyncio

    from engine.core.config import EngineConfig
    from engine.core.sampling_params import SamplingParams
    from engine.serving.async_engine import AsyncEngine, EngineError

    make_hf_model("qwen3_moe", str(tmp_path), seed=random.randrange(2**31), vocab_size=VOCAB, num_layers=2)
    # The KV pool sized by memory (not a block count): the ranks agree on the smallest.
    engine = {**ENGINE, "num_kv_blocks": None, "kv_cache_memory_gb": 0.01}
    config = EngineConfig(model=str(tmp_path), **engine, tensor_parallel_size=2, enable_expert_parallel=True,
                          distributed_timeout_s=5)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def tokens(engine) -> list[int]:
        return [t async for out in engine.generate([1, 2, 3], params) for t in out.token_ids]

    async def scenario():
        engine = AsyncEngine(config)
        await engine.start()
        try:
            first = await tokens(engine)
            followers = rank_pids(engine._process.pid)
            assert len(followers) == 1, followers
            os.kill(followers[0], signal.SIGKILL)  # while idle: the engine notices it has lost the rank by itself
            start = time.monotonic()
            while not engine.dead and time.monotonic() - start < 15:
                await asyncio.sleep(0.1)
            assert engine.dead and "rank 1 of 2 exited" in engine.dead_detail, engine.dead_detail
            assert engine.dead == "the engine failed"  # for clients: no internals
            assert time.monotonic() - start < 10
            with pytest.raises(EngineError):  # until the supervisor restarts it
                await asyncio.wait_for(tokens(engine), 30)
            await engine.restart()  # what the gateway's supervisor does
            assert await tokens(engine) == first
            assert len(rank_pids(engine._process.pid)) == 1
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def replica_group_configs(model_dir: str, replicas: int, address: str, **extra) -> list:
    """The EngineConfig of each of ``replicas`` engines sharing their experts, meeting at ``address`` (5 s timeout)."""
    from engine.core.config import EngineConfig

    return [EngineConfig(model=model_dir, **ENGINE, enable_expert_parallel=True, data_parallel_size=replicas,
                         data_parallel_rank=r, distributed_init_method=address, distributed_timeout_s=5, **extra)
            for r in range(replicas)]


async def engine_tokens(engine, prompt, params) -> list[int]:
    """Every token an AsyncEngine streams for ``prompt``."""
    return [t async for out in engine.generate(prompt, params) for t in out.token_ids]


# Data parallelism divides the experts; what differs between families there is a dense first layer holding none
# (DeepSeek-V3, with MLA), biases and sliding layers (gpt-oss) and the all-gather dispatch (Qwen2-MoE). The split
# attention that tells the other engine families apart is checked by the tests above.
DP_FAMILIES = ("deepseek_v3", "gpt_oss", GATHER_FAMILY)


def _data_parallel_engine(rank: int, world: int, address: str, model_dir: str, prompts, max_tokens, dispatch,
                          pool: dict | None = None):
    from engine import LLM, SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    engine = {**ENGINE, **(pool or {})}
    alone = LLM(model_dir, **engine)
    reference = [out.token_ids for out in alone.generate(prompts, params)]
    llm = LLM(model_dir, **engine, enable_expert_parallel=True, expert_dispatch=dispatch, data_parallel_size=world,
              data_parallel_rank=rank, distributed_init_method=address)
    try:
        got = [out.token_ids for out in llm.generate(prompts, params)]
        stats = llm.engine.stats()
    finally:
        llm.engine.close()
    mlp = llm.engine.model.model.layers[0].mlp
    return {"reference": reference, "got": got, "experts": mlp.experts.w13.shape[0] if hasattr(mlp, "experts") else None,
            "by_rank": stats.expert_load_by_rank, "preemptions": stats.num_preemptions, "hits": stats.prefix_hit_tokens}


@pytest.fixture(scope="module")
def data_parallel_runs(tmp_path_factory):
    """Each engine family's two data-parallel engines (their own random checkpoint, seed and prompts), all in one pair of
    rank processes: {family: (seed, transformers model, max_tokens, {rank: (status, value)})}."""
    runs, refs = {}, {}
    for family, (seed, model_dir, hf, rng) in family_checkpoints(tmp_path_factory, "dp", DP_FAMILIES).items():
        shared = [rng.randrange(1, VOCAB - 1) for _ in range(9)]
        prompts = {0: [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (23, 5, 13, 2)] + [shared + [3], shared + [5]],
                   1: [[rng.randrange(1, VOCAB - 1) for _ in range(7)]]}
        max_tokens = {0: [9, 12, 6, 10, 6, 6], 1: [3]}
        dispatch = "all_gather" if family == GATHER_FAMILY else "all_to_all"
        runs[family] = (model_dir, prompts, max_tokens, dispatch, POOL.get(family, {}))
        refs[family] = (seed, hf, max_tokens)
    results = run_ranks_each(_data_parallel_rank, 2, runs, timeout_s=520)  # the processes' start-up paid once
    return {family: (*refs[family], results[family]) for family in runs}


@pytest.mark.timeout(560)  # the first family's test builds every family's results (module fixture)
@pytest.mark.parametrize("family", DP_FAMILIES)
def test_data_parallel_engines_sharing_experts_generate_their_own_tokens(family, data_parallel_runs):
    """Two whole engines (each its own requests) whose MoE layers divide the experts: each generates what it
    would alone. Their batches differ in size every step, and the second runs out of work early, so for most
    steps it has no tokens and joins its peer's collectives with an empty step; the first prefills in chunks,
    is preempted and hits its prefix cache."""
    seed, hf, max_tokens, results = data_parallel_runs[family]
    assert sorted(results) == [0, 1] and all(s == "ok" for s, _ in results.values()), (family, seed, results)
    num_experts = getattr(hf.config, "num_local_experts", None) or hf.config.num_experts
    for rank in (0, 1):
        value = results[rank][1]
        assert value["got"] == value["reference"], f"rank {rank} family={family} seed={seed}"
        assert [len(t) for t in value["got"]] == max_tokens[rank]
        if value["experts"] is not None:  # a dense first layer (qwen2_moe, deepseek_v3) holds no experts
            assert value["experts"] == num_experts // 2 + (rank < num_experts % 2)
        assert value["by_rank"] is not None and len(value["by_rank"]) == 2
    # The busy engine prefilled in chunks (16 tokens a step), was preempted and hit its prefix cache.
    assert results[0][1]["preemptions"] > 0 and results[0][1]["hits"] > 0, (seed, results[0][1])


def _data_parallel_rank(rank: int, world: int, address: str, model_dir: str, prompts, max_tokens, dispatch, pool):
    return _data_parallel_engine(rank, world, address, model_dir, prompts[rank], max_tokens[rank], dispatch, pool)


@pytest.mark.timeout(180)
def test_serving_data_parallel_engines_step_together_and_fail_together(tmp_path):
    import asyncio

    from engine import LLM
    from engine.core.sampling_params import SamplingParams
    from engine.serving.async_engine import AsyncEngine, EngineError

    make_hf_model("qwen3_moe", str(tmp_path), seed=random.randrange(2**31), vocab_size=VOCAB, num_layers=2)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5]]
    alone = {**ENGINE, "cpu_threads": None}  # in this process: leave its thread count alone
    want = [out.token_ids for out in LLM(str(tmp_path), **alone).generate(prompts, params)]
    address = f"tcp://127.0.0.1:{free_port()}"
    configs = replica_group_configs(str(tmp_path), 2, address)

    async def tokens(engine, prompt) -> list[int]:
        return await engine_tokens(engine, prompt, params)

    async def scenario():
        engines = [AsyncEngine(c) for c in configs]
        await asyncio.gather(*(e.start() for e in engines))
        try:
            # One engine alone has work (its peer steps empty), then both at once.
            assert await asyncio.wait_for(tokens(engines[1], prompts[1]), 60) == want[1]
            both = await asyncio.wait_for(asyncio.gather(*(tokens(e, p) for e, p in zip(engines, prompts))), 60)
            assert list(both) == want
            engines[1]._process.kill()  # a peer dies while both are idle: the other fails at its next question
            start = time.monotonic()
            while not engines[0].dead and time.monotonic() - start < 15:
                await asyncio.sleep(0.1)
            assert engines[0].dead and "rank 0 of 2" in engines[0].dead_detail, engines[0].dead_detail
            with pytest.raises(EngineError):
                await tokens(engines[0], prompts[0])
            await asyncio.gather(*(e.restart() for e in engines))  # the gateway's supervisors restart both
            assert await asyncio.wait_for(tokens(engines[0], prompts[0]), 60) == want[0]
        finally:
            await asyncio.gather(*(e.shutdown() for e in engines))

    asyncio.run(scenario())
