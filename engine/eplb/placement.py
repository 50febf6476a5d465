"""One MoE layer's logical-to-physical expert map, and the per-token lookup every MoE backend goes through.

Legend: T tokens, k top-k, E logical experts (the router's), P physical slots (N ranks x S slots each; rank r
holds slots [r*S, (r+1)*S)), M most replicas of an expert.

Under expert parallelism with load balancing, the router still picks logical experts; ``to_physical`` turns
each pick into one slot holding a replica of that expert before the tokens are dispatched, so the dispatch and
the expert kernels (torch, Triton, 8-bit) only ever see slots. A token's replica is chosen by its index in the
step and its expert ((t + e) mod replicas): the replicas of an expert share its tokens evenly, the choice needs
no randomness and no communication (every rank of a replica computes the same for the whole step), and since
replicas hold the same weights the output does not depend on which one a token reaches.
"""

import torch

from engine.eplb.policy import EMPTY


class ExpertPlacement:
    """What each physical slot holds (``slot_experts`` [P], ``EMPTY`` for a spare slot not filled yet) as the
    tables ``to_physical`` reads on the device, and a count of the tokens each slot received."""

    def __init__(self, slot_experts: list[int], num_experts: int, device: torch.device) -> None:
        self.slot_experts = list(slot_experts)
        counts = [0] * num_experts
        for e in slot_experts:
            if e != EMPTY:
                counts[e] += 1
        if min(counts) < 1:
            missing = [e for e, n in enumerate(counts) if n == 0]
            raise ValueError(f"a placement must hold every expert at least once; experts {missing} have no slot")
        table = [[] for _ in range(num_experts)]
        for slot, e in enumerate(slot_experts):
            if e != EMPTY:
                table[e].append(slot)
        width = max(counts)
        self.replicas = torch.tensor(counts, dtype=torch.int64, device=device)  # [E]
        self.slots = torch.tensor([row + [row[0]] * (width - len(row)) for row in table], dtype=torch.int64,
                                  device=device)  # [E, M]: the slots of each expert's replicas (padded: its first)
        # [P] tokens each slot received since this placement was installed (read for the balance statistics).
        self.slot_tokens = torch.zeros(len(slot_experts), dtype=torch.int64, device=device)

    @property
    def num_slots(self) -> int:
        return len(self.slot_experts)

    def to_physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """topk_ids [T, k] logical experts -> [T, k] int32 physical slots, one replica per token and expert;
        counts the slots' tokens."""
        ids = topk_ids.to(torch.int64)  # [T, k]
        token = torch.arange(ids.shape[0], device=ids.device)[:, None]  # [T, 1]
        replica = (token + ids) % self.replicas[ids]  # [T, k]
        slots = self.slots[ids, replica]  # [T, k]
        flat = slots.flatten()
        self.slot_tokens.index_add_(0, flat, torch.ones_like(flat))
        return slots.to(torch.int32)
