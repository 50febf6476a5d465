"""The default layer-chunked encoding budget (``engine.models.encoder_budget``): the tower work worth a quarter of a
``max_num_batched_tokens`` prompt chunk, counted in weight multiply-adds, checked against a count over
transformers' own modules of the same checkpoint; which settings turn it off; 4- and 8-bit experts counted by
their logical shape."""

import random
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from engine.core.config import EngineConfig
from engine.layers.moe import SparseMoeBlock
from engine.llm_engine import LLMEngine
from engine.models.encoder_budget import TOWER_SHARE, attention_per_patch, matrix_multiply_adds
from engine.ranks.rank_builder import encoder_token_blocks
from moe_kernels.quant import QuantScheme
from moe_kernels.routing_spec import RoutingSpec


def _hf_text_multiply_adds(model) -> float:
    """Per token through transformers' decoder layers: every weight matrix, the routed experts' at top_k of E."""
    text = model.config.text_config
    share = text.num_experts_per_tok / text.num_experts
    total = 0.0
    for layer in model.model.language_model.layers:
        for name, p in layer.named_parameters():
            if p.dim() >= 2:
                total += p.numel() * (share if ".experts." in name else 1.0)
    return total


def _engine(path: str, **settings) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=16, **settings))


def test_default_budget_is_a_quarter_chunk_of_text_work(qwen3_vl_checkpoint):
    path, model, seed = qwen3_vl_checkpoint
    tokens = random.Random(seed).randint(8, 4096)
    block = sum(p.numel() for p in model.model.visual.blocks[0].parameters() if p.dim() >= 2)
    want = max(1, round(TOWER_SHARE * tokens * _hf_text_multiply_adds(model) / block))
    engine = _engine(path, max_num_batched_tokens=tokens)
    assert engine.scheduler.config.max_num_encoder_token_blocks == want, f"seed={seed}"
    assert engine.scheduler.encoder_steps is not None


def test_the_scheduler_charges_a_block_its_attention_over_the_image(qwen3_vl_checkpoint):
    """Each patch's query against every key of its image (scores, then weighted values: ``2 x width`` multiply-adds a
    patch of the image), as a share of a block's weight multiply-adds, from transformers' own vision config and
    block."""
    path, model, seed = qwen3_vl_checkpoint
    hf_block = model.model.visual.blocks[0]
    weights = sum(p.numel() for p in hf_block.parameters() if p.dim() >= 2)
    want = 2 * model.config.vision_config.hidden_size / weights
    engine = _engine(path)
    assert attention_per_patch(engine.model.tower_block) == pytest.approx(want, rel=1e-12)
    assert engine.scheduler.encoder_steps.attention_per_patch == pytest.approx(want, rel=1e-12), f"seed={seed}"


@pytest.mark.parametrize("settings, expected", [
    (dict(max_num_encoder_token_blocks=0), None),  # off: whole images
    (dict(max_num_encoder_tokens=8), None),  # the image-token budget asked for alone: whole images
    (dict(max_num_encoder_token_blocks=5, max_num_encoder_tokens=8), 5),
])
def test_settings_that_choose_the_budget(qwen3_vl_checkpoint, settings, expected):
    engine = _engine(qwen3_vl_checkpoint[0], **settings)
    assert engine.scheduler.config.max_num_encoder_token_blocks == expected
    assert (engine.scheduler.encoder_steps is None) == (expected is None)


@pytest.mark.parametrize("method", ["int8", "mxfp4", "int4"])
def test_packed_experts_count_as_their_logical_shape(method):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    experts, top_k, hidden, inner = 8, 2, 64, 32
    block = SparseMoeBlock(hidden, experts, RoutingSpec(top_k=top_k), inner, "torch")
    for p in block.parameters():
        p.data = torch.randn(p.shape, generator=gen)
    want = hidden * experts + experts * 3 * hidden * inner * top_k / experts  # router, then the routed experts
    assert matrix_multiply_adds(block) == want
    block.experts.quantize_(QuantScheme(method))
    assert block.experts.w13.dtype != torch.float32
    assert matrix_multiply_adds(block) == want


