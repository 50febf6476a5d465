"""An engine split into 2 pipeline stages (and 2 stages of 2 tensor-parallel ranks, experts divided or split), on gloo with 1 thread per
process, generates exactly the single-process engine's tokens for a workload that prefills in chunks,
preempts, hits the prefix cache and has steps where a micro-batch is empty (greedy, penalties, a seeded draw), its
steps overlapped across the stages or not; each stage holds only its layers; a
stage killed mid-run fails the engine within the timeout, naming the rank."""

import os
import random
import signal
import threading
import time

import pytest

from tests.distributed.ranks import free_port, run_ranks, run_ranks_each
from tests.distributed.test_engine_ranks import ENGINE
from tests.distributed.test_tensor_parallel import OVERRIDES, VOCAB
from tests.hf_models import make_hf_model

# One family per distinct stage layout. The first four run every mode (MLA and a dense first layer, sliding layers,
# KV heads split, one KV head replicated); the others, whose stages differ only in which layers and which of their
# parts (shared experts, dense first layers, biases, q/k norms) a stage holds, run PP alone. Families whose parts
# are all covered here (OLMoE's and MiniMax-M2's q/k norms, Qwen2-MoE's shared-expert gate, dots1's dense first
# layer and shared experts) are left out: they add time, not a stage layout.
# MiMo-V2-Flash: a full layer with one KV head on one stage, a sliding one with two on the other: the stages must
# agree with the whole model that they cannot share cache tensors (``MoECausalLM.layers_cache_alike``).
FAMILIES = ("deepseek_v3", "gpt_oss", "mixtral", "qwen3_moe", "deepseek_v2", "glm4_moe", "mimo_v2_flash", "hy_v3")
MODES = {"pp": dict(pipeline_parallel_size=2), "pp_tp": dict(pipeline_parallel_size=2, tensor_parallel_size=2)}


