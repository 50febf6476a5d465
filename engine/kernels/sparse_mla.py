"""Sparse MLA decode with a Triton kernel: each row's heads attend to the latent rows of its selected tokens only
(DeepSeek Sparse Attention's top-k), read through its block table. A row is a decode request, or one query token of
a prefill chunk (its own positions, its request's block table): the kernel does not care which.

Checked in Triton's CPU interpreter against a float64 reference (``tests/engine/kernels/test_sparse_mla_kernel.py``);
the torch path (``engine.layers.sparse_mla_attention``) serves these models until the kernel has run on a GPU.
Importing this module imports neither the kernel nor ``triton``: TRITON_INTERPRET=1 set later still works.
"""

import functools

import torch

from engine.kernels.attention import _cdiv, interpreted
from engine.kernels.mla_attention import DEFAULT_MLA_LAUNCH, MlaDecodeLaunch, decode_constants


@functools.cache
def _kernels():
    from engine.kernels import sparse_mla_kernels

    return sparse_mla_kernels


def sparse_mla_decode_triton(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
                             positions: torch.Tensor, scale: float, kv_lora_rank: int,
                             launch: MlaDecodeLaunch = DEFAULT_MLA_LAUNCH) -> torch.Tensor:
    """Absorbed MLA decode over selected tokens: out [D, h, R] = softmax(scale * q . rows) @ rows[:, :R] over the
    rows at ``positions``.

    q [D, h, R + P] (q_nope @ W_UK, then the rotated q_pe); latent_cache [N_blocks + 1, bs, R + P] in q's dtype;
    block_table [D, W] int64; positions [D, K] int64 token positions, -1 where a request selected fewer (a request
    with none gets zeros). Only the blocks holding selected positions are read.
    """
    if q.dim() != 3 or latent_cache.dim() != 3 or q.shape[-1] != latent_cache.shape[-1]:
        raise ValueError(f"q must be [D, h, R + P] and latent_cache [blocks, block_size, R + P]; got "
                         f"{tuple(q.shape)} and {tuple(latent_cache.shape)}")
    if positions.dim() != 2 or positions.shape[0] != q.shape[0] or block_table.shape[0] != q.shape[0]:
        raise ValueError(f"positions {tuple(positions.shape)} and block_table {tuple(block_table.shape)} must have "
                         f"one row per query row ({q.shape[0]})")
    if q.is_cuda == interpreted():
        raise RuntimeError("triton sparse MLA needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before "
                           "its kernels are first imported")
    q, latent_cache = q.contiguous(), latent_cache.contiguous()
    block_table, positions = block_table.contiguous(), positions.contiguous()
    num_decodes, num_heads, width = q.shape
    out = torch.empty(num_decodes, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if num_decodes == 0:
        return out
    consts = decode_constants(num_heads, kv_lora_rank, width - kv_lora_rank, latent_cache.shape[1], q.dtype, False,
                              launch, interpreted())
    consts.pop("SPLIT")
    _kernels().sparse_mla_decode_kernel[(_cdiv(num_heads, consts["BLOCK_H"]), num_decodes)](
        q, latent_cache, out, block_table, positions, scale, positions.shape[1],
        q.stride(0), q.stride(1), latent_cache.stride(0), latent_cache.stride(1), out.stride(0), out.stride(1),
        block_table.stride(0), positions.stride(0), **consts, num_warps=launch.num_warps(num_heads),
        num_stages=launch.num_stages,
    )
    return out
