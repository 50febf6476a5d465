"""The 2026 families on a GPU: each family's tiny random checkpoint (built by its own CPU test's builder) served on
CUDA with the engine's CUDA defaults (Triton MoE, routing, elementwise and attention kernels where the layers take
them, the sparse-MLA kernel, decode and piecewise CUDA graphs where the family captures them, overlapped steps)
gives transformers' greedy tokens, float32 on both sides (the kernels' float32 dots are exact, not TF32) as the
other CUDA tests compare. Prompts are prefilled 16 tokens a step, then the three sharing a 40-token prefix run
again on the same engine and take their whole blocks from the prefix cache.

DeepSeek-V3.2 and GLM-5 also run with the FP8 cache on CUDA, against the same engine on CUDA with the model-dtype
cache (checked against transformers above) whose every write passes through the FP8 format: the two read the same
values, so their tokens are equal. Not against transformers on the CPU here: a row's FP8 rounding and the indexer's
top-k turn float32's last-bit differences between devices into other tokens (on the CPU, 1e-4 relative noise on the
cached values changed the greedy tokens in 6 of 8 runs, 1e-6 in none; on an H200 both families left transformers'
tokens within 7 tokens). transformers with the FP8 cache is the reference on the CPU
(``test_fp8_sparse_cache_vs_transformers``).

Skipped without CUDA (the CPU tests of each family check the same tokens there); run by the GPU session's
``tests-families`` stage (benchmarks/gpu_session.sh)."""

import functools

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.models.test_deepseek_v4 import make_v4_model
from engine.layers import fp8_cache
from tests.engine.models.test_fp8_sparse_cache_vs_transformers import _through_fp8_latent
from tests.engine.models.test_kimi_linear import make_kimi_model
from tests.engine.models.test_minimax_m3 import make_m3_model
from tests.engine.models.test_sparse_attention import FAMILIES as DSA_FAMILIES
from tests.engine.models.test_sparse_attention import earlier_first_topk, make_dsa_model
from tests.engine.models.test_step3p7 import make_step_model
from tests.engine.models.test_vs_transformers import prefix_and_long_reference
from tests.hf_models import make_hf_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICE = "cuda"
BLOCK = 16

# family -> make_model(path, seed), saving the checkpoint and returning transformers' model of it.
BUILDERS = {
    "deepseek_v32": functools.partial(make_dsa_model, "deepseek_v32", **DSA_FAMILIES["deepseek_v32"]),
    "glm_moe_dsa": functools.partial(make_dsa_model, "glm_moe_dsa", **DSA_FAMILIES["glm_moe_dsa"]),
    "deepseek_v4": make_v4_model,
    "qwen3_next": functools.partial(make_hf_model, "qwen3_next"),
    "qwen3_5_moe": functools.partial(make_hf_model, "qwen3_5_moe"),
    "kimi_linear": make_kimi_model,
    "minimax_m3": make_m3_model,
    "mimo_v2_flash": functools.partial(make_hf_model, "mimo_v2_flash"),
    "step3p7": make_step_model,
    "hy_v3": functools.partial(make_hf_model, "hy_v3"),
}
# Indexers whose scores tie: transformers' topk takes tied keys in the engine's order (see earlier_first_topk).
INDEXED = ("deepseek_v32", "glm_moe_dsa", "deepseek_v4")
# The families whose decode steps replay CUDA graphs by default (the others run eagerly: sparse attention's
# selections and the linear layers' host-built state metadata are not captured yet), and those whose prefill
# steps also replay piecewise graphs (every layer's attention takes the same shapes).
DECODE_GRAPHS = ("mimo_v2_flash", "step3p7", "hy_v3")
PIECEWISE_GRAPHS = ("hy_v3",)
# DeepSeek-V4 resumes a prefix hit from a state checkpoint (each layer's window and open compression windows), which
# in this tiny model takes more than many KV blocks: their share of the memory set high enough for one per prompt.
FAMILY_SETTINGS = {"deepseek_v4": dict(state_checkpoint_share=0.9)}
CASES = [(family, "auto") for family in BUILDERS] + [(family, "fp8") for family in DSA_FAMILIES]


@pytest.mark.parametrize("family,cache", CASES, ids=[f"{f}-{c}" for f, c in CASES])
def test_greedy_matches_transformers_on_cuda(tmp_path_factory, monkeypatch, family, cache):
    # Three prompts sharing a 40-token prefix, then prompts of 3, 100 and 130 tokens; transformers on the CPU.
    with monkeypatch.context() as patch:
        if family in INDEXED:
            patch.setattr(torch.Tensor, "topk", earlier_first_topk)
        path, reqs, expected, seed = prefix_and_long_reference(tmp_path_factory, family, BUILDERS[family])

    # 64 blocks hold every request at once and keep the shared prompts' blocks cached for the second pass; 8
    # sequences at most: decode graphs captured for 1, 2, 4 and 8 rows alone.
    settings = dict(model=path, dtype="float32", device=DEVICE, num_kv_blocks=64, block_size=BLOCK,
                    max_num_batched_tokens=16, max_num_seqs=8, **FAMILY_SETTINGS.get(family, {}))
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    if cache == "fp8":  # the reference: this device's model-dtype cache, its writes through the FP8 format
        reference = LLM(kv_cache_dtype="auto", **settings)
        round_cache_writes_through_fp8(reference)
        expected = [o.token_ids for o in reference.generate([p for p, _ in reqs], params)]
        del reference
    llm = LLM(kv_cache_dtype=cache, **settings)
    outs = llm.generate([p for p, _ in reqs], params)
    assert [o.token_ids for o in outs] == expected, f"seed={seed}"

    kv = llm.engine.scheduler.kv
    hits_before = kv.prefix_hit_tokens
    again = llm.generate([p for p, _ in reqs[:3]], params[:3])
    assert [o.token_ids for o in again] == expected[:3], f"seed={seed}: the second pass differs"
    # Every whole block before each prompt's last token (that one is computed again for its logits).
    want_hits = sum((len(p) - 1) // BLOCK * BLOCK for p, _ in reqs[:3])
    assert kv.prefix_hit_tokens - hits_before == want_hits, f"seed={seed}"

    runner = llm.engine.runner
    if cache == "fp8":
        assert {t.dtype for layer in llm.engine.model.attention_layers() for t in layer.kv_cache} == {torch.uint8}
    if DEVICE == "cuda":  # the graphs the defaults turn on did replay (DEVICE is "cpu" only in a local dry run)
        if family in DECODE_GRAPHS:
            assert runner.decode_graphs is not None and runner.decode_graphs.replays > 0, family
        if family in PIECEWISE_GRAPHS:
            assert runner.piecewise_graphs is not None and runner.piecewise_graphs.replays > 0, family
    kv.pool.check_all_free()


def round_cache_writes_through_fp8(llm: LLM) -> None:
    """Every sparse-MLA layer of ``llm`` (a model-dtype cache) writes its latent rows and indexer keys as the FP8
    cache gives them back (``engine.layers.fp8_cache``'s quantize-dequantize)."""
    for layer in llm.engine.model.attention_layers():
        def through_fp8(q, latent, k_pe, index_q, index_k, index_w, meta, attend=layer.attend):
            latent, k_pe = _through_fp8_latent(latent, k_pe)  # [T, r], [T, p]
            if index_k is not None:  # [T, d_i]
                rows = fp8_cache.pack_key_rows(index_k)
                index_k = fp8_cache.unpack_key_rows(rows, index_k.shape[-1]).to(index_k.dtype)
            return attend(q, latent, k_pe, index_q, index_k, index_w, meta)

        layer.attend = through_fp8
