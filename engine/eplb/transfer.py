"""Moving one layer's expert weights to a new placement: the copies every rank computes alike, then each rank's
part of them over ``torch.distributed`` point to point, into staging buffers first.

Legend: P physical slots, N ranks, S slots per rank (rank r holds slots [r*S, (r+1)*S)).

A slot whose expert changes is filled from a slot of the same rank holding that expert if there is one (a local
copy), else from a rank holding it, the one that has sent least so far. Each rank receives its new slots'
weights (every parameter of ``ExpertWeights``: the 8-bit weights with their scales, biases) into staging tensors
and copies them into place only once all its sends and receives of the layer are done: the old weights it sends
are never overwritten before they have left, and no slot is ever half written when the forward next runs.
"""

from dataclasses import dataclass

import torch
from torch import nn

from engine.distributed.collectives import TensorParallel
from engine.eplb.policy import EMPTY


@dataclass(frozen=True, slots=True)
class SlotCopy:
    src: int  # physical slot read (old placement)
    dst: int  # physical slot written (new placement)


def plan_copies(old: list[int], new: list[int], slots_per_rank: int) -> list[SlotCopy]:
    """The copies that turn placement ``old`` [P] into ``new`` [P], the same list on every rank."""
    sent: dict[int, int] = {}  # rank -> copies it sends to other ranks so far
    copies = []
    for dst, expert in enumerate(new):
        if expert == EMPTY or old[dst] == expert:
            continue
        rank = dst // slots_per_rank
        local = [q for q in range(rank * slots_per_rank, (rank + 1) * slots_per_rank) if old[q] == expert]
        if local:
            copies.append(SlotCopy(local[0], dst))
            continue
        holders = [q for q, e in enumerate(old) if e == expert]
        if not holders:
            raise ValueError(f"expert {expert} is in no slot of the old placement")
        src = min(holders, key=lambda q: (sent.get(q // slots_per_rank, 0), q))
        sent[src // slots_per_rank] = sent.get(src // slots_per_rank, 0) + 1
        copies.append(SlotCopy(src, dst))
    return copies


def expert_tensors(experts: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The per-slot tensors of ``ExpertWeights`` (each [S, ...]): weights, and scales and biases where present."""
    return [(name, p) for name, p in experts.named_parameters(recurse=False) if p is not None]


def slot_bytes(experts: nn.Module) -> int:
    """Bytes one slot's tensors take."""
    return sum(p[0].numel() * p.element_size() for _, p in expert_tensors(experts))


@torch.no_grad()
def move_layer(experts: nn.Module, copies: list[SlotCopy], tp: TensorParallel, slots_per_rank: int) -> int:
    """Apply ``copies`` to this rank's slots of one layer (``experts``: its ``ExpertWeights``, [S, ...] each);
    every rank of ``tp`` calls it with the same list. Returns the bytes this rank received from others."""
    me, first = tp.rank, tp.rank * slots_per_rank
    tensors = [p for _, p in expert_tensors(experts)]
    incoming = [c for c in copies if c.dst // slots_per_rank == me]
    staging = [p.new_empty((len(incoming), *p.shape[1:])) for p in tensors]  # [copies into this rank, ...] each
    sends, recvs, tag, received = [], [], 0, 0
    row = 0
    for c in copies:
        src_rank, dst_rank = c.src // slots_per_rank, c.dst // slots_per_rank
        if dst_rank == me and src_rank == me:
            for stage, p in zip(staging, tensors):
                stage[row].copy_(p[c.src - first])
        for i, p in enumerate(tensors):
            if src_rank == dst_rank:
                break
            if src_rank == me:
                sends.append((p[c.src - first], dst_rank, tag))
            elif dst_rank == me:
                recvs.append((staging[i][row], src_rank, tag))
                received += p[0].numel() * p.element_size()
            tag += 1
        if dst_rank == me:
            row += 1
    tp.send_recv(sends, recvs, "moving expert weights between ranks")
    if incoming:
        index = torch.tensor([c.dst - first for c in incoming], dtype=torch.int64, device=tensors[0].device)
        for stage, p in zip(staging, tensors):
            p.index_copy_(0, index, stage)
    return received
