"""The offline benchmarks' model and workloads: a random-weight Qwen3-MoE-shaped model (about 37M parameters)
and requests of random token ids, shared by ``loadgen.offline`` and ``loadgen.shared_prefix``."""

import random
from dataclasses import dataclass

import torch

# A Qwen3-MoE layout scaled down to ~37M parameters (16 experts, top-4).
BENCH_MODEL_CONFIG = dict(
    vocab_size=8192, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, intermediate_size=1024,
    norm_topk_prob=True, max_position_embeddings=2048, initializer_range=0.05, eos_token_id=8191,
    bos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
)


@dataclass(slots=True)
class BenchRequest:
    prompt: list[int]
    max_tokens: int


def make_workload(num_requests: int, seed: int, vocab: int, prompt_range=(16, 512), output_range=(8, 256)) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [
        BenchRequest([rng.randrange(1, vocab - 1) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
        for _ in range(num_requests)
    ]


def write_bench_model(path: str, seed: int) -> int:
    """Save the random bench model to ``path``; returns its parameter count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_moe", **BENCH_MODEL_CONFIG)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())
