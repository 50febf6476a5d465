"""Compile every Triton MoE launch config a step can pick, before the first request.

Legend: T tokens, H hidden, E experts, k top-k.

Triton compiles a kernel the first time it meets a new launch config; the
MoE backend picks the config by token count (nearest tuned bucket), so the
first prefill of each new size class would stall for seconds while it
compiles. Decode sizes are compiled by the CUDA-graph capture; this covers
the rest, up to ``max_num_batched_tokens``. (Compiled kernels land in
Triton's on-disk cache, so later starts are quick.)
"""

import logging

import torch

import moe_kernels
from engine.layers.moe import SparseMoeBlock
from moe_kernels.launch_config import config_path, device_name, load_config_file, quantization_name

logger = logging.getLogger(__name__)


def warmup_token_counts(buckets: list[int], max_tokens: int) -> list[int]:
    """Token counts that reach every bucket a call of 1..max_tokens tokens can be given.

    A call takes the nearest bucket (ties to the smaller), so a bucket is
    reachable iff some T <= max_tokens is nearest to it; the bucket itself is
    the T to warm with, or max_tokens when the bucket lies beyond it.
    """
    buckets = sorted(set(buckets))
    counts = []
    for i, bucket in enumerate(buckets):
        lowest_reaching = 1 if i == 0 else (buckets[i - 1] + bucket) // 2 + 1
        if lowest_reaching <= max_tokens:
            counts.append(min(bucket, max_tokens))
    return counts


def warm_up_moe(model: torch.nn.Module, max_tokens: int, device: torch.device, dtype: torch.dtype) -> int:
    """Run the routed experts of each distinct MoE layer shape once per reachable bucket; returns calls made."""
    shapes = {}
    for block in model.modules():
        if isinstance(block, SparseMoeBlock) and block.backend != "torch":
            w13 = block.experts.w13
            # The kernels specialize on the activation and on biases too: warm the variant the layer runs.
            shapes.setdefault((tuple(w13.shape), block.top_k, block.activation, w13.dtype), block)
    calls = 0
    for (w13_shape, top_k, _, w13_dtype), block in shapes.items():
        num_experts, two_inter, hidden = w13_shape
        hidden = block.experts.w2.shape[1]  # H: w13's last dim is H/2 bytes when MXFP4
        path = config_path(num_experts, two_inter, hidden, dtype, device_name(device), quantization_name(w13_dtype))
        for num_tokens in warmup_token_counts(list(load_config_file(path)), max_tokens):
            x = torch.randn(num_tokens, hidden, device=device, dtype=dtype)  # [T, H]
            logits = torch.randn(num_tokens, num_experts, device=device)  # [T, E]
            weights, ids = moe_kernels.route(logits, top_k, renormalize=True)  # [T, k]
            moe_kernels.fused_moe(x, block.experts.w13, block.experts.w2, weights, ids, backend="triton",
                                  **block.expert_args())
            calls += 1
    if calls:
        torch.cuda.synchronize(device)
        logger.info("compiled MoE kernels for %d (shape, token bucket) pairs up to %d tokens", calls, max_tokens)
    return calls
