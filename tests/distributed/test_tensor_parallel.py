"""Tensor parallelism on real gloo ranks against transformers: every family's prefill and decode logits with the
model split over 2 ranks (heads, KV heads replicated where fewer than ranks, MLP and expert intermediate sizes, a
shared expert, a whole-projection q/k norm, gpt-oss's sinks and biases, MiMo-V2-Flash's layers of differing KV heads,
Step-3.7-Flash's per-head output gates, a vocabulary that does not divide) match the unsplit reference, and
each rank holds only its slices."""

import importlib
import random

import pytest
import torch

from tests.distributed.ranks import run_ranks_each
from tests.hf_models import make_hf_model

# Shapes that divide by 2 where tensor parallelism needs it; the vocabulary (97) does not, on purpose.
OVERRIDES = {
    "mixtral": {},  # 4 heads, 2 KV heads: one KV head per rank
    "qwen3_moe": {},  # 1 KV head: replicated on both ranks
    "qwen2_moe": dict(num_attention_heads=4, num_key_value_heads=4),  # qkv bias, a shared expert, a dense layer
    "olmoe": dict(hidden_size=40, num_attention_heads=4, num_key_value_heads=4),  # q/k norm over all heads
    "glm4_moe": {},  # partial rotary, grouped routing with a correction bias, an ungated shared expert
    "dots1": {},  # an o_proj bias (held by rank 0 alone), 2 shared experts, a dense first layer
    # Sinks split with the heads, o_proj and down biases added once, a sliding layer: prompts past its window of 8.
    "gpt_oss": {},
    "deepseek_v3": {},  # MLA: heads split, the latent cache replicated; grouped sigmoid routing, a dense layer
    # A full layer with one KV head (replicated) and a sliding one with two (split) and sinks, past its window of
    # 8; v heads narrower than q/k; a dense first layer.
    "mimo_v2_flash": dict(layer_types=["full_attention", "sliding_attention"], mlp_layer_types=["dense", "sparse"]),
    "hy_v3": {},  # per-head q/k norm, q/k/v/o biases, a dense first layer, an ungated shared expert
    # Step-3.7-Flash's text model (an image-text checkpoint): per-head output gates split with the heads, a sliding
    # layer of 2 query heads and a full one of 4 over one (replicated) KV head, the published stacked experts' gate
    # and up rows cut per rank, clamped SwiGLUs.
    "step3p7": {},
}
# Families whose checkpoints are built by their own test module's function (an image-text wrapper).
BUILDERS = {"step3p7": ("tests.engine.models.test_step3p7", "make_step_model")}
VOCAB = 97
BLOCK = 16
# The whole-engine sweeps on several processes (test_engine_ranks, test_replica_groups) run these families only:
# what differs between families inside the layers' slices is checked for every family by the logits test below
# (on the paged cache, prefill and decode); these are the ones whose split engine differs beyond it. Qwen3-MoE: a
# KV head replicated on both ranks; OLMoE: a q/k norm over every rank's heads; gpt-oss: sinks, biases added once, a
# sliding window, experts with biases; DeepSeek-V3: MLA's replicated latent cache, grouped sigmoid routing, ungated
# shared experts and a dense first layer beside divided experts; Qwen2-MoE: a gated shared expert and a dense layer
# beside divided experts, and the all-gather dispatch (GATHER_FAMILY). Mixtral, GLM-4.5 and dots.llm1 take paths
# these cover (KV heads split per rank; ungated shared experts, grouped routing, an o_proj bias in the logits test).
ENGINE_FAMILIES = ("deepseek_v3", "gpt_oss", "olmoe", "qwen2_moe", "qwen3_moe")
GATHER_FAMILY = "qwen2_moe"


