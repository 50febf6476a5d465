"""The KV block pool: fixed-size blocks, ref counts, a free queue (its order is the eviction policy), prefix hashes.

Plain Python, no torch: the pool only hands out block ids; the runner owns the
tensors they index.
"""

import hashlib
from array import array

from engine.core.block import Block
from engine.core.free_queue import make_free_queue

__all__ = ["Block", "BlockPool", "hash_block_tokens"]


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int] | tuple[int, ...], cache_salt: str | None,
                      lora_adapter: str | None = None, images: bytes | None = None) -> bytes:
    """Chained hash of one full block: ``hash(parent_hash, token_ids, cache_salt, lora_adapter, images)``.

    The salt and the adapter enter every block (not only the first) so two salts, or two adapters, never share
    a chain. Each is a typed, length-prefixed part (a tag byte, then its UTF-8 length, then the bytes), so no
    tenant salt can ever produce the bytes of an adapter name, nor a salt+adapter pair those of another pair.
    ``images``: the content digests of the images with placeholder tokens in the block (``PromptImage``), so a
    block of image tokens is keyed by its picture, not by the placeholders alone.
    16-byte BLAKE2b: collisions would serve one request another's KV.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or b"\0" * 16)
    h.update(array("q", token_ids).tobytes())
    for tag, part in ((b"S", cache_salt), (b"L", lora_adapter), (b"I", images)):
        if part is not None:  # None is its own value (absent), distinct from ""
            raw = part if isinstance(part, bytes) else part.encode()
            h.update(tag + len(raw).to_bytes(4, "little") + raw)
    return h.digest()


class BlockPool:
    """Owns every block. Free blocks wait in the free queue (``engine.core.free_queue``: ``eviction_policy``
    orders it); cached ones keep their hash until reused.

    Invariants (asserted where they are enforced):
    - a block is in the free queue iff its ref_count is 0;
    - a hashed block is findable by its hash until it is handed out again.
    """

    def __init__(self, num_blocks: int, enable_caching: bool, eviction_policy: str = "priority") -> None:
        assert num_blocks >= 1
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # The blocks handed out at least once, by id: a block is made on its first use, so a large pool
        # (hundreds of thousands of blocks on a CPU) costs nothing at start. Ids past the list are fresh.
        self.blocks: list[Block] = []
        # Blocks that were used and freed since, in eviction order. Fresh blocks are handed out before any of
        # these, as if they led the queue, so cached blocks are evicted as late as possible.
        self._free = make_free_queue(eviction_policy)
        self._cached: dict[bytes, Block] = {}
        self.num_evictions = 0
        # With prefix-cache tiers: (block id, hash, tenant) of cached blocks evicted since the last step; the
        # runner saves them before the step's forward reuses them. None: evicted blocks are dropped.
        self.evicted: list[tuple[int, bytes, str]] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - len(self.blocks)

    def allocate(self, count: int) -> list[Block]:
        """Take ``count`` blocks: fresh ones first, then the free queue's first; a cached block taken here loses its
        hash."""
        assert count <= self.num_free_blocks, "caller must check num_free_blocks first"
        taken = []
        for _ in range(count):
            if len(self.blocks) < self.num_blocks:
                block = Block(len(self.blocks))
                self.blocks.append(block)
            else:
                block = self._free.pop()
                assert block.ref_count == 0
                if block.block_hash is not None:
                    del self._cached[block.block_hash]
                    if self.evicted is not None:
                        self.evicted.append((block.block_id, block.block_hash, block.tenant))
                    block.block_hash = None
                    self.num_evictions += 1
            block.ref_count = 1
            taken.append(block)
        return taken

    def lookup(self, block_hash: bytes) -> Block | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def acquire(self, blocks: list[Block], priority: int | None = None) -> None:
        """Take a reference on cached blocks (a prefix hit); revives them from the free queue. ``priority``: the
        hitting request's class; a block keeps the most urgent class that used it."""
        for block in blocks:
            if block.ref_count == 0:
                self._free.remove(block)
            block.ref_count += 1
            if priority is not None and priority < block.priority:
                block.priority = priority

    def release(self, blocks: list[Block]) -> None:
        """Drop one reference each. Pass blocks tail-first so the tail of a sequence is evicted first."""
        for block in blocks:
            assert block.ref_count > 0, f"double free of {block}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free.push(block)

    def register(self, block: Block, block_hash: bytes, tenant: str = "", priority: int = 1) -> None:
        """Mark a full, computed block as reusable by hash: ``tenant``'s prefix, computed by a request of class
        ``priority`` (the default is ``RequestPolicy``'s)."""
        assert block.block_hash is None and block.ref_count > 0
        if not self.enable_caching or block_hash in self._cached:
            return  # an identical block is already cached; this one stays private
        block.block_hash = block_hash
        block.tenant = tenant
        block.priority = priority
        self._cached[block_hash] = block

    def check_all_free(self) -> None:
        """Assert that nothing holds a block (tests call this after every request ended)."""
        held = [b for b in self.blocks if b.ref_count]
        assert not held, f"blocks still held: {held[:8]}"
        assert self.num_free_blocks == self.num_blocks
