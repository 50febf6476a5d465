"""Tiny random checkpoints of every family, built and saved with transformers (the reference)."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

# Each family in a few shapes: GQA and MHA, top-k 1..4, 4..16 experts, odd sizes.
FAMILY_CONFIGS = {
    "mixtral": dict(
        model_type="mixtral", hidden_size=48, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=8, num_experts_per_tok=2,
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe", hidden_size=40, intermediate_size=56, num_attention_heads=5, num_key_value_heads=5,
        num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=36,
        decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe", hidden_size=64, intermediate_size=48, num_attention_heads=4, num_key_value_heads=1,
        head_dim=24, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=20, norm_topk_prob=True,
    ),
    "olmoe": dict(
        model_type="olmoe", hidden_size=36, intermediate_size=28, num_attention_heads=3, num_key_value_heads=3,
        num_experts=4, num_experts_per_tok=1, clip_qkv=None,
    ),
    # Sliding layers (even) with a window of 8, so prompts go far past it; a clamp limit the random gate/up
    # values reach; YaRN rope as published (factor 32 over 4096 original positions).
    "gpt_oss": dict(
        model_type="gpt_oss", hidden_size=64, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8, swiglu_limit=0.4,
    ),
}
# Families whose init leaves parameters constant (gpt-oss: zero expert and attention biases, unit norms):
# those are drawn at random too, so a bias or norm the engine forgot changes the tokens.
RANDOMIZE_CONSTANT = {"gpt_oss"}


@torch.no_grad()
def randomize_constant_parameters(model, std: float) -> None:
    """Redraw every parameter that holds one value (zeros, ones): biases around 0, norm weights around 1."""
    for param in model.parameters():
        flat = param.reshape(-1)
        if flat.numel() and bool((flat == flat[0]).all()):
            param.copy_(flat[0] + torch.randn_like(param) * std)


def make_hf_model(family: str, path: str, seed: int, vocab_size: int = 211, num_layers: int = 2, **overrides):
    """Build a random model of ``family``, save it to ``path``, return the transformers model (eval, float32)."""
    kw = {**FAMILY_CONFIGS[family], "initializer_range": 0.08, **overrides}
    model_type = kw.pop("model_type")
    config = AutoConfig.for_model(
        model_type, vocab_size=vocab_size, num_hidden_layers=num_layers, max_position_embeddings=1024,
        eos_token_id=vocab_size - 1, bos_token_id=None, pad_token_id=0, **kw,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if family in RANDOMIZE_CONSTANT:
        randomize_constant_parameters(model, kw["initializer_range"])
    model.save_pretrained(path)
    return model
