"""An approximate per-replica index of the prompt blocks each replica was sent (no torch, no I/O).

The engine shares KV blocks by a chained hash of each full block's tokens,
salted per tenant (``engine.core.block_pool.hash_block_tokens``), a block that
holds image placeholder tokens keyed by those images' digests too. The router
hashes a prompt the same way (an image's digest here is of its encoded file, the
engine's of its pixels: the router compares only with what it sent) and
remembers, per replica, the hashes of the prompts it sent there, as SGLang's cache-aware router and llm-d's prefix
scorer do. The index is approximate on purpose: it never asks the engine what
it holds. It forgets a replica's oldest blocks once it holds as many as that
replica's KV pool and host prefix-cache tier together (the engine evicts least
recently used blocks too, from the pool to the host tier, then from the host
tier), and everything when the replica restarts (its disk tier may remember more:
a hit the index does not predict is a bonus). A wrong guess costs a prefill, never a
wrong answer: the engine checks its own cache.
"""

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.block_pool import hash_block_tokens
from engine.core.prompt_images import image_key, placeholder_runs
from engine.core.stats import SchedulerStats


def remembered_blocks(stats: SchedulerStats) -> int:
    """How many blocks a replica may still hold, as it reports: its KV pool's and its host tier's."""
    return stats.kv_blocks_total + stats.host_tier_blocks


@dataclass(frozen=True, slots=True)
class RoutedImage:
    """One image of a prompt as the router keys it: its placeholder tokens [offset, end) and its file's digest."""

    offset: int
    end: int
    digest: bytes


def routed_images(prompt: Sequence[int], image_token_id: int | None,
                  images: Sequence[bytes]) -> tuple[RoutedImage, ...]:
    """The prompt's images (encoded files, one per run of ``image_token_id``, in order), each over its run.
    Where the runs do not pair with the images (or the token is unknown: None), the engine refuses the request;
    each image then spans the whole prompt, so no block of it looks like another prompt's."""
    digests = [hashlib.blake2b(bytes(data), digest_size=16).digest() for data in images]
    runs = placeholder_runs(prompt, image_token_id) if image_token_id is not None else []
    if len(runs) != len(digests):
        return tuple(RoutedImage(0, len(prompt), d) for d in digests)
    return tuple(RoutedImage(start, start + length, d) for (start, length), d in zip(runs, digests))


def block_hashes(prompt: Sequence[int], block_size: int, cache_salt: str | None,
                 lora_adapter: str | None = None, images: Sequence[RoutedImage] = ()) -> list[bytes]:
    """The chained, salted hashes of the prompt's full blocks (under adapter ``lora_adapter``; a block holding
    placeholder tokens of ``images`` keyed by their digests), as the engine computes them for the base model
    (under an adapter the engine's also hold its directory; the router compares these with what it sent, never
    with the engine's)."""
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(prompt) - block_size + 1, block_size):
        end = start + block_size
        parent = hash_block_tokens(parent, prompt[start:end], cache_salt, lora_adapter,
                                   image_key(images, start, end) if images else None)
        hashes.append(parent)
    return hashes


class ReplicaBlocks:
    """One replica's remembered block hashes, least recently sent first, at most ``capacity``.

    ``roots`` counts the distinct first blocks held: how many prompt families (a tenant's system
    prompt, say) the replica holds. The router gives a new family to the replica with the fewest, so
    families split evenly; the block count would not do, since every prompt's unique tail fills it too.
    """

    __slots__ = ("capacity", "_blocks", "roots")

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity  # None until the replica reports its pool size
        self._blocks: OrderedDict[bytes, bool] = OrderedDict()  # hash -> is a first block
        self.roots = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def matched(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt this replica was sent (and has not forgotten)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def add(self, hashes: Sequence[bytes]) -> None:
        """Remember a prompt sent here; its blocks become the most recently used."""
        blocks = self._blocks
        if hashes and hashes[0] not in blocks:
            self.roots += 1
        for i, h in enumerate(hashes):
            blocks[h] = i == 0  # a chained hash is a first block wherever it appears
            blocks.move_to_end(h)
        if self.capacity is not None:
            while len(blocks) > self.capacity:
                self.roots -= blocks.popitem(last=False)[1]

    def clear(self) -> None:
        self._blocks.clear()
        self.roots = 0