@pytest.mark.parametrize("role, chunk_cap", [("both", 0), ("decode", 0), ("decode", 24), ("decode", 5000)])
def test_a_decode_engine_counts_its_budget_from_its_own_prompt_chunks(role, chunk_cap):
    """A decode engine's own prefills take at most ``decode_prefill_chunk_tokens`` a step (so its streams' steps stay
    short): its default tower budget is a quarter of that chunk's work, not of a ``max_num_batched_tokens`` one."""
    rng = random.Random()
    hidden, inner, width = rng.randint(4, 16), rng.randint(4, 16), rng.randint(2, 8)
    text = nn.ModuleList([nn.Linear(hidden, inner), nn.Linear(inner, hidden)])  # 2 * hidden * inner a token
    model = SimpleNamespace(takes_images=True, model=SimpleNamespace(layers=text), tower_block=nn.Linear(width, width))
    config = EngineConfig(model="unused", role=role, max_num_batched_tokens=rng.randint(100, 4000),
                          decode_prefill_chunk_tokens=chunk_cap)
    chunk = min(chunk_cap, config.max_num_batched_tokens) if role == "decode" and chunk_cap else \
        config.max_num_batched_tokens
    want = max(1, round(TOWER_SHARE * chunk * 2 * hidden * inner / (width * width)))
    assert encoder_token_blocks(config, model) == want


def test_each_pass_is_charged_the_attention_it_runs():
    """The scheduler's cost of a block's passes over rows of an image against the multiply-adds they run, counted by
    torch's FLOP counter on the tower's own block (``project`` then ``mix``, as ``engine.vision.tower_rows`` runs
    them): between two images of different sizes, the same rows' projection runs the same work (no attention) and
    their mixing runs ``2 x width`` more per row and patch of difference (every key of the image); the charge
    must differ by that much, in half token-blocks of the block's weights. Fresh random shapes."""
    from torch.utils.flop_counter import FlopCounterMode

    from engine.core.encoder_pieces import EncoderSteps
    from engine.vision.qwen3_vl_tower import VisionBlock, VisionConfig

    seed = random.randrange(2**31)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    heads, head_dim = rng.choice([1, 2, 4]), rng.choice([4, 8])
    width = heads * head_dim
    block = VisionBlock(VisionConfig(depth=2, hidden_size=width, intermediate_size=rng.randint(8, 64),
                                     num_heads=heads, out_hidden_size=8)).eval()
    half_block = matrix_multiply_adds(block) / 2  # multiply-adds of one half token-block
    merge = 4

    def measured(tokens: int, rows: int) -> tuple[float, float]:
        """Multiply-adds of the first ``rows`` rows' projection, then their mixing, over an image of ``tokens``."""
        length = tokens * merge
        x, cos, sin = torch.randn(length, width), torch.randn(length, head_dim), torch.randn(length, head_dim)
        out = []
        with torch.no_grad():
            q, k, v = block.project(x, cos, sin)
            for run in (lambda: block.project(x[:rows], cos[:rows], sin[:rows]),
                        lambda: block.mix(x[:rows], q[:rows], k, v)):
                with FlopCounterMode(display=False) as flops:
                    run()
                out.append(flops.get_total_flops() / 2)
        return out[0], out[1]

    steps = EncoderSteps(1, depth=3, patches_per_token=merge, attention_per_patch=attention_per_patch(block))
    small, large = rng.randint(1, 8), rng.randint(9, 24)
    rows = rng.randint(1, small * merge)

    def charged(tokens: int) -> tuple[float, float]:
        request = SimpleNamespace(images=[SimpleNamespace(num_tokens=tokens)])
        p = tokens * merge
        block_start = 2 * p * rng.randint(1, 2)  # either block of the tower
        return (steps.cost(request, 0, block_start, block_start + rows),
                steps.cost(request, 0, block_start + p, block_start + p + rows))

    (proj_small, mix_small), (proj_large, mix_large) = measured(small, rows), measured(large, rows)
    (c_proj_small, c_mix_small), (c_proj_large, c_mix_large) = charged(small), charged(large)
    assert proj_large - proj_small == 0 and mix_large - mix_small == 2 * width * rows * (large - small) * merge
    assert (c_proj_large - c_proj_small) * half_block == pytest.approx(proj_large - proj_small, abs=1e-6), seed
    assert (c_mix_large - c_mix_small) * half_block == pytest.approx(mix_large - mix_small, rel=1e-9), seed
