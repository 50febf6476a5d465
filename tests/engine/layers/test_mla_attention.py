"""MLA over the paged latent cache, in float64: absorbed decode equals expanded decode, and both equal
transformers' DeepseekV3Attention run on the whole sequence (prefill chunks over a cached prefix, shared-prefix
decode groups and YaRN's softmax scale included)."""

import random

import pytest
import torch
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3
from transformers import DeepseekV3Config

from engine.core.scheduler import ScheduledRequest
from engine.layers.rotary import RotaryEmbedding
from engine.core.model_config import model_config_from_hf
from engine.models.deepseek import mla_from_config
from engine.worker.batch_builder import build_batch, decode_groups
from engine.worker.cache_groups import kv_bytes_per_block

SEED = random.randrange(2**31)
BLOCK = 4
FLOAT32_CLOSE = dict(rtol=1e-4, atol=1e-5)


def make_layer(q_lora_rank, rope_interleave: bool):
    hf_config = DeepseekV3Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=24, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=256, rope_interleave=rope_interleave,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.9, mscale_all_dim=0.8,
                             original_max_position_embeddings=64),
    )
    hf_config._attn_implementation = "eager"
    config = model_config_from_hf("DeepseekV3ForCausalLM", hf_config, [])
    ours = mla_from_config(config, RotaryEmbedding(config, config.head_dim, 256)).double()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    ref = hf_v3.DeepseekV3Attention(hf_config, layer_idx=0).double()
    missing, unexpected = ref.load_state_dict(ours.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return ours, ref, hf_v3.DeepseekV3RotaryEmbedding(hf_config).double()


def reference(ref, rope, x: torch.Tensor) -> torch.Tensor:
    """transformers' attention over the whole sequence x [L, H] (causal) -> [L, H]."""
    n = x.shape[0]
    positions = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf"), dtype=x.dtype).triu(1)[None, None]
    return ref(x[None], rope(x[None], positions), mask)[0][0]


def run_step(layer, parts: list[ScheduledRequest], hidden: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """One step of ``parts`` (part i computes rows of ``hidden[i]`` from its ``start``) -> request -> its [n, H] output."""
    batch = build_batch(parts, "torch", BLOCK, None, 1, torch.device("cpu"))
    x = torch.empty(batch.positions.shape[0], hidden[0].shape[1], dtype=torch.float64)
    rows = {}
    flat = 0
    # Flat order: decodes first, in the batch builder's groups, then prefills.
    grouped = [item for group, _ in decode_groups([p for p in parts if p.num_new_tokens == 1], None) for item in group]
    order = [next(i for i, p in enumerate(parts) if p is item) for item in grouped]
    order += [i for i, p in enumerate(parts) if p.num_new_tokens > 1]
    for i in order:
        n = parts[i].num_new_tokens
        x[flat:flat + n] = hidden[i][parts[i].start:parts[i].start + n]
        rows[i] = (flat, flat + n)
        flat += n
    out = layer(x, batch.positions, batch.meta)
    return {i: out[a:b] for i, (a, b) in rows.items()}


@pytest.mark.parametrize("q_lora_rank,interleave", [(16, True), (None, False)])
def test_absorbed_decode_equals_expanded_and_transformers(q_lora_rank, interleave):
    """Both decode forms agree to float64 rounding; with transformers (whose eager softmax runs in float32, as do
    both sides' RMSNorms) to float32 rounding."""
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    ours, ref, rope = make_layer(q_lora_rank, interleave)
    width = ours.cache_spec().per_token[0][0]
    assert width == 24 + 8
    num_blocks = 64
    ours.kv_cache = (torch.zeros(num_blocks + 1, BLOCK, width, dtype=torch.float64),)
    # Requests 0 and 1 share their first 3 blocks (a cached prompt prefix); 2 and 3 have their own.
    lengths = [17, 14, 30, rng.randint(5, 40)]
    blocks = [[0, 1, 2, 3, 4], [0, 1, 2, 5], [*range(6, 14)], [*range(14, 14 + 11)]]
    hidden = [torch.randn(n + 2, 32, dtype=torch.float64) for n in lengths]
    for i in (0, 1):  # the shared prefix's rows must be the same tokens
        hidden[i][:12] = hidden[0][:12]
    expected = [reference(ref, rope, h) for h in hidden]

    # Prefill: request 2 in two chunks (the second over its cached first chunk), the others whole.
    run_step(ours, [ScheduledRequest(None, 9, blocks[2], False, 0, [0] * 9)], [hidden[2]])
    starts = [0, 0, 9, 0]
    got = run_step(ours, [ScheduledRequest(None, lengths[i] - starts[i], blocks[i], True, starts[i],
                                           [0] * (lengths[i] - starts[i])) for i in range(4)], hidden)
    for i in range(4):
        torch.testing.assert_close(got[i], expected[i][lengths[i] - got[i].shape[0]:lengths[i]], **FLOAT32_CLOSE, msg=lambda m: f"request {i}, seed {SEED}: {m}")
    # Decode two tokens each, both forms; the shared-prefix group forms for requests 0 and 1.
    for step in range(2):
        parts = [ScheduledRequest(None, 1, blocks[i], True, lengths[i] + step, [0]) for i in range(4)]
        assert any(g.shared_blocks is not None for g in build_batch(parts, "torch", BLOCK, None, 1, torch.device("cpu")).meta.decode_groups)
        forms = {}
        for form in ("expanded", "absorbed"):
            ours.decode_form = form
            forms[form] = run_step(ours, parts, hidden)
        for i in range(4):
            want = expected[i][lengths[i] + step]
            torch.testing.assert_close(forms["absorbed"][i][0], forms["expanded"][i][0], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(forms["absorbed"][i][0], want, **FLOAT32_CLOSE)


def test_latent_cache_bytes_from_the_spec():
    """A DeepSeek-V3-shaped model's block costs kv_lora_rank + rope_dim values per token per layer (576, not
    128 heads x (192 + 128)), read from the layers' cache specs on the meta device."""
    from engine.loading.random_weights import build_random_model, random_model_config

    config = random_model_config("deepseek-v3:num_hidden_layers=4")
    model = build_random_model(config, torch.bfloat16, torch.device("meta"), "torch", max_positions=16)
    assert kv_bytes_per_block(model, 16, torch.bfloat16) == 16 * 4 * 576 * 2
