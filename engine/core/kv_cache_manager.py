"""Per-request block tables over the block pool, with prefix-cache lookups."""

from engine.core.block_pool import Block, BlockPool, hash_block_tokens
from engine.core.request import Request


class KVCacheManager:
    """Maps each running request to its append-only list of blocks.

    ``allocate_slots`` is the only way blocks are added; ``free`` the only way
    they are returned. Full blocks get a chained hash once their KV is written.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self._blocks: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # hashes of the request's full blocks, in order
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs:(i + 1) * bs], request.policy.cache_salt,
                                            request.policy.lora_adapter))
        return hashes

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """Longest run of cached full blocks matching the request's tokens.

        The last token is always left to compute so the step has its logits.
        """
        if not self.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for block_hash in self._block_hashes(request, max_blocks):
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_hit(self, request: Request, num_cached_tokens: int) -> None:
        """Count one admission's prefix lookup (once, however often admission retried)."""
        if self.enable_caching:
            self.prefix_query_tokens += request.num_tokens
            self.prefix_hit_tokens += num_cached_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_prefix: list[Block] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens; False (and no change) if the pool is short."""
        held = self._blocks.get(request.request_id, [])
        cached_prefix = cached_prefix or []
        assert not (held and cached_prefix), "prefix hits only apply to a request with no blocks"
        num_computed = request.num_computed_tokens + len(cached_prefix) * self.block_size
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(held) - len(cached_prefix)
        # Reviving cached blocks that sit in the free queue also consumes free blocks.
        revived = sum(1 for b in cached_prefix if b.ref_count == 0)
        if needed + revived > self.pool.num_free_blocks:
            return False
        if cached_prefix:
            self.pool.acquire(cached_prefix)
        new_blocks = self.pool.allocate(max(needed, 0))
        self._blocks[request.request_id] = held + cached_prefix + new_blocks
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Register blocks that became full and computed this step, so later requests can share them."""
        if not self.enable_caching:
            return
        blocks = self._blocks[request.request_id]
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        hashes = self._block_hashes(request, num_full)
        for i in range(num_full - 1, -1, -1):
            if blocks[i].block_hash is not None:
                break  # everything before it was registered in an earlier step
            if i < len(hashes):
                self.pool.register(blocks[i], hashes[i])

    def trim(self, request: Request, num_tokens: int) -> None:
        """Return the request's blocks past the first ``num_tokens`` tokens' (speculative decoding's rejected
        drafts). Those blocks hold no computed full block, so none of them is in the prefix cache."""
        blocks = self._blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks is not None and len(blocks) > keep:
            extra = blocks[keep:]
            del blocks[keep:]
            assert all(b.block_hash is None for b in extra), "a block past the verified tokens was cached"
            self.pool.release(list(reversed(extra)))

    def free(self, request: Request) -> None:
        """Return every block of the request; full blocks stay cached until evicted."""
        blocks = self._blocks.pop(request.request_id, [])
        self._hashes.pop(request.request_id, None)
        self.pool.release(list(reversed(blocks)))
