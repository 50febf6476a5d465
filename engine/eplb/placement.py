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
        replicas, slots = self._tables(slot_experts, num_experts)
        self.replicas = replicas.to(device)  # [E]
        self.slots = slots.to(device)  # [E, M]: the slots of each expert's replicas (padded: its first)
        # [P] tokens each slot received since this placement was installed (read for the balance statistics).
        self.slot_tokens = torch.zeros(len(slot_experts), dtype=torch.int64, device=device)

    @staticmethod
    def _tables(slot_experts: list[int], num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(replicas [E], slots [E, M]) on the host for ``slot_experts``; M = P - E + 1 whatever the placement."""
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
        # M is the most replicas any placement of P slots can give one expert, so that ``update`` refills these
        # same tensors: captured CUDA graphs read them by address.
        width = len(slot_experts) - num_experts + 1
        replicas = torch.tensor(counts, dtype=torch.int64)  # [E]
        slots = torch.tensor([row + [row[0]] * (width - len(row)) for row in table], dtype=torch.int64)  # [E, M]
        return replicas, slots

    def update(self, slot_experts: list[int]) -> None:
        """Install a new placement of the same P slots in place: the device tables keep their storage, so CUDA
        graphs captured with the old placement replay with the new one; the slot counts restart at zero."""
        if len(slot_experts) != len(self.slot_experts):
            raise ValueError(f"a new placement must keep the {len(self.slot_experts)} slots, got {len(slot_experts)}")
        replicas, slots = self._tables(slot_experts, self.replicas.shape[0])
        self.slot_experts = list(slot_experts)
        self.replicas.copy_(replicas)  # between steps, at a rebalance: the copy's host wait is rare
        self.slots.copy_(slots)
        self.slot_tokens.zero_()

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
