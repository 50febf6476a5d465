"""Random-weight models split over 2 processes (gloo, 1 thread each), from a fresh seed each run: with tensor
parallelism (Qwen3-MoE, and OLMoE's q/k norm over every rank's heads), with the experts divided among the ranks as
well, and as two replicas dividing the experts, every engine generates exactly the greedy tokens of the
single-process engine of the same spec and seed (every rank draws its slices of the same unsplit weights)."""

import random

import pytest

from tests.distributed.ranks import run_ranks_each
from tests.distributed.test_engine_ranks import ENGINE, check_each_way_generates_the_single_tokens, generate_each_way

# CPU-sized shapes of two presets: 4 heads and 2 KV heads of 16 (one KV head per rank), 8 experts.
TINY = ("num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,head_dim=16,vocab_size=512,"
        "max_position_embeddings=256,bos_token_id=null,eos_token_id=511")
SPECS = {
    "qwen3": f"qwen3-30b-a3b:{TINY},num_experts=8,moe_intermediate_size=32,intermediate_size=64",
    "olmoe": f"olmoe-1b-7b:{TINY},num_experts=8,intermediate_size=32",  # a q/k norm over every rank's heads
    # MLA (q LoRA, a 48-value latent), grouped sigmoid routing with a correction bias, a dense first layer.
    "deepseek_v3": ("deepseek-v3:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=4,"
                    "q_lora_rank=24,kv_lora_rank=32,qk_nope_head_dim=16,qk_rope_head_dim=16,v_head_dim=16,"
                    "n_routed_experts=8,num_experts_per_tok=3,n_group=4,topk_group=2,moe_intermediate_size=32,intermediate_size=64,"
                    "first_k_dense_replace=1,vocab_size=512,max_position_embeddings=256,bos_token_id=null,"
                    "eos_token_id=511"),
    # V2-Lite: MLA without q LoRA (q_proj split by heads), softmax greedy routing.
    "deepseek_v2": ("deepseek-v2-lite:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=4,"
                    "kv_lora_rank=32,qk_nope_head_dim=16,qk_rope_head_dim=16,v_head_dim=16,n_routed_experts=8,"
                    "num_experts_per_tok=2,moe_intermediate_size=32,intermediate_size=64,vocab_size=512,"
                    "max_position_embeddings=256,bos_token_id=null,eos_token_id=511"),
}
SPLITS = {
    "qwen3": {"tp": dict(tensor_parallel_size=2), "ep": dict(tensor_parallel_size=2, enable_expert_parallel=True)},
    "olmoe": {"tp": dict(tensor_parallel_size=2)},
    "deepseek_v3": {"tp": dict(tensor_parallel_size=2), "ep": dict(tensor_parallel_size=2, enable_expert_parallel=True)},
    "deepseek_v2": {"tp": dict(tensor_parallel_size=2)},
}


@pytest.fixture(scope="module")
def random_split_runs():
    """Every spec's workload (a fresh seed for the weights and the prompts) generated single and split, in one
    rank process: {family: (seed, max_tokens, modes, (status, value))}."""
    runs, seeds = {}, {}
    for family, spec in SPECS.items():
        seeds[family] = seed = random.randrange(2**31)
        rng = random.Random(seed)
        prompts = [[rng.randrange(1, 511) for _ in range(n)] for n in (23, 5, 13)]
        max_tokens = [6, 8, 5]
        weights = dict(random_weights=spec, seed=seed)
        modes = {name: {**split, **weights} for name, split in {"single": {}, **SPLITS[family]}.items()}
        runs[family] = (f"random-{family}", prompts, max_tokens, modes)
    return generate_each_way(runs, seeds, timeout_s=150)


@pytest.mark.timeout(180)  # the first family's test builds every family's results (module fixture)
@pytest.mark.parametrize("family", sorted(SPECS))
def test_split_random_weight_engines_generate_the_single_process_tokens(family, random_split_runs):
    value = check_each_way_generates_the_single_tokens(family, random_split_runs[family])
    if "ep" in random_split_runs[family][2]:
        by_rank = value["ep:stats"][2]
        assert by_rank is not None and len(by_rank) == 2 and sum(by_rank) > 0


def _replica_sharing_experts(rank: int, world: int, address: str, spec: str, seed: int, prompts, max_tokens):
    """Replica ``rank`` of ``world`` engines dividing the experts: its tokens alone (one process) and in the group."""
    from engine import LLM, SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens[rank]]
    weights = dict(random_weights=spec, seed=seed)
    alone = [out.token_ids for out in LLM("random", **ENGINE, **weights).generate(prompts[rank], params)]
    llm = LLM("random", **ENGINE, **weights, enable_expert_parallel=True, data_parallel_size=world,
              data_parallel_rank=rank, distributed_init_method=address)
    try:
        got = [out.token_ids for out in llm.generate(prompts[rank], params)]
        experts = llm.engine.model.model.layers[0].mlp.experts.w13.shape[0]
    finally:
        llm.engine.close()
    return {"alone": alone, "got": got, "experts": experts}


@pytest.mark.timeout(120)
def test_random_weight_replicas_sharing_experts_generate_their_own_tokens():
    """Two engines whose MoE layers divide the experts (4 each of 8), each with its own requests: each generates
    what the single-process engine of the same spec and seed does."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    lengths = {0: (17, 4), 1: (9,)}
    prompts = {r: [[rng.randrange(1, 511) for _ in range(n)] for n in lengths[r]] for r in lengths}
    max_tokens = {0: [7, 5], 1: [3]}
    results = run_ranks_each(_replica_sharing_experts, 2, {"qwen3": (SPECS["qwen3"], seed, prompts, max_tokens)},
                             timeout_s=100)["qwen3"]
    assert sorted(results) == [0, 1] and all(s == "ok" for s, _ in results.values()), (seed, results)
    for rank, (_, value) in results.items():
        assert value["got"] == value["alone"], f"replica {rank} seed={seed}"
        assert [len(t) for t in value["got"]] == max_tokens[rank] and value["experts"] == 4
