"""Step-3.7-Flash's text model (a sliding and a full layer, the sliding one with fewer query heads; per-head output
gates; each layer kind at its own rope; clamped SwiGLUs; a dense first layer, then bias-corrected sigmoid routing
beside a shared expert): greedy tokens equal transformers' on a tiny random checkpoint saved by transformers' image-
text class (the engine loads its text model alone), with prompts chunked 16 tokens a step, a preemption forced, the
sliding layer's blocks handed back as its window passes them, and a second pass over prompts sharing a prefix hitting
the prefix cache; what the family is not split with yet is refused at start in one line."""

import pytest
from transformers import AutoConfig

from engine import LLM, SamplingParams
from engine.core.kv_cache_manager import sliding_blocks_bound
from tests.engine.models.test_vs_transformers import prefix_and_long_reference, second_pass_hits
from tests.hf_models import save_random_image_text_model, tiny_text_config

VOCAB = 211
WINDOW = 8

# The published plan cut to a sliding and a full layer (so the sliding layer's blocks form a cache group of their own
# and go back to the pool): 4 query heads in the full layer, 2 in the sliding one, 1 KV head of 16; the full kind
# rotates every dim at theta 50000, the sliding kind half of them at theta 500; a softmax scale of 20 ** -0.5, not
# 16 ** -0.5; clamp bounds (0.3 to 0.5) the random gate/up values reach.
STEP_TEXT = dict(
    hidden_size=64, intermediate_size=48, num_attention_heads=4, num_sliding_attention_heads=2, num_key_value_heads=1,
    head_dim=16, moe_intermediate_size=20, n_routed_experts=8, num_experts_per_tok=2, share_expert_dim=24,
    sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
    swiglu_limits=[None, 0.3], swiglu_limits_shared=[0.4, 0.5], moe_router_scaling_factor=1.7,
    query_pre_attn_scalar=20, rope_theta=[500.0, 50000.0], partial_rotary_factors=[0.5, 1.0],
)


def make_step_model(path: str, seed: int, vocab_size: int = VOCAB, **text):
    """A random Step-3.7-Flash (text model and a one-layer vision tower) saved to ``path`` by transformers; every
    parameter and buffer random (the zero-centred norms and the correction biases drawn around their init).
    ``text`` adds to or overrides the text config."""
    config = AutoConfig.for_model(
        "step3p7", text_config=tiny_text_config(vocab_size, **{**STEP_TEXT, **text}),
        vision_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14),
    )
    return save_random_image_text_model(config, path, seed)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(checkpoint, requests, transformers' tokens, seed): three prompts share a 40-token prefix, two are long (far
    past the window of 8 and past many 16-token chunks), one is short."""
    return prefix_and_long_reference(tmp_path_factory, "step3p7", make_step_model, VOCAB)


def test_greedy_matches_transformers_chunked_preempted_windowed(reference):
    path, reqs, expected, seed = reference
    block_size, budget = 4, 16
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=48, block_size=block_size,
              max_num_batched_tokens=budget, overlap_scheduling=False)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    assert [o.token_ids for o in llm.generate([p for p, _ in reqs], params)] == expected, f"seed={seed}"
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0, "the small KV pool should have forced preemption"
    # The sliding layer keeps its own block table: its blocks per request stay within its window's.
    assert scheduler.kv.windows == (None, WINDOW)
    full_peak, sliding_peak = scheduler.stats().kv_peak_request_blocks
    assert sliding_peak <= sliding_blocks_bound(WINDOW, block_size, budget)
    assert full_peak >= -(-max(len(p) for p, _ in reqs) // block_size) > sliding_peak
    heads = [layer.self_attn.num_heads for layer in llm.engine.model.local_layers()]
    assert heads == [2, 4]
    scheduler.kv.pool.check_all_free()


def test_second_pass_hits_the_prefix_cache(reference):
    """The three prompts sharing a 40-token prefix, twice on an engine whose pool holds them: both passes give
    transformers' tokens, and the second takes every whole block of each prompt from the prefix cache."""
    path, reqs, expected, seed = reference
    second_pass_hits(path, reqs[:3], expected[:3], seed)


@pytest.mark.parametrize("flags, named", [(dict(pipeline_parallel_size=2), "--pipeline-parallel-size"),
                                          (dict(enable_lora=True), "--enable-lora")])
def test_settings_not_served_yet_are_refused_at_start(reference, flags, named):
    with pytest.raises(ValueError) as caught:
        LLM(model=reference[0], dtype="float32", device="cpu", num_kv_blocks=8, **flags)
    text = str(caught.value)
    assert "\n" not in text and text.startswith(f"{named} is not supported with Step3p7ForConditionalGeneration"), text