def _rank_logits(rank: int, world: int, address: str, model_dir: str, prompts: list[list[int]]):
    from engine.core.config import CacheConfig
    from engine.core.scheduler import ScheduledRequest
    from engine.distributed.collectives import TensorParallel
    from engine.distributed.groups import RankGroups, RankInfo
    from engine.core.model_config import load_model_config
    from engine.loading.model_loader import build_model
    from engine.worker.cache_binding import attach_caches
    from engine.worker.runner import ModelRunner

    groups = RankGroups(RankInfo(rank, world, rank, address), torch.device("cpu"), timeout_s=60)
    tp = TensorParallel(groups)
    config = load_model_config(model_dir)
    model = build_model(config, model_dir, torch.float32, torch.device("cpu"), "torch", 256, tp)
    pool = CacheConfig(BLOCK, 32, False)
    caches = attach_caches(model, pool, torch.device("cpu"), torch.float32)
    runner = ModelRunner(model, pool, torch.device("cpu"), torch.float32, 0, caches, "torch")
    blocks = [[4 * i + j for j in range(4)] for i in range(len(prompts))]

    def logits(plan):
        with torch.inference_mode():
            batch = runner.prepare(plan)
            hidden = runner.forward(batch)  # [T, H]
            return model.compute_logits(hidden.index_select(0, batch.sample_rows))  # [N, V]

    prefill = logits([ScheduledRequest(None, len(p), b, True, 0, p) for p, b in zip(prompts, blocks)])
    nexts = prefill.argmax(-1).tolist()
    decode = logits([ScheduledRequest(None, 1, b, True, len(p), [t]) for p, b, t in zip(prompts, blocks, nexts)])
    params = sum(p.numel() for p in model.parameters())
    groups.close()
    return {"prefill": prefill.tolist(), "decode": decode.tolist(), "next": nexts, "params": params,
            "kv_heads": model.num_local_kv_heads, "cache_values": model.attention_layers()[0].cache_spec().values_per_token()}


def family_checkpoints(tmp_path_factory, prefix: str, families=tuple(sorted(OVERRIDES))) -> dict:
    """Each family's (every one by default) random 2-layer checkpoint in these shapes, each in its own folder and
    from its own seed: {family: (seed, folder, the transformers model, a random.Random(seed) for its workload)}."""
    out = {}
    for family in families:
        seed = random.randrange(2**31)
        model_dir = str(tmp_path_factory.mktemp(f"{prefix}-{family}"))
        if family in BUILDERS:
            module, name = BUILDERS[family]
            hf = getattr(importlib.import_module(module), name)(model_dir, seed, vocab_size=VOCAB)
        else:
            hf = make_hf_model(family, model_dir, seed=seed, vocab_size=VOCAB, num_layers=2, **OVERRIDES[family])
        out[family] = (seed, model_dir, hf, random.Random(seed))
    return out


@pytest.fixture(scope="module")
def split_logits(tmp_path_factory):
    """Every family's random checkpoint, prompts and both ranks' logits: {family: (seed, hf model, prompts,
    {rank: (status, value)})}."""
    runs, refs = {}, {}
    for family, (seed, model_dir, hf, rng) in family_checkpoints(tmp_path_factory, "tp").items():
        prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (5, 17, 2)]
        runs[family] = (model_dir, prompts)
        refs[family] = (seed, hf, prompts)
    results = run_ranks_each(_rank_logits, 2, runs, timeout_s=500)  # the processes' start-up paid once
    return {family: (*refs[family], results[family]) for family in runs}


@pytest.mark.parametrize("family", sorted(OVERRIDES))
def test_two_ranks_give_the_reference_logits_and_hold_their_slices(family, split_logits):
    seed, hf, prompts, results = split_logits[family]
    assert sorted(results) == [0, 1] and all(s == "ok" for s, _ in results.values()), results
    (_, r0), (_, r1) = results[0], results[1]
    msg = f"family={family} seed={seed}"
    assert r0["prefill"] == r1["prefill"] and r0["decode"] == r1["decode"], f"ranks disagree after the gather ({msg})"
    with torch.no_grad():
        for i, p in enumerate(prompts):
            want = hf(torch.tensor([p])).logits[0, -1]
            assert torch.allclose(torch.tensor(r0["prefill"][i]), want, atol=2e-4, rtol=1e-4), msg
            want = hf(torch.tensor([p + [r0["next"][i]]])).logits[0, -1]
            assert torch.allclose(torch.tensor(r0["decode"][i]), want, atol=2e-4, rtol=1e-4), msg
    full = sum(p.numel() for p in hf.parameters())
    assert r0["params"] < 0.75 * full and r1["params"] < 0.75 * full, (r0["params"], full)
    if family.startswith("deepseek"):  # every rank caches the whole latent row
        assert r0["cache_values"] == hf.config.kv_lora_rank + hf.config.qk_rope_head_dim
    else:
        assert r0["kv_heads"] == max(1, hf.config.get_text_config().num_key_value_heads // 2)
