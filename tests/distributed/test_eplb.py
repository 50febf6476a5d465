"""Expert load balancing on real gloo ranks (1 thread each): engines with the experts divided over 2 and 4 ranks,
rebalancing every few steps (hot experts replicated into spare slots, experts moved between ranks, weights sent
point to point while serving), generate exactly the single-process engine's greedy tokens, for three families, on a
workload that preempts and hits the prefix cache; and a rank killed while weights move fails the engine within its
timeout."""

import os
import random
import signal
import sys
import time

import pytest

from tests.distributed.ranks import free_port, run_ranks, run_ranks_each
from tests.distributed.test_engine_ranks import ENGINE, check_each_way_generates_the_single_tokens, generate_each_way
from tests.distributed.test_tensor_parallel import VOCAB
from tests.hf_models import make_hf_model

# Rebalancing every 3 steps from the last 4 steps' load: the workload's ~20 steps see several rebalances, the
# first filling the spare slots with replicas of the hot experts, the later ones moving experts as the load shifts.
EPLB = dict(enable_expert_parallel=True, enable_eplb=True, eplb_window_steps=4, eplb_interval_steps=3)
MODES = {
    "eplb2": dict(tensor_parallel_size=2, num_redundant_experts=2, **EPLB),
    "eplb4": dict(tensor_parallel_size=4, num_redundant_experts=4, **EPLB),
}
# Runs: (family, settings every mode of the run shares, modes); each compared with one process of those settings.
# Experts, top-k: qwen3_moe 16/4, mixtral 8/2, deepseek_v3 8/2 (grouped sigmoid routing, a dense layer); mixtral
# again with its experts in int8 (the scales move with the weights).
RUNS = {
    "qwen3_moe": ("qwen3_moe", {}, {"ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True), **MODES}),
    "mixtral": ("mixtral", {}, MODES),
    "mixtral-int8": ("mixtral", dict(quantization="int8"), {"eplb2": MODES["eplb2"]}),
    "deepseek_v3": ("deepseek_v3", {}, MODES),
}


@pytest.fixture(scope="module")
def eplb_runs(tmp_path_factory):
    runs, seeds = {}, {}
    for name, (family, common, modes) in RUNS.items():
        seed = seeds[name] = random.randrange(2**31)
        model_dir = str(tmp_path_factory.mktemp(f"eplb-{name}"))
        make_hf_model(family, model_dir, seed=seed, vocab_size=VOCAB, num_layers=2)
        rng = random.Random(seed)
        shared = [rng.randrange(1, VOCAB - 1) for _ in range(9)]
        prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (23, 5, 2, 13)]
        prompts += [shared + [3], shared + [5, 7]]
        every = {"single": common, **{mode: {**extra, **common} for mode, extra in modes.items()}}
        runs[name] = (model_dir, prompts, [6, 6, 5, 6, 6, 11], every)
    return generate_each_way(runs, seeds, timeout_s=400)


@pytest.mark.timeout(440)  # the first family's test builds every family's results (module fixture)
@pytest.mark.parametrize("run", sorted(RUNS))
def test_balanced_experts_generate_the_single_process_tokens(run, eplb_runs):
    value = check_each_way_generates_the_single_tokens(run, eplb_runs[run])
    seed = eplb_runs[run][0]
    preemptions, hits, _ = value["single:stats"]
    assert preemptions > 0 and hits > 0, f"the workload must preempt and hit the prefix cache (seed={seed})"
    for name in RUNS[run][2]:
        if name not in MODES:
            continue
        stats = value[name + ":eplb"]
        assert value[name + ":stats"][:2] == (preemptions, hits), (name, seed)
        # Rebalanced mid-run: replicas made, weights sent between ranks, experts moved off slots.
        assert stats["rebalances"] >= 2 and stats["replicated"] > 0, (name, seed, stats)
        assert stats["copied"] > 0 and stats["bytes"] > 0 and stats["reassigned"] > 0, (name, seed, stats)
        ranks = int(name[-1])
        assert len(stats["by_rank"]) == ranks and sum(stats["by_rank"]) > 0, stats
        assert stats["imbalance"] is not None and stats["imbalance"] >= 1.0, stats


def _follower_dying_in_a_move(argv: list[str]) -> None:
    """``moegate engine-rank``'s entry point in a rank that kills itself in the middle of a layer's weight move,
    nothing of it sent or received."""
    from engine.distributed import collectives
    from engine.ranks import follower

    send_recv = collectives.TensorParallel.send_recv

    def dying(self, sends, recvs, what):
        if sends or recvs:
            os.kill(os.getpid(), signal.SIGKILL)
        return send_recv(self, sends, recvs, what)

    collectives.TensorParallel.send_recv = dying
    sys.exit(follower.main(argv))


def _kill_during_a_move(rank: int, world: int, address: str, model_dir: str, port: int):
    from engine import LLM, SamplingParams
    from engine.distributed.groups import CollectiveError
    from engine.processes.process_start import start_process

    # Rank 1 started outside the engine (local_ranks=1), as on another node (forked from this process's forkserver:
    # a fresh interpreter spends 5 s of CPU importing).
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    follower = start_process(_follower_dying_in_a_move, (["--device", "cpu", "--timeout", "15"],), "rank-1", env)
    # 15 s: on a loaded 2-core machine a healthy step can wait seconds for the other rank; a 5 s limit failed
    # such a run before any weight moved.
    llm = LLM(model_dir, **ENGINE, tensor_parallel_size=2, local_ranks=1, distributed_timeout_s=15,
              distributed_init_method=f"tcp://127.0.0.1:{port}", **{**EPLB, "num_redundant_experts": 2})
    # A rebalance moves weights only where the measured load asks for another placement: 40 steps (a rebalance
    # every 3) over two random prompts, so one does (8 steps over one prompt left every placement as it was for
    # some random models: no move, nothing killed).
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    rng = random.Random()
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(5, 12))] for _ in range(2)]
    start = time.monotonic()
    try:
        llm.generate(prompts, params)
        error = None
    except CollectiveError as e:
        error = str(e)
    elapsed = time.monotonic() - start
    llm.engine.close(abrupt=True)
    follower.join(60)
    if follower.is_alive():
        follower.kill()
        follower.join()
        raise AssertionError(f"the follower outlived the engine by 60 s; the engine's error: {error}")
    return {"error": error, "elapsed": elapsed, "follower_code": follower.exitcode,
            "rebalances": llm.engine.runner.eplb.stats.rebalances}


