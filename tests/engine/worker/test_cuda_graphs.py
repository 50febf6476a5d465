"""Decode CUDA graphs: batch-size buckets, static-buffer padding (CPU), capture and replay (CUDA only)."""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.worker.batch_builder import build_triton_batch  # noqa: E402
from engine.transforms.cuda_graphs import StaticDecodeBuffers, default_batch_sizes, pick_batch_size  # noqa: E402
from tests.engine.kernels.test_triton_attention import make_step  # noqa: E402


def test_default_sizes_cover_every_batch_up_to_max_num_seqs():
    assert default_batch_sizes(1) == (1,)
    assert default_batch_sizes(6) == (1, 2, 4, 6)
    assert default_batch_sizes(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert default_batch_sizes(37)[-2:] == (32, 37)
    for max_num_seqs in (1, 5, 8, 9, 64, 256, 300):
        sizes = default_batch_sizes(max_num_seqs)
        for n in range(1, max_num_seqs + 1):
            size = pick_batch_size(n, sizes)
            # The smallest captured size that fits, by brute force: padding never exceeds the next gap.
            assert size == min(s for s in sizes if s >= n)
        assert pick_batch_size(max_num_seqs + 1, sizes) is None


def test_static_buffers_hold_the_batch_then_inert_padding():
    rng = random.Random(0)
    scheduled = make_step(rng, [(9, 1), (2, 1), (30, 1)], block_size=4, num_blocks=32, shared_prefix=None)
    batch = build_triton_batch(scheduled, 4, None, 1, torch.device("cpu"))
    buffers = StaticDecodeBuffers.allocate(max_batch=8, max_blocks=16, device=torch.device("cpu"))
    buffers.block_table.fill_(-7)  # stale entries from an earlier, wider step
    buffers.seq_lens.fill_(99)
    buffers.load(batch, size=4, scratch_slot=123)
    n = 3
    assert buffers.input_ids[:n].tolist() == [s.request.all_token_ids[-1] for s in scheduled]
    assert buffers.positions[:n].tolist() == [s.request.num_computed_tokens for s in scheduled]
    assert buffers.seq_lens[:4].tolist() == [10, 3, 31, 0]  # the padding row reads no keys
    assert buffers.slot_mapping[3].item() == 123  # ... and writes its K/V to the scratch slot
    assert buffers.input_ids[3].item() == 0 and buffers.positions[3].item() == 0
    for row, item in enumerate(scheduled):
        width = len(item.block_ids)
        assert buffers.block_table[row, :width].tolist() == item.block_ids
        pos = item.request.num_computed_tokens
        assert buffers.slot_mapping[row].item() == item.block_ids[pos // 4] * 4 + pos % 4
    assert buffers.seq_lens[4:].tolist() == [99] * 4  # rows past the padded size are not touched
    meta = buffers.metadata(4, splits=2, sliding_window=0)
    assert meta.num_decodes == 4 and meta.decode_block_table.shape == (4, 16) and meta.num_prefills == 0
    # Views, not copies: a graph captured over them sees every later load.
    assert meta.decode_seq_lens.data_ptr() == buffers.seq_lens.data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])  # gpt-oss: sinks, a sliding cache group
def test_captured_graphs_give_the_eager_tokens(tmp_path, family):
    from engine import LLM, SamplingParams
    from tests.hf_models import make_hf_model

    make_hf_model(family, str(tmp_path), seed=0, vocab_size=97, num_layers=2)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 96) for _ in range(n)] for n in (3, 17, 40, 5, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        llm = LLM(model=str(tmp_path), dtype="float32", device="cuda", enforce_eager=eager, num_kv_blocks=64,
                  max_num_seqs=8, cuda_graph_batch_sizes=(1, 2, 4, 8))
        tokens[eager] = [o.token_ids for o in llm.generate(prompts, params)]
        graphs = llm.engine.runner.decode_graphs
        assert (graphs is None) == eager
        if not eager:
            assert graphs.replays > 0 and sorted(graphs.graphs) == [1, 2, 4, 8]
    assert tokens[True] == tokens[False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_forward_has_no_host_sync(tmp_path):
    """With sync debug mode set to error, a decode and a prefill forward must not sync the host."""
    from engine import LLM, SamplingParams
    from tests.hf_models import make_hf_model

    make_hf_model("qwen3_moe", str(tmp_path), seed=0, vocab_size=97, num_layers=2)
    llm = LLM(model=str(tmp_path), dtype="bfloat16", device="cuda", enforce_eager=True, num_kv_blocks=64)
    engine = llm.engine
    engine.add_request(list(range(1, 30)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    for _ in range(3):  # prefill, then decodes
        plan = engine.scheduler.schedule()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.inference_mode():
                batch = engine.runner.prepare(plan.scheduled)
                engine.runner.forward(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        engine.scheduler.update(plan, [1 if s.sample else None for s in plan.scheduled])
