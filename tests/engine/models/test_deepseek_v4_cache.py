"""DeepSeek-V4's compressed cache layout: the paged cache holds only compressed entries (a window's entry spread
over its tokens' slots), the window's key rows and the open compression windows live in a per-request state.

Greedy tokens equal transformers' where that layout is stressed most: compression windows that straddle blocks
(rates 3 and 12 against blocks of 16, so an entry is also padded across its slots), chunks of 7 tokens (chunks end
mid-window and mid-block), prompts of many windows of each rate, preemption, and prefix-cache hits that resume
mid-window from a state checkpoint at every block boundary; the per-token bytes are the entries' alone."""

import random

import torch

from engine import LLM, SamplingParams
from engine.core.kv_cache_manager import KVCacheManager
from engine.layers.compressed_attention import CSA
from tests.engine.models.test_deepseek_v4 import VOCAB, make_v4_model
from tests.engine.models.test_sparse_attention import earlier_first_topk
from tests.engine.models.test_vs_transformers import hf_greedy

RATES = {"compressed_sparse_attention": 3, "heavily_compressed_attention": 12}
SETTINGS = dict(num_kv_blocks=7, block_size=16, max_num_batched_tokens=7, overlap_scheduling=False,
                state_checkpoint_share=0.95, state_checkpoint_interval=1)


def test_straddling_windows_match_transformers(tmp_path, monkeypatch):
    seed = random.randrange(2**31)
    hf = make_v4_model(str(tmp_path), seed, compress_rates=RATES)
    rng = random.Random(seed)
    prefix = [rng.randrange(1, VOCAB - 1) for _ in range(41)]  # 2 blocks and 9 tokens: mid-window for both rates
    shared = [prefix + [rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(20, 40))] for _ in range(2)]
    prompts = shared + [[rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(70, 90))]]
    reqs = [(p, rng.randint(6, 12)) for p in prompts]
    with monkeypatch.context() as patch:  # the indexer's ties taken in entry order, as the engine takes them
        patch.setattr(torch.Tensor, "topk", earlier_first_topk)
        expected = [hf_greedy(hf, p, m) for p, m in reqs]

    hits = []  # tokens each admission resumed from
    record = KVCacheManager.record_prefix_hit
    monkeypatch.setattr(KVCacheManager, "record_prefix_hit",
                        lambda self, request, n: (hits.append(n), record(self, request, n))[1])
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", **SETTINGS)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    outs = llm.generate([p for p, _ in reqs], params)
    assert [o.token_ids for o in outs] == expected, f"seed={seed}"
    first_pass = len(hits)
    again = llm.generate(shared, params[:2])  # resumed from the checkpoints of their blocks
    assert [o.token_ids for o in again] == expected[:2], f"seed={seed}"
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0, f"seed={seed}: the small KV pool should have forced preemption"
    assert any(hits[first_pass:]), f"seed={seed}: the second pass should hit"
    # Hits end on block boundaries: only those at a multiple of 48 tokens end a window of both rates.
    assert any(n % 48 for n in hits), f"seed={seed}: a hit should resume mid-window: {hits}"
    scheduler.kv.pool.check_all_free()

    for attn in llm.engine.model.attention_layers():  # per token: each entry's share of its window's slots
        rates = [attn.compressor.rate] * (2 if attn.kind == CSA else 1) if attn.compressor is not None else []
        widths = [32, 24][:len(rates)]
        assert attn.cache_spec().per_token == tuple((-(-w // r),) for w, r in zip(widths, rates)), attn.kind