def test_micro_batches_cut_parts_into_pieces_that_cover_them_in_order():
    from engine.core.scheduler import ScheduledRequest
    from engine.worker.pipeline_step import micro_batches

    rng = random.Random()
    for _ in range(50):
        parts = [ScheduledRequest(None, n, [1, 2], rng.random() < 0.7, rng.randrange(9), list(range(100, 100 + n)))
                 for n in (rng.randrange(1, 12) for _ in range(rng.randrange(1, 5)))]
        count = rng.randrange(1, 6)
        mbs = micro_batches(parts, count)
        assert len(mbs) == count
        total = sum(p.num_new_tokens for p in parts)
        assert all(sum(p.num_new_tokens for p in mb) <= -(-total // count) for mb in mbs)
        pieces = [p for mb in mbs for p in mb]
        for part in parts:  # its pieces, in order, are its tokens and positions; only the last may sample
            mine = [p for p in pieces if p.block_ids is part.block_ids]
            assert [t for p in mine for t in p.token_ids] == part.token_ids
            assert [p.start for p in mine] == [part.start + sum(q.num_new_tokens for q in mine[:i]) for i in range(len(mine))]
            assert [p.sample for p in mine] == [False] * (len(mine) - 1) + [part.sample]
        for mb in mbs:  # a request appears at most once in a micro-batch
            assert len({id(p.block_ids) for p in mb}) == len(mb)


def test_micro_batches_put_the_parts_waiting_for_a_token_in_flight_in_a_last_one_and_rows_come_back_in_order():
    import torch

    from engine.core.scheduler import PLACEHOLDER, ScheduledRequest
    from engine.worker.pipeline_step import _sampling_order, micro_batches

    rng = random.Random()
    for _ in range(50):
        parts = []
        for _ in range(rng.randrange(1, 7)):
            waits = rng.random() < 0.5  # a decode (or a re-prefill) whose last input token is in flight
            n = 1 if waits and rng.random() < 0.7 else rng.randrange(1, 12)
            ids = list(range(100, 100 + n - waits)) + [PLACEHOLDER] * waits
            parts.append(ScheduledRequest(None, n, [len(parts)], waits or rng.random() < 0.7, 0, ids))
        count = rng.randrange(1, 5)
        mbs = micro_batches(parts, count)
        waiting = [p for p in parts if p.token_ids[-1] == PLACEHOLDER]
        assert len(mbs) == count + bool(waiting)
        assert (mbs[-1] if waiting else []) == waiting  # whole, in order, and nowhere else
        assert all(p.token_ids[-1] != PLACEHOLDER for mb in mbs[:count] for p in mb)
        # The last stage sends the sampled rows in the cut's order; stage 0 puts them back in the plan's.
        cut_rows = [p.block_ids[0] for mb in mbs for p in mb if p.sample]
        order = _sampling_order(parts, torch.device("cpu"))
        rows = torch.tensor(cut_rows) if order is None else torch.tensor(cut_rows).index_select(0, order)
        assert rows.tolist() == [p.block_ids[0] for p in parts if p.sample]


def _generate_each_way(rank: int, world: int, address: str, model_dir: str, prompts, max_tokens, modes):
    from engine import LLM, SamplingParams

    # Greedy, and sampling that reads each request's history and position (penalties, a seeded draw): a step
    # is sampled while the next one is in flight.
    asks = [dict(frequency_penalty=0.8, presence_penalty=0.3), dict(repetition_penalty=1.5),
            dict(temperature=1.0, seed=11)]
    params = [SamplingParams(**{"temperature": 0, **(asks[i] if i < len(asks) else {})}, max_tokens=n,
                             ignore_eos=True) for i, n in enumerate(max_tokens)]
    results = {}
    # One process overlapping its steps makes the scheduling decisions of overlapped pipeline stages (a step is
    # scheduled before the one in flight is sampled): the reference for their preemptions and prefix hits.
    for name, extra in {"single": {}, "single_overlap": dict(overlap_scheduling=True), **modes}.items():
        llm = LLM(model_dir, **ENGINE, **extra)
        try:
            results[name] = [out.token_ids for out in llm.generate(prompts, params)]
            stats = llm.engine.stats()
            results[name + ":stats"] = (stats.num_preemptions, stats.prefix_hit_tokens)
            results[name + ":timings"] = [(t.stage, t.steps, t.empty_micro_batches, t.busy_s, t.busy_cpu_s,
                                           t.overlapped_steps)
                                          for t in llm.engine.stage_timings()]
            results[name + ":params"] = sum(p.numel() for p in llm.engine.model.parameters())
        finally:
            llm.engine.close()
    return results


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    runs, seeds = {}, {}
    for family in FAMILIES:
        seed = random.randrange(2**31)
        rng = random.Random(seed)
        model_dir = str(tmp_path_factory.mktemp(f"pp-{family}"))
        make_hf_model(family, model_dir, seed=seed, vocab_size=VOCAB, num_layers=2, **OVERRIDES.get(family, {}))
        shared = [rng.randrange(1, VOCAB - 1) for _ in range(9)]
        prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (23, 5, 2, 13)]
        prompts += [shared + [3], shared + [5, 7]]
        runs[family] = (model_dir, prompts, [6, 6, 5, 6, 6, 11], modes_of(family))
        seeds[family] = seed
    results = run_ranks_each(_generate_each_way, 1, runs, timeout_s=560)
    return {family: (seeds[family], results[family].get(0, ("missing", None))) for family in runs}


def modes_of(family: str) -> dict:
    """The ways a family runs: every family PP (steps overlapped across the stages, the default); four also PP x
    TP, one of them also with the experts divided in each stage, one also with synchronous steps."""
    if family == "qwen3_moe":
        return {**MODES, "pp_ep": dict(pipeline_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)}
    if family == "mixtral":
        return {**MODES, "pp_sync": dict(pipeline_parallel_size=2, overlap_scheduling=False)}
    if family in ("deepseek_v3", "gpt_oss"):
        return MODES
    return {"pp": MODES["pp"]}


@pytest.mark.timeout(600)  # the first family's test builds every family's results (module fixture)
@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_stages_generate_the_single_process_tokens(family, pipeline_runs):
    seed, (status, value) = pipeline_runs[family]
    assert status == "ok", f"family={family} seed={seed}: {value}"
    single = value["single"]
    preemptions, hits = value["single:stats"]
    assert preemptions > 0 and hits > 0, f"the workload must preempt and hit the prefix cache (seed={seed})"
    assert value["single_overlap"] == single, f"overlapped steps in one process (family={family} seed={seed})"
    for name, mode in modes_of(family).items():
        assert value[name] == single, f"{name} differs from one process (family={family} seed={seed})"
        reference = "single" if mode.get("overlap_scheduling") is False else "single_overlap"
        assert value[name + ":stats"] == value[reference + ":stats"], f"{name} family={family} seed={seed}"
        timings = value[name + ":timings"]
        ranks = 2 * mode.get("tensor_parallel_size", 1)
        assert [t[0] for t in timings] == [r // (ranks // 2) for r in range(ranks)]  # world rank order
        assert all(t[1] == timings[0][1] > 0 for t in timings)  # every rank ran every step
        assert timings[0][2] > 0, "some step must have had an empty micro-batch (a decode of one token)"
        # A stage's CPU time in its busy spans is positive and within their wall time (a thread runs on one core).
        assert all(0 < t[4] <= t[3] + 0.05 for t in timings), timings
        # Overlapped steps: stage 0 began steps while the step before was still in the last stage (a prefill chunk
        # ahead of the decodes waiting for that step's tokens); synchronous steps never.
        overlapped = [t[5] for t in timings if t[0] == 0]
        if mode.get("overlap_scheduling") is False:
            assert overlapped == [0] * len(overlapped), timings
        else:
            assert all(n > 0 for n in overlapped), f"{name}: no step overlapped the one before {timings}"
        assert all(t[5] == 0 for t in timings if t[0] > 0), timings
        # Stage 0 holds the embedding, LM head and one of the two layers: well under the whole model.
        assert value[name + ":params"] < 0.9 * value["single:params"], (name, value[name + ":params"])


def _kill_a_stage(rank: int, world: int, address: str, model_dir: str, port: int):
    from engine import LLM, SamplingParams
    from engine.distributed.groups import CollectiveError
    from engine.processes.process_start import run_main, start_process

    # Stage 1 started outside the engine (local_ranks=1), as on another node: the torchrun variables and `moegate
    # engine-rank`'s entry point. Forked from this process's forkserver (a fresh interpreter spends 5 s of CPU
    # importing; test_engine_ranks starts one by its command line).
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    # 15 s: on a loaded 2-core machine a healthy first step waited over 5 s for stage 1 (and failed the run).
    argv = ["--device", "cpu", "--timeout", "15"]
    follower = start_process(run_main, ("engine.ranks.follower", argv), "stage-1", env)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = {**ENGINE, "num_kv_blocks": 260}  # room for a long generation (the model's 1024 positions)
    llm = LLM(model_dir, **engine, pipeline_parallel_size=2, local_ranks=1, distributed_timeout_s=15,
              distributed_init_method=f"tcp://127.0.0.1:{port}")
    first = llm.generate([[1, 2, 3]], params)[0].token_ids
    # Killed while the engine runs a long generation: rank 0 is inside a step's plan, send or receive.
    killer = threading.Timer(0.5, os.kill, (follower.pid, signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    try:
        llm.generate([[4, 5, 6]], SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
        error = None
    except CollectiveError as e:
        error = str(e)
    elapsed = time.monotonic() - start - 0.5  # from the kill
    killer.join()
    follower.join()
    llm.engine.close(abrupt=True)
    again = LLM(model_dir, **engine, pipeline_parallel_size=2, distributed_timeout_s=15)  # this node starts stage 1
    tokens = again.generate([[1, 2, 3]], params)[0].token_ids
    again.engine.close()
    return {"error": error, "elapsed": elapsed, "first": first, "again": tokens}


@pytest.mark.timeout(180)
def test_a_dead_stage_fails_the_engine_within_the_timeout_naming_the_rank(tmp_path):
    make_hf_model("mixtral", str(tmp_path), seed=random.randrange(2**31), vocab_size=VOCAB, num_layers=2)
    results = run_ranks(_kill_a_stage, 1, str(tmp_path), free_port(), timeout_s=150)
    status, value = results.get(0, ("missing", None))
    assert status == "ok", value
    assert value["error"] is not None and "rank 0 of 2" in value["error"], value
    assert value["elapsed"] < 30, value  # the 15 s timeout at most, not a hang
    assert value["again"] == value["first"] and len(value["first"]) == 4  # a fresh engine serves the same tokens


def test_a_pipeline_that_does_not_fit_the_model_is_refused_before_any_process_starts(tmp_path):
    from engine.core.config import EngineConfig
    from engine.loading.model_check import check_model

    make_hf_model("mixtral", str(tmp_path), seed=random.randrange(2**31), vocab_size=VOCAB, num_layers=2)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(3\) exceeds the model's 2 layers"):
        check_model(EngineConfig(model=str(tmp_path), device="cpu", pipeline_parallel_size=3))
    check_model(EngineConfig(model=str(tmp_path), device="cpu", pipeline_parallel_size=2))  # one layer a stage
    for bad in (dict(pipeline_parallel_size=0), dict(pipeline_micro_batches=0),
                dict(pipeline_parallel_size=2, speculative="ngram")):
        with pytest.raises(ValueError, match="pipeline"):
            EngineConfig(model=str(tmp_path), **bad)
