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
    # Hybrid linear attention: a Gated DeltaNet layer then a gated full-attention one (their 3:1 plan cut to two
    # layers), 4 value heads over 2 key heads, partial RoPE, routed experts and a sigmoid-gated shared expert.
    "qwen3_next": dict(
        model_type="qwen3_next", hidden_size=64, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True,
        layer_types=["linear_attention", "full_attention"],
    ),
    # Qwen3.5-MoE's text model: the same plan, its linear layers' projections kept apart, every MLP sparse.
    "qwen3_5_moe": dict(
        model_type="qwen3_5_moe_text", hidden_size=48, num_attention_heads=2, num_key_value_heads=1, head_dim=24,
        linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=12, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=20,
        shared_expert_intermediate_size=28, layer_types=["linear_attention", "full_attention"],
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
    # MLA with q LoRA, grouped sigmoid routing with a correction bias, scaled and renormalised, a shared expert.
    "deepseek_v3": dict(
        model_type="deepseek_v3", hidden_size=64, intermediate_size=48, num_attention_heads=4, q_lora_rank=24,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=20, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    ),
    # Partial rotary (half of each head), qkv bias, per-head q/k norm, grouped sigmoid routing with a
    # correction bias, scaled and renormalised, a shared expert, one dense first layer.
    "glm4_moe": dict(
        model_type="glm4_moe", hidden_size=64, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
        n_group=2, topk_group=1, routed_scaling_factor=1.7, norm_topk_prob=True, first_k_dense_replace=1,
        attention_bias=True, use_qk_norm=True,
    ),
    # Per-head q/k norm, q/k/v and o_proj biases, 4 groups of 2 experts (2 kept), not renormalised, 2 shared.
    "dots1": dict(
        model_type="dots1", hidden_size=64, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, n_shared_experts=2,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=False, first_k_dense_replace=1,
        attention_bias=True, sliding_window=None,
    ),
    # q/k norm over the whole projections, partial rotary (rotary_dim 8 of 16), sigmoid + correction bias.
    "minimax_m2": dict(
        model_type="minimax_m2", hidden_size=64, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rotary_dim=8, num_local_experts=8, num_experts_per_tok=2,
    ),
    # Sliding layers (even) with a window of 8, so prompts go far past it; a clamp limit the random gate/up
    # values reach.
    "gpt_oss": dict(
        model_type="gpt_oss", hidden_size=64, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8, swiglu_limit=0.4,
    ),
    # Layers full, sliding, sliding (window 8, below every long prompt), the sliding ones with twice the KV heads
    # (2 against 1) and sinks; q/k heads of 24 (8 of them rotated, each kind at its own theta) over v heads of 8;
    # values scaled; a dense first layer, then grouped bias-corrected sigmoid routing, renormalised and scaled.
    "mimo_v2_flash": dict(
        model_type="mimo_v2_flash", hidden_size=64, intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=1, head_dim=24, v_head_dim=8, attention_value_scale=0.6, sliding_window=8,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=20, n_group=2, topk_group=1, routed_scaling_factor=1.7, norm_topk_prob=True,
        rope_parameters={"full_attention": dict(rope_type="default", rope_theta=50000.0, partial_rotary_factor=0.334),
                         "sliding_attention": dict(rope_type="default", rope_theta=500.0, partial_rotary_factor=0.334)},
    ),
    # GQA with per-head q/k norm and q/k/v/o biases; a dense first layer, then top-k of bias-corrected sigmoid
    # scores, renormalised and scaled, beside one ungated shared expert.
    "hy_v3": dict(
        model_type="hy_v3", hidden_size=64, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=20, num_shared_experts=1,
        router_scaling_factor=2.3, attention_bias=True,
    ),
}


@torch.no_grad()
def randomize_constants_(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Draw every parameter and persistent buffer that init left constant (norm weights at 1, biases and
    routing correction biases at 0) at random around its init value, so a test cannot pass by leaving one out."""
    persistent = set(model.state_dict())
    tensors = [(n, p) for n, p in model.named_parameters()]
    tensors += [(n, b) for n, b in model.named_buffers() if n in persistent and b.is_floating_point()]
    for _, t in tensors:
        if t.numel() > 1 and bool((t == t.flatten()[0]).all()):
            noise = torch.randn(t.shape, generator=generator, dtype=torch.float32)
            t.copy_(t + (0.2 if float(t.flatten()[0]) else 0.1) * noise)


def tiny_text_config(vocab_size: int = 211, num_layers: int = 2, **settings) -> dict:
    """A tiny checkpoint's text settings: ``vocab_size`` ids, the last one EOS, no BOS, pad 0, 1024 positions,
    ``num_layers`` layers, init std 0.08; ``settings`` add to or override them."""
    return {"vocab_size": vocab_size, "num_hidden_layers": num_layers, "max_position_embeddings": 1024,
            "eos_token_id": vocab_size - 1, "bos_token_id": None, "pad_token_id": 0, "initializer_range": 0.08,
            **settings}


def save_random_image_text_model(config, path: str, seed: int):
    """transformers' image-text model of ``config`` (``AutoModelForImageTextToText``) with every parameter and buffer
    random (torch seeded with ``seed``; the constants init leaves drawn by ``randomize_constants_``), saved to
    ``path``; returns it (eval, float32)."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    randomize_constants_(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(path)
    return model


def make_hf_image_text_model(family: str, path: str, seed: int, vocab_size: int = 211, num_layers: int = 2,
                             text: dict | None = None, vision: dict | None = None, **whole):
    """``family``'s text model inside its published image-text wrapper (Qwen3.5-MoE's
    ``Qwen3_5MoeForConditionalGeneration``: the language model under ``model.language_model.``, a tiny vision
    tower under ``model.visual.``, the config's ``text_config``), saved to ``path``; returns it (eval, float32).
    The text model rotates a quarter of each head (6 of 24 dims) under interleaved M-RoPE sections 1, 1, 1;
    ``text``, ``vision`` and ``whole`` add to or override the text, vision and whole configs."""
    settings = dict(FAMILY_CONFIGS[family])
    settings.pop("model_type")
    settings["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                       mrope_section=[1, 1, 1], mrope_interleaved=True)
    settings.update(text or {})
    config = AutoConfig.for_model(
        family, text_config=tiny_text_config(vocab_size, num_layers, **settings),
        vision_config={**dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2,
                              out_hidden_size=settings["hidden_size"], patch_size=4, num_position_embeddings=16),
                       **(vision or {})},
        **whole,
    )
    return save_random_image_text_model(config, path, seed)


def make_hf_model(family: str, path: str, seed: int, vocab_size: int = 211, num_layers: int | None = None,
                  **overrides):
    """Build a random model of ``family``, save it to ``path``, return the transformers model (eval, float32).
    ``num_layers``: by default as many as the config's ``layer_types`` lists, else 2."""
    kw = {**FAMILY_CONFIGS[family], **overrides}
    num_layers = num_layers or len(kw.get("layer_types") or ()) or 2
    model_type = kw.pop("model_type")
    config = AutoConfig.for_model(model_type, **tiny_text_config(vocab_size, num_layers, **kw))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_constants_(model, torch.Generator().manual_seed(seed))
    if model_type == "gpt_oss":
        # Older transformers (5.17 among them) hard-code the experts' clamp (alpha 1.702, limit 7.0) and ignore
        # the config's: save the values the reference computes with, so the engine reads the same ones.
        experts = model.model.layers[0].mlp.experts
        model.config.swiglu_limit, model.config.swiglu_alpha = float(experts.limit), float(experts.alpha)
    model.save_pretrained(path)
    return model
