"""The host-tier copies of one step, as plain data for an engine's other tensor-parallel ranks.

Rank 0 keeps the prefix-cache tiers' index (which block hash sits in which host slot); every rank holds its own
slice of each block in a host slab with the same slots. Before a step's plan, rank 0 sends its ranks the slot
numbers its tiers chose, so each copies its slice of the same blocks to and from the same slots, in the same
order (saves first: a block just saved may be a load's source).
"""

import msgspec


class TierCopies(msgspec.Struct, frozen=True, tag=True):
    """A message on the ranks' channel (``engine.worker.rank_messages``). ``saves``: (device block id, host
    slot) to copy down; ``loads``: (host slot, device block id) to copy up."""

    saves: tuple[tuple[int, int], ...]
    loads: tuple[tuple[int, int], ...]
