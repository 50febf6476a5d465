"""Piecewise CUDA graphs (prefill and mixed steps): token-count buckets, padding, the pieces' plumbing.

No GPU here: ``capture=False`` runs the same padding, static-buffer and piece code eagerly, with the
attention cores between the pieces, so everything but the capture itself is compared with the plain
eager forward (itself compared with transformers in test_vs_transformers). Torch attention keeps this
fast on the CPU (attention runs outside the pieces anyway); one case runs the Triton kernels the GPU
captures inside the pieces, interpreted.
"""

import argparse
import os
import random

import pytest
import torch

if not torch.cuda.is_available():  # the Triton-kernel case below runs interpreted (before any Triton import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import LLM, EngineConfig, KernelChoice, SamplingParams  # noqa: E402
from engine.transforms.piecewise_graphs import default_token_sizes, enable_piecewise_graphs  # noqa: E402
from engine.engine_flags import engine_config, token_sizes  # noqa: E402
from gateway.cli import build_parser  # noqa: E402
from tests.hf_models import make_hf_model  # noqa: E402

VOCAB = 97


def test_default_token_sizes_and_their_validation():
    assert default_token_sizes(4096) == (16, 32, 64, 128, 256, 512)
    assert default_token_sizes(100) == (16, 32, 64, 100)
    assert default_token_sizes(8) == (8,)
    assert EngineConfig(model="m", cuda_graph_token_sizes=(64, 16, 16)).cuda_graph_token_sizes == (16, 64)
    assert EngineConfig(model="m", cuda_graph_token_sizes=()).cuda_graph_token_sizes == ()
    for bad in ((0, 16), (16, 8192)):
        with pytest.raises(ValueError, match="cuda_graph_token_sizes"):
            EngineConfig(model="m", cuda_graph_token_sizes=bad)
    assert token_sizes("16,64") == (16, 64) and token_sizes("none") == ()
    with pytest.raises(argparse.ArgumentTypeError, match="--cuda-graph-token-sizes"):
        token_sizes("16,x")
    for flag, sizes in ((["--cuda-graph-token-sizes", "64,16"], (16, 64)), (["--cuda-graph-token-sizes", "none"], ()),
                        ([], None)):
        args = build_parser().parse_args(["serve", "--model", "m", *flag])
        assert engine_config(args).cuda_graph_token_sizes == sizes


def _record_sizes(graphs) -> list[tuple[int, int, int]]:
    """(real tokens, captured size, decode tokens) of every step the graphs serve."""
    seen = []
    real_run = graphs.run

    def recording(batch):
        n = batch.input_ids.shape[0]
        seen.append((n, min(s for s in graphs.sizes if s >= n), batch.meta.num_decodes))
        return real_run(batch)

    graphs.run = recording
    return seen


# torch: every part in torch ops. triton-pieces: what the GPU captures inside the pieces (fused norms, RoPE and
# routing, the Triton fused MoE), interpreted; attention stays torch's (it runs outside the pieces).
PIECE_KERNELS = {"torch": KernelChoice(), "triton-pieces": KernelChoice("torch", "triton", "triton", "off")}


