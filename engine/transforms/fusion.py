"""A transform on a built model: run its elementwise chains as fused Triton kernels.

Like CUDA graphs, this is applied to a model after it is built, not a branch
in the family files: it flips each shared layer to its fused path.

- every RMSNorm: residual add + normalization in one launch;
- attention: per-head q/k norm (if any) + RoPE over the packed projection, in place;
- MoE routing: scores, top-k, renormalization and the expert counters in one launch.
"""

from torch import nn

from engine.layers.attention import Attention
from engine.layers.moe import SparseMoeBlock
from engine.layers.norms import RMSNorm


def enable_triton_elementwise(model: nn.Module) -> int:
    """Switch ``model``'s norms, RoPE and routing to the Triton kernels; returns the number of modules switched."""
    switched = 0
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.fused = True
        elif isinstance(module, Attention):
            # the fused kernel reads one position per token: M-RoPE's three stay on the torch path
            module.fused_rope = module.rotary.fusable
        elif isinstance(module, SparseMoeBlock):
            module.routing_backend = "triton"
        else:
            continue
        switched += 1
    return switched
