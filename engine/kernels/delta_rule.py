"""The gated delta rule (per head: Gated DeltaNet; per key channel: KDA) over one step's requests in Triton: the
GPU path of ``engine.layers.state_rules.rule_over_requests``, same contract.

Legend: T flat rows (decodes first, one each), D decode requests, P prompt chunks, h heads, dk key dim, dv value
dim, S state slots. Two launches at most: every decode one recurrent step (``delta_rule_decode_kernel``: no host
sync, so a CUDA graph can capture it), then every prompt chunk in the chunked form
(``delta_rule_chunk_kernel``), each program carrying its request's state between BT-token blocks. Both read and
write the state cache at the requests' slots in place, from zero for a request's first token.

Checked in Triton's CPU interpreter against the torch rules and a float64 loop
(``tests/engine/kernels/test_delta_rule_kernels.py``). Importing this module imports neither the kernels nor
``triton``: TRITON_INTERPRET=1 set later still works.
"""

import functools
from dataclasses import dataclass

import torch

from engine.device_batch.state_metadata import StateMetadata
from engine.kernels.attention import _cdiv, _next_pow2, interpreted


@dataclass(frozen=True, slots=True)
class DeltaRuleLaunch:
    """Tile sizes (untuned defaults; ``tl.dot`` needs every tile dim >= 16). ``chunk``: tokens a block of the
    chunked form, per head and per key channel (the latter builds its pairwise decays a column at a time).
    ``precision``: the chunked form's float32 products. "tf32x3" (three TF32 products on the tensor cores, about
    float32's accuracy) rather than "ieee": compiled for sm_90 with dk = dv = 128, the per-head kernel spills
    about 18 KB a thread with "ieee" products, 3 KB with "tf32x3"; plain "tf32" would round every product to 10
    bits, and the state carries those errors to the end of the sequence."""

    chunk_per_head: int = 64
    chunk_per_channel: int = 32
    block_v: int = 32
    num_warps: int = 4
    precision: str = "tf32x3"

    def __post_init__(self) -> None:
        if self.precision not in ("ieee", "tf32x3", "tf32"):
            raise ValueError(f"precision must be ieee, tf32x3 or tf32, got {self.precision!r}")
        for name in ("chunk_per_head", "chunk_per_channel", "block_v"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")


DEFAULT_DELTA_LAUNCH = DeltaRuleLaunch()


@functools.cache
def _kernels():
    from engine.kernels import delta_rule_kernels

    return delta_rule_kernels


def _inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      rec_cache: torch.Tensor, states: StateMetadata,
                      launch: DeltaRuleLaunch = DEFAULT_DELTA_LAUNCH) -> torch.Tensor:
    """q, k [T, hk, dk] (q scaled, both L2-normalised as the layers hand them; value head j reads key head
    j // (h / hk), read in place rather than repeated), v [T, h, dv], g [T, h] (per head) or [T, h, dk] (per key
    channel) log decays <= 0, beta [T, h]; ``rec_cache`` [S, h, dk, dv] float32, contiguous, updated in place at
    the requests' slots -> out [T, h, dv] float32."""
    if q.is_cuda == interpreted():
        raise RuntimeError("the Triton delta rule needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set "
                           f"before its kernels are first imported (q is on {q.device})")
    if rec_cache.dtype != torch.float32 or not rec_cache.is_contiguous():
        raise ValueError(f"the state cache must be contiguous float32, got {rec_cache.dtype}")
    per_channel = g.dim() == 3
    q, k, v, g, beta = (_inner_contiguous(t) for t in (q, k, v, g, beta))
    if k.stride() != q.stride():  # the kernels read both through q's strides
        q, k = q.contiguous(), k.contiguous()
    num_tokens, num_key_heads, dk = q.shape
    num_heads, dv = v.shape[1:]
    if num_heads % num_key_heads:
        raise ValueError(f"value heads ({num_heads}) must be a multiple of key heads ({num_key_heads})")
    out = torch.empty(num_tokens, num_heads, dv, dtype=torch.float32, device=q.device)  # [T, h, dv]
    block_k = max(16, _next_pow2(dk))
    block_v = min(launch.block_v, max(16, _next_pow2(dv)))
    strides = (q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1), beta.stride(0),
               out.stride(0), out.stride(1), rec_cache.stride(0), rec_cache.stride(1), rec_cache.stride(2))
    consts = dict(DK=dk, DV=dv, BK=block_k, BV=block_v, PER_CHANNEL=per_channel, GROUP=num_heads // num_key_heads,
                  num_warps=launch.num_warps)
    kernels = _kernels()
    d = states.num_decodes
    if d:
        kernels.delta_rule_decode_kernel[(d, num_heads, _cdiv(dv, block_v))](
            q, k, v, g, beta, out, rec_cache, states.decode_slots, states.decode_fresh, *strides, **consts)
    if states.prefills:
        chunks = states.prefill_chunks
        if chunks is None:  # metadata built by hand: the same rows, copied here
            chunks = torch.tensor([[r, e, s, int(f)] for r, e, s, f in states.prefills], dtype=torch.int64,
                                  device=q.device)
        # Blocks no longer than the longest chunk (a power of two >= 16): a step's short chunks skip the padding.
        longest = max(end - row for row, end, _, _ in states.prefills)
        block_t = min(launch.chunk_per_channel if per_channel else launch.chunk_per_head, max(16, _next_pow2(longest)))
        kernels.delta_rule_chunk_kernel[(len(states.prefills), num_heads, _cdiv(dv, block_v))](
            q, k, v, g, beta, out, rec_cache, chunks, *strides, BT=block_t, PRECISION=launch.precision, **consts)
    return out
