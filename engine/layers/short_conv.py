"""The short causal convolution of linear-attention layers, carried across prefill chunks and decode steps.

Legend: T scheduled tokens, D decode requests, C channels, K taps, S state slots. Each channel is convolved with
its own K taps over the request's inputs (depthwise), then SiLU; the last K - 1 inputs of each request are kept
in the state cache at its slot (``StateMetadata``), so the next chunk or decode token continues from them.
"""

import torch
import torch.nn.functional as F

from engine.device_batch.state_metadata import StateMetadata


def causal_short_conv(mixed: torch.Tensor, weight: torch.Tensor, conv_cache: torch.Tensor,
                      states: StateMetadata) -> torch.Tensor:
    """mixed [T, C] (decode rows first), weight [C, K], conv_cache [S, C, K - 1] (updated in place) -> SiLU of the
    causal depthwise convolution [T, C]; a request's first chunk starts from zeros."""
    channels, kernel = weight.shape
    out = torch.empty_like(mixed)
    d = states.num_decodes
    if d:
        slots = states.decode_slots
        past = conv_cache[slots].masked_fill(states.decode_fresh[:, None, None], 0.0)  # [D, C, K - 1]
        window = torch.cat([past, mixed[:d, :, None]], dim=-1)  # [D, C, K]
        out[:d] = F.silu((window * weight).sum(-1))
        conv_cache[slots] = window[:, :, 1:]
    for row, end, slot, fresh in states.prefills:
        past = conv_cache.new_zeros(channels, kernel - 1) if fresh else conv_cache[slot]
        seq = torch.cat([past, mixed[row:end].t()], dim=-1)  # [C, K - 1 + L]
        out[row:end] = F.silu(F.conv1d(seq[None], weight[:, None, :], groups=channels)[0]).t()
        conv_cache[slot] = seq[:, seq.shape[1] - (kernel - 1):]
    return out
