"""``ExpertActivation`` in Triton: the one gated activation both expert kernel families (grouped GEMM, gemv) apply."""

import triton
import triton.language as tl


@triton.jit
def gated_act(gate, up, ACTIVATION: tl.constexpr, alpha, limit):
    """act(gate) * up on float32 tiles of the same shape; ACTIVATION is an ``ExpertActivation.kind``."""
    if ACTIVATION == "silu":
        out = gate * tl.sigmoid(gate) * up
    elif ACTIVATION == "gelu":  # exact (erf) gelu, as torch.nn.functional.gelu's default
        out = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)) * up
    elif ACTIVATION == "clamped_silu":  # Step-3.7-Flash: the clamp follows the silu
        u = tl.minimum(tl.maximum(up, -limit), limit)
        out = tl.minimum(gate * tl.sigmoid(gate), limit) * u
    else:  # clamped_swiglu (gpt-oss)
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        out = g * tl.sigmoid(g * alpha) * (u + 1.0)
    return out
