"""The engine gives the same greedy tokens with Triton attention kernels as with torch's.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 is set
here at collection). Prompts share a prefix (prefix-cache hits) and the token budget
is small, so prefill runs in chunks over cached blocks and mixes with decodes.
A third run routes decode-only steps through the CUDA-graph transform's static
buffers and padding (``capture=False`` runs them eagerly: no GPU here).
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import LLM, KernelChoice, SamplingParams  # noqa: E402
from engine.transforms.cuda_graphs import enable_decode_graphs  # noqa: E402
from tests.hf_models import make_hf_model  # noqa: E402

VOCAB = 97
# On a GPU the kernels are compiled, not interpreted, and need CUDA tensors. The torch MoE backend keeps
# CUDA graphs off there, so the eager triton-vs-torch attention comparison is what runs.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ENGINE = dict(dtype="float32", device=DEVICE, num_kv_blocks=96, block_size=4, max_num_batched_tokens=24)


def _prompts(rng: random.Random) -> list[list[int]]:
    shared = [rng.randrange(1, VOCAB - 1) for _ in range(13)]
    return [shared + [rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (3, 9)] + [
        [rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (1, 30)
    ]


def _generate(llm: LLM, prompts) -> list[list[int]]:
    # One request first, so the others hit its cached prefix blocks; then the rest together.
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    first = llm.generate(prompts[:1], params)
    return [out.token_ids for out in first + llm.generate(prompts[1:], params)]


def _with_graph_buffers(llm: LLM) -> list[int]:
    """Route decode-only steps through the CUDA-graph transform (sizes 2 and 4, eager); returns their sizes."""
    graphs = enable_decode_graphs(llm.engine.runner, (2, 4), max_num_seqs=4, max_model_len=llm.engine.max_model_len,
                                  capture=False)
    sizes_run = []
    real_run = graphs.run

    def recording(batch):
        sizes_run.append(batch.num_decodes)
        return real_run(batch)

    graphs.run = recording
    return sizes_run


# gpt-oss: sinks, and a window (8) on its first layer only that the 30-token prompt goes past.
# deepseek_v3: MLA, decodes in the Triton MLA kernel over the latent cache, prefill chunks expanded in torch.
# mimo_v2_flash: layers of 1 and 2 KV heads, sinks and a window of 8 on two of its three, V cached zero-padded.
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "mimo_v2_flash"])
def test_triton_attention_matches_torch_attention(family, tmp_path):
    seed = random.randrange(2**31)
    make_hf_model(family, str(tmp_path), seed=seed, vocab_size=VOCAB)
    prompts = _prompts(random.Random(seed))
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=str(tmp_path), kernel_choice=KernelChoice(attention=backend), **ENGINE)
        tokens[backend] = _generate(llm, prompts)
        kv = llm.engine.scheduler.kv
        assert kv.prefix_hit_tokens > 0, (f"the shared prefix was never a cache hit ({backend}, windows {kv.windows}, "
                                          f"{kv.prefix_query_tokens} tokens looked up)")
    assert tokens["triton"] == tokens["torch"], f"seed={seed} family={family}"
    if family == "mixtral":
        return
    # Decode-only steps through the graph buffers: one request pads to 2, three to 4; the padding rows
    # (scratch-block K/V, empty context) must not disturb the real ones.
    llm = LLM(model=str(tmp_path), kernel_choice=KernelChoice(attention="triton"), **ENGINE)
    sizes_run = _with_graph_buffers(llm)
    assert _generate(llm, prompts) == tokens["torch"], f"seed={seed} (graph buffers)"
    assert 1 in sizes_run and 3 in sizes_run, f"padded sizes never exercised: {sorted(set(sizes_run))}"
    assert llm.engine.runner.scratch_block == llm.engine.scheduler.kv.pool.num_blocks  # owned by no request
    if family == "gpt_oss":  # its sliding layer reads its own tables, whose blocks left the window on the way
        full_peak, sliding_peak = llm.engine.stats().kv_peak_request_blocks
        assert llm.engine.runner.window_tables and sliding_peak < full_peak


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculative_rows_with_triton_attention(tmp_path, proposer):
    """Draft rows are extra query rows over the paged cache (the prefill kernel's path, chunk after chunk):
    greedy tokens with speculation on Triton attention equal plain decoding's on torch attention. The draft
    proposer's model is the model itself (its own caches, Triton attention too): every draft is accepted."""
    seed = random.randrange(2**31)
    make_hf_model("qwen3_moe", str(tmp_path), seed=seed, vocab_size=VOCAB, num_layers=2)
    rng = random.Random(seed)
    prompts = [([rng.randrange(1, VOCAB - 1) for _ in range(n)] * 6)[:m] for n, m in ((2, 11), (3, 17), (5, 26))]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    plain = LLM(model=str(tmp_path), kernel_choice=KernelChoice(attention="torch"), **ENGINE)
    want = [out.token_ids for out in plain.generate(prompts, params)]
    draft = dict(speculative_model=str(tmp_path)) if proposer == "draft" else {}
    spec = LLM(model=str(tmp_path), kernel_choice=KernelChoice(attention="triton"), speculative=proposer,
               num_speculative_tokens=3, **draft, **ENGINE)
    got = [out.token_ids for out in spec.generate(prompts, params)]
    assert got == want, f"seed={seed}"
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens > 0, f"seed={seed}: no draft was accepted"
    if proposer == "draft":
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens, (seed, stats)
    spec.engine.scheduler.kv.pool.check_all_free()
