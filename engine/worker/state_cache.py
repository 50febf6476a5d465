"""The state cache of hybrid models: each linear-attention layer's fixed-size states, one per slot.

A slot is one running request's (``engine.core.state_slots`` hands them out); its tensors hold the short
convolution's last inputs and the delta rule's state matrix (``StateSpec``), whatever the request's length.
Rows past the slots hold the prefix cache's state checkpoints (``engine.core.state_checkpoints``), copied to
and from slots by ``copy_states``. Both come out of the KV cache's memory budget
(``model_setup.kv_blocks_for_memory``).
"""

import torch

from engine.core.scheduler import ScheduledRequest
from engine.device_batch.state_metadata import StateMetadata, build_state_metadata
from engine.models import MoECausalLM
from engine.worker.kv_memory import zeros_on_first_touch


def linear_layers(model: MoECausalLM) -> list:
    """The model's linear-attention layers (none for a model of full attention only)."""
    return model.linear_layers() if hasattr(model, "linear_layers") else []


def state_bytes_per_slot(model: MoECausalLM, dtype: torch.dtype) -> int:
    """Bytes one request's states take over this rank's linear-attention layers (0: none)."""
    return sum(layer.state_spec().bytes_per_slot(dtype) for layer in linear_layers(model))


def attach_state_caches(model: MoECausalLM, num_slots: int, device: torch.device, dtype: torch.dtype) -> None:
    """Allocate each linear layer's (conv [S, C, K - 1], recurrent [S, h, dk, dv]) and give them to it. Unwritten
    slots are never read: a request's first chunk starts from zero (``StateMetadata``)."""

    def empty(shape: tuple[int, ...], state_dtype: torch.dtype) -> torch.Tensor:
        if device.type == "cpu":  # memory taken as slots are first written
            return zeros_on_first_touch(shape, state_dtype)
        return torch.empty(shape, dtype=state_dtype, device=device)

    for layer in linear_layers(model):
        spec = layer.state_spec()
        layer.state_cache = (empty((num_slots, *spec.conv), dtype), empty((num_slots, *spec.recurrent), spec.recurrent_dtype))


def copy_states(model: MoECausalLM, copies: list[tuple[int, int]], device: torch.device) -> None:
    """Copy rows of every linear layer's state tensors, (from row, to row) each (``StateCheckpoints``' loads and
    saves; no two copies write the same row)."""
    if not copies:
        return
    src = torch.tensor([a for a, _ in copies], dtype=torch.int64).to(device, non_blocking=True)  # [N]
    dst = torch.tensor([b for _, b in copies], dtype=torch.int64).to(device, non_blocking=True)  # [N]
    for layer in linear_layers(model):
        for cache in layer.state_cache:  # [S + C, ...] each
            cache.index_copy_(0, dst, cache.index_select(0, src))


def step_states(scheduled: list[ScheduledRequest], ranges: tuple[tuple[int, int], ...],
                device: torch.device) -> StateMetadata:
    """The step's ``StateMetadata`` from its scheduled parts and their flat row ranges (``FlatBatch``)."""
    return build_state_metadata([(row, end, s.state_slot, s.start) for s, (row, end) in zip(scheduled, ranges)], device)
