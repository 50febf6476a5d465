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
    # DeepSeek-V2-Lite's shape: no q LoRA, softmax greedy routing, a dense first layer, two shared experts.
    "deepseek_v2": dict(
        model_type="deepseek_v2", hidden_size=64, intermediate_size=48, num_attention_heads=4, q_lora_rank=None,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=20, n_shared_experts=2, first_k_dense_replace=1,
        topk_method="greedy", routed_scaling_factor=1.0,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3", hidden_size=64, intermediate_size=48, num_attention_heads=4, q_lora_rank=24,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=20, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    ),
}

# Families whose norms and routing buffers are drawn at random too (their init leaves them at 1 and 0).
RANDOM_NORMS_AND_BUFFERS = {"deepseek_v2", "deepseek_v3"}


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
    if family in RANDOM_NORMS_AND_BUFFERS:
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith("norm.weight"):
                    tensor.copy_(1 + 0.3 * torch.randn_like(tensor))
                elif name.endswith("e_score_correction_bias"):
                    tensor.copy_(0.1 * torch.randn_like(tensor))
    model.save_pretrained(path)
    return model
