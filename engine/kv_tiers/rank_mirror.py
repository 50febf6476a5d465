"""A follower rank's share of the host tier: its slice of every block the tier holds, in the same slots as rank 0's.

Rank 0's ``TieredStore`` alone decides which block goes to which slot and when a slot is free again (its LRU,
shares and pins); a follower only copies as told (``TierCopies``, sent ahead of the step's plan). Its copies are
ordered on its own device, so a slot reused by a later message is written after an earlier message read it:
saves run on the copier's side stream after the main stream's queued work, loads on the main stream after the
side stream's saves.
"""

import torch

from engine.core.tier_copies import TierCopies
from engine.kv_tiers.block_copier import BlockCopier


class RankMirror:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, ...]], device: torch.device, host_bytes: int) -> None:
        self.copier = BlockCopier(kv_caches, device)
        num_slots = host_bytes // self.copier.block_bytes  # the same count as rank 0's (same block bytes per rank)
        # slab [num_slots, block_bytes] uint8; torch.empty takes no resident memory until slots are written.
        self.slab = torch.empty((max(num_slots, 1), self.copier.block_bytes), dtype=torch.uint8,
                                pin_memory=device.type == "cuda")

    def apply(self, copies: TierCopies) -> None:
        """Copy this rank's slices: saves (device -> slot) first, then loads (slot -> device)."""
        self.copier.save([(block_id, self.slab[slot]) for block_id, slot in copies.saves])
        if copies.loads:
            if self.copier.stream is not None:  # a load may read a slot this message's saves just wrote
                torch.cuda.current_stream(self.copier.device).wait_stream(self.copier.stream)
            self.copier.load([(self.slab[slot], block_id) for slot, block_id in copies.loads])
