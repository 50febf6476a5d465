"""A tiny DeepSeek-V3.2 and GLM-5 (whose "shared" layer caches a latent row only) served with
``kv_cache_dtype="fp8"``: greedy tokens equal transformers' model whose cache
passes every latent row and indexer key through the FP8 format as it is written (``engine.layers.fp8_cache``'s
quantize-dequantize, the one piece shared with the engine), with prompts chunked over a cached prefix so the
prefill, decode and indexer reads of the FP8 rows all run."""

import random

import pytest
import torch
from transformers import cache_utils

from engine import LLM, SamplingParams
from engine.layers import fp8_cache
from tests.engine.models.test_sparse_attention import FAMILIES, VOCAB, earlier_first_topk, make_dsa_model
from tests.engine.models.test_vs_transformers import hf_greedy


def _through_fp8_latent(latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cached latents [B, 1, S, r] and rotary keys [B, 1, S, p] as the FP8 cache gives them back."""
    r = latent.shape[-1]
    rows = fp8_cache.pack_latent_rows(latent.reshape(-1, r), k_pe.reshape(-1, k_pe.shape[-1]))
    back = fp8_cache.unpack_latent_rows(rows, r, latent.dtype)  # [B*S, r + p]
    return back[:, :r].reshape(latent.shape), back[:, r:].reshape(k_pe.shape)


def cache_through_fp8(patch: pytest.MonkeyPatch) -> None:
    """Make transformers' cache (on ``patch``, a monkeypatch context) pass every latent row and indexer key through
    the FP8 format as it is written, as the engine's FP8 cache holds them."""
    update, update_indexer = cache_utils.Cache.update, cache_utils.Cache.update_indexer

    def fp8_update(self, latent, k_pe, layer_idx, *args, **kwargs):
        return update(self, *_through_fp8_latent(latent, k_pe), layer_idx, *args, **kwargs)

    def fp8_update_indexer(self, keys, layer_idx):  # keys [B, S, d_i]
        rows = fp8_cache.pack_key_rows(keys.reshape(-1, keys.shape[-1]))
        back = fp8_cache.unpack_key_rows(rows, keys.shape[-1]).to(keys.dtype).reshape(keys.shape)
        return update_indexer(self, back, layer_idx)

    patch.setattr(cache_utils.Cache, "update", fp8_update)
    patch.setattr(cache_utils.Cache, "update_indexer", fp8_update_indexer)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_with_its_cache_through_fp8(tmp_path, monkeypatch, family):
    seed = random.randrange(2**31)
    hf = make_dsa_model(family, str(tmp_path), seed, **FAMILIES[family])
    rng = random.Random(seed)
    prefix = [rng.randrange(1, VOCAB - 1) for _ in range(24)]
    prompts = [prefix + [rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(4, 20))] for _ in range(2)]
    prompts.append([rng.randrange(1, VOCAB - 1) for _ in range(40)])
    new_tokens = 12

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "topk", earlier_first_topk)
        cache_through_fp8(patch)
        expected = [hf_greedy(hf, p, new_tokens) for p in prompts]

    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", kv_cache_dtype="fp8", num_kv_blocks=16,
              block_size=16, max_num_batched_tokens=16)
    assert {t.dtype for layer in llm.engine.model.attention_layers() for t in layer.kv_cache} == {torch.uint8}
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected, f"seed={seed}"
    assert llm.engine.scheduler.kv.prefix_hit_tokens > 0, f"seed={seed}: no prefix-cache hit"