@pytest.mark.timeout(120)
def test_a_rank_killed_while_weights_move_fails_the_engine_within_the_timeout(tmp_path):
    make_hf_model("mixtral", str(tmp_path), seed=random.randrange(2**31), vocab_size=VOCAB, num_layers=2)
    results = run_ranks(_kill_during_a_move, 1, str(tmp_path), free_port(), timeout_s=100)
    status, value = results.get(0, ("missing", None))
    assert status == "ok", value
    assert value["follower_code"] == -9, value  # it died inside the move, as arranged
    assert value["error"] is not None and "expert weights" in value["error"], value
    assert value["elapsed"] < 30, value  # the 15 s timeout at most, not a hang
    assert value["rebalances"] == 0, value  # the move never completed: no rank switched to it


def _balanced_replica(rank: int, world: int, address: str, model_dir: str, prompts, max_tokens):
    from engine import LLM, SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens[rank]]
    reference = [out.token_ids for out in LLM(model_dir, **ENGINE).generate(prompts[rank], params)]
    llm = LLM(model_dir, **ENGINE, data_parallel_size=world, data_parallel_rank=rank, distributed_init_method=address,
              **{**EPLB, "num_redundant_experts": 2})
    try:
        got = [out.token_ids for out in llm.generate(prompts[rank], params)]
        stats = llm.engine.stats()
    finally:
        llm.engine.close()
    return {"reference": reference, "got": got, "rebalances": stats.eplb_rebalances,
            "replicated": stats.eplb_replicated_experts, "copied": stats.eplb_slots_copied,
            "placements": llm.engine.runner.eplb.placements, "preemptions": stats.num_preemptions,
            "hits": stats.prefix_hit_tokens}


@pytest.mark.timeout(200)
def test_replicas_sharing_experts_balance_them_together(tmp_path):
    """Two whole engines whose MoE layers divide qwen3_moe's 16 experts (+2 spare slots) among them, each with
    its own requests: they sum their measured load, make the same decisions at the same steps (the busy one
    steps with work while the other runs dummy steps for most of the run) and each generates what it would
    alone."""
    seed = random.randrange(2**31)
    make_hf_model("qwen3_moe", str(tmp_path), seed=seed, vocab_size=VOCAB, num_layers=2)
    rng = random.Random(seed)
    shared = [rng.randrange(1, VOCAB - 1) for _ in range(9)]
    prompts = {0: [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (23, 5, 13, 2)] + [shared + [3], shared + [5]],
               1: [[rng.randrange(1, VOCAB - 1) for _ in range(7)]]}
    max_tokens = {0: [9, 12, 6, 10, 6, 6], 1: [3]}
    results = run_ranks(_balanced_replica, 2, str(tmp_path), prompts, max_tokens, timeout_s=180)
    assert sorted(results) == [0, 1] and all(s == "ok" for s, _ in results.values()), (seed, results)
    busy, idle = results[0][1], results[1][1]
    for value in (busy, idle):
        assert value["got"] == value["reference"], f"seed={seed}"
    assert busy["placements"] == idle["placements"], seed  # one decision, made on both
    assert busy["rebalances"] == idle["rebalances"] >= 2 and busy["replicated"] > 0 and busy["copied"] > 0, busy
    assert busy["preemptions"] > 0 and busy["hits"] > 0, busy