@pytest.mark.parametrize("kernels", list(PIECE_KERNELS))
def test_padded_rows_do_not_change_real_rows(kernels, tmp_path):
    """Each step of a chunked, mixed workload: the piecewise forward over a padded bucket, its buffers full of
    garbage beforehand, gives the unpadded eager forward's hidden states and KV writes, and writes no other slot."""
    # 4 experts: the interpreter pays per program.
    make_hf_model("qwen3_moe", str(tmp_path), seed=random.randrange(2**31), vocab_size=VOCAB, num_experts=4,
                  num_experts_per_tok=2)
    # The Triton kernels compiled where there is a GPU (interpreted only without one).
    device = "cuda" if kernels == "triton-pieces" and torch.cuda.is_available() else "cpu"
    llm = LLM(model=str(tmp_path), kernel_choice=PIECE_KERNELS[kernels], dtype="float32", device=device, num_kv_blocks=64,
              block_size=4, max_num_batched_tokens=12, overlap_scheduling=False)
    engine, runner = llm.engine, llm.engine.runner
    if kernels == "torch":
        with pytest.raises(ValueError, match="Triton MoE"):  # the torch MoE path cannot be captured
            enable_piecewise_graphs(runner, (8, 32), capture=True)
    graphs = enable_piecewise_graphs(runner, (8, 32), capture=False)
    rng = random.Random(0)
    for n in (17, 4, 6):  # chunks of 12 tokens: prefill chunks alone, then mixed with decodes, then decodes
        engine.add_request([rng.randrange(1, VOCAB - 1) for _ in range(n)],
                           SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    padded = mixed = 0
    while engine.scheduler.has_unfinished():
        plan = engine.scheduler.schedule()
        with torch.inference_mode():
            batch = runner.prepare(plan.scheduled)
            before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
            expected = runner.model(batch.input_ids, batch.positions, batch.meta)  # [n, H]
            after = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
            for (k, v), (k0, v0) in zip(runner.kv_caches, before):
                k.copy_(k0)
                v.copy_(v0)
            for name in ("q", "k", "v", "residual", "attn", "out"):  # stale rows from "earlier steps"
                getattr(graphs.buffers, name).normal_(0, 50)
            got = graphs.run(batch)
        n = batch.input_ids.shape[0]
        padded += n not in graphs.sizes
        mixed += 0 < batch.meta.num_decodes < n
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        for (k, v), (k1, v1) in zip(runner.kv_caches, after):
            torch.testing.assert_close(k, k1, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v, v1, rtol=1e-5, atol=1e-5)
        # Slots nobody wrote are bit-identical: padding rows wrote no K/V (not even to the scratch block).
        written = torch.zeros(runner.kv_caches[0][0].shape[:2], dtype=torch.bool, device=device).view(-1)
        written[batch.meta.slot_mapping] = True
        for (k, _), (k0, _) in zip(runner.kv_caches, before):
            assert torch.equal(k.view(-1, *k.shape[2:])[~written], k0.view(-1, *k0.shape[2:])[~written])
        engine.scheduler.update(plan, [rng.randrange(1, VOCAB - 1) if s.sample else None
                                            for s in plan.scheduled])
    assert padded > 0 and mixed > 0 and graphs.replays > 0


# qwen2_moe: a shared expert and a dense-MLP layer inside the pieces; speculative: drafts verified in the pieces.
# deepseek_v3: MLA's q, latent and rope key handed between the pieces.
CASES = [("qwen3_moe", {}), ("olmoe", {}), ("qwen2_moe", {}),
         ("qwen3_moe", dict(speculative="ngram", num_speculative_tokens=4, speculative_max_batch=64)), ("deepseek_v3", {})]


@pytest.mark.parametrize("family,extra", CASES, ids=["qwen3_moe", "olmoe", "qwen2_moe", "qwen3_moe-speculative",
                                                     "deepseek_v3"])
def test_engine_with_piecewise_buffers_gives_the_eager_tokens(family, extra, tmp_path):
    """Greedy tokens with prefill and mixed steps routed through the pieces equal the eager engine's, through
    chunked prefill, preemption (a small pool) and prefix-cache hits."""
    seed = random.randrange(2**31)
    overrides = dict(clip_qkv=0.9) if family == "olmoe" else {}  # OLMoE's whole-projection q/k norm, clipped
    make_hf_model(family, str(tmp_path), seed=seed, vocab_size=VOCAB, **overrides)
    rng = random.Random(seed)
    shared = [rng.randrange(1, VOCAB - 1) for _ in range(40)]
    # Long outputs over an 18-block pool: the 200-token prompt alone grows to 15 blocks while the others run, so
    # every seed preempts (a random workload with short outputs sometimes fit).
    reqs = [([rng.randrange(1, VOCAB - 1) for _ in range(n)], rng.randint(32, 40)) for n in (3, 200, 57, 96, 130)]
    prompts = [p for p, _ in reqs] + [shared + [rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (3, 11)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    params += [SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)] * 2
    tokens, seen = {}, []
    for pieces in (False, True):
        llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", kernels="torch", num_kv_blocks=18, block_size=16,
                  max_num_batched_tokens=48, overlap_scheduling=False, **extra)
        if pieces:
            graphs = enable_piecewise_graphs(llm.engine.runner, (16, 32, 48), capture=False)
            seen = _record_sizes(graphs)
        first = llm.generate(prompts[-2:-1], params[-2:-1])  # cached, so the last prompt hits its prefix
        # The prefix hit admitted first, before the others' blocks push the cached ones out of the small pool.
        outs = llm.generate(prompts[-1:] + prompts[:-2], params[-1:] + params[:-2])
        tokens[pieces] = [o.token_ids for o in first + outs]
        scheduler = llm.engine.scheduler
        assert scheduler.num_preemptions > 0, f"seed={seed}: the small KV pool should have forced preemption"
        assert scheduler.kv.prefix_hit_tokens >= 32, f"seed={seed}: the last prompt should hit the cached prefix"
        scheduler.kv.pool.check_all_free()
        assert not extra or llm.engine.stats().spec_draft_tokens > 0, f"seed={seed}: no drafts were verified"
    assert tokens[True] == tokens[False], f"seed={seed}"
    assert any(n < size for n, size, _ in seen), "some steps should have been padded"
    assert any(0 < decodes < n for n, _, decodes in seen), "some steps should have mixed decodes and prefill"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_pieces_give_the_eager_tokens(tmp_path):
    """On a GPU: the engine's own captured pieces (Triton kernels, chunked mixed steps) give the eager tokens."""
    make_hf_model("qwen3_moe", str(tmp_path), seed=0, vocab_size=VOCAB)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (3, 70, 40, 5, 19)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for sizes in ((), (16, 32, 48)):
        llm = LLM(model=str(tmp_path), dtype="float32", device="cuda", num_kv_blocks=64, max_num_seqs=8,
                  max_num_batched_tokens=48, cuda_graph_token_sizes=sizes)
        tokens[sizes] = [o.token_ids for o in llm.generate(prompts, params)]
        graphs = llm.engine.runner.piecewise_graphs
        assert (graphs is None) == (sizes == ())
        if graphs is not None:
            assert graphs.replays > 0 and sorted(graphs.graphs) == [16, 32, 48] and graphs.capture_s > 0
    assert tokens[()] == tokens[(16, 32, 48)]
