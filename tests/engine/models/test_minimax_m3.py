"""MiniMax-M3's text model (a full layer, then a MiniMax Sparse Attention layer whose block indexer keeps 3 blocks
of 8 keys per query, its own block and the one before always among them; partial rope, the indexer rotating its
first dims with the attention's; per-head q/k norms; gpt-oss's clamped SwiGLU in the dense, shared and routed MLPs;
bias-corrected sigmoid routing): greedy tokens equal transformers' on a tiny random checkpoint saved by
transformers' image-text class (the engine loads its text model alone), with prompts far longer than the kept
blocks chunked 16 tokens a step, a preemption forced, and a second pass over prompts sharing a prefix hitting the
prefix cache; pipelining it is refused at start in one line. (Split tensor parallel:
tests/distributed/test_minimax_m3_tensor_parallel.py.)"""

import pytest
from transformers import AutoConfig

from engine import LLM, SamplingParams
from tests.engine.models.test_vs_transformers import prefix_and_long_reference, second_pass_hits
from tests.hf_models import save_random_image_text_model, tiny_text_config

VOCAB = 211

# 4 heads over 2 KV heads of 16 (8 dims rotated), 2 indexer heads of 12 (one per KV head group); a prompt of 130
# tokens spans 17 blocks of which a query keeps 3; a clamp limit the random gate/up values reach.
M3_TEXT = dict(
    hidden_size=64, intermediate_size=20, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=24, dense_intermediate_size=48,
    layer_types=["full_attention", "minimax_m3_sparse"], mlp_layer_types=["dense", "sparse"], index_n_heads=2,
    index_head_dim=12, index_block_size=8, index_topk_blocks=3, index_local_blocks=2, swiglu_limit=0.5,
    swiglu_alpha=1.3, routed_scaling_factor=1.7,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
)


def make_m3_model(path: str, seed: int, vocab_size: int = VOCAB, **text):
    """A random MiniMax-M3 (text model and a one-layer vision tower) saved to ``path`` by transformers (in the
    published layout); every parameter and buffer random (the zero-centred norms and the correction bias drawn
    around their init). ``text`` adds to or overrides the text config."""
    config = AutoConfig.for_model(
        "minimax_m3_vl", text_config=tiny_text_config(vocab_size, **{**M3_TEXT, **text}),
        vision_config=dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                           patch_size=14, image_size=28),
        projector_hidden_size=32,
    )
    return save_random_image_text_model(config, path, seed)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(checkpoint, requests, transformers' tokens, seed): three prompts share a 40-token prefix, two are long, one
    is short."""
    return prefix_and_long_reference(tmp_path_factory, "minimax_m3", make_m3_model, VOCAB)


def test_greedy_matches_transformers_chunked_and_preempted(reference):
    path, reqs, expected, seed = reference
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=14, block_size=16, max_num_batched_tokens=16,
              overlap_scheduling=False)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    assert [o.token_ids for o in llm.generate([p for p, _ in reqs], params)] == expected, f"seed={seed}"
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0, "the small KV pool should have forced preemption"
    assert [type(a).__name__ for a in llm.engine.model.attention_layers()] == ["Attention", "BlockSparseAttention"]
    scheduler.kv.pool.check_all_free()


def test_second_pass_hits_the_prefix_cache(reference):
    """The three prompts sharing a 40-token prefix, twice on an engine whose pool holds them: both passes give
    transformers' tokens, and the second takes every whole block of each prompt from the prefix cache."""
    path, reqs, expected, seed = reference
    second_pass_hits(path, reqs[:3], expected[:3], seed)


def test_pipeline_parallel_is_refused_at_start(reference):
    with pytest.raises(ValueError) as caught:
        LLM(model=reference[0], dtype="float32", device="cpu", num_kv_blocks=8, pipeline_parallel_size=2)
    text = str(caught.value)
    assert "\n" not in text and text.startswith("--pipeline-parallel-size is not supported with sparse-attention "
                                                "models (MiniMaxM3SparseForConditionalGeneration)"), text
