"""Per-request block tables over the block pool, with prefix-cache lookups (device, then the outer tiers)."""

from typing import Protocol

from engine.core.block_pool import Block, BlockPool, hash_block_tokens
from engine.core.request import Request


class PrefixTiers(Protocol):
    """The prefix-cache tiers below the device pool, as the scheduler sees them (``engine.kv_tiers.store``)."""

    def reserve(self, blocks: list[tuple[int, bytes, str]]) -> list[tuple[int, bytes, str]]: ...

    def lookup(self, block_hashes: list[bytes], tenant: str, may_wait: bool) -> tuple[list[bytes], bool]: ...

    def claim(self, tenant: str, block_hashes: list[bytes]) -> None: ...

    def release(self, block_hashes: list[bytes]) -> None: ...


class KVCacheManager:
    """Maps each running request to its append-only list of blocks.

    ``allocate_slots`` is the only way blocks are added; ``free`` the only way
    they are returned. Full blocks get a chained hash once their KV is written.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, tiers: PrefixTiers | None = None) -> None:
        """``tiers``: host and disk tiers below the pool (None: blocks evicted from the pool are dropped)."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.tiers = tiers if enable_caching else None
        if self.tiers is not None:
            self.pool.evicted = []
        # (block id, hash, tenant) of evicted blocks given host slots, to save, and of blocks to fill from the
        # host tier, both before the next forward.
        self.saves: list[tuple[int, bytes, str]] = []
        self.loads: list[tuple[int, bytes, str]] = []
        self._waited: set[str] = set()  # requests that already waited once for blocks read from disk
        self._blocks: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # hashes of the request's full blocks, in order
        self._num_registered: dict[str, int] = {}  # leading full blocks of the request already registered
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
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs:(i + 1) * bs], request.policy.cache_salt))
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

    def find_tier_prefix(self, request: Request, num_device_hits: int) -> list[Block | bytes] | None:
        """The cached run after the device's leading hits, through the pool and the host tier: per block, the
        pool's block, or the hash of a block the host tier holds (pinned: pass the run to ``allocate_slots`` or
        ``release_tier_hits``). A chain may alternate (the pool evicts a sequence's tail first, but requests
        interleave). None: the request waits a step or more while its blocks are read from disk (once; after
        that it takes what the host has)."""
        if self.tiers is None:
            return []
        self._reserve_evicted()  # blocks evicted earlier in this step are found in the host tier
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        may_wait = request.request_id not in self._waited
        run: list[Block | bytes] = []
        i = num_device_hits
        while i < len(hashes):
            block = self.pool.lookup(hashes[i])
            if block is not None:
                run.append(block)
                i += 1
                continue
            j = i + 1
            while j < len(hashes) and self.pool.lookup(hashes[j]) is None:
                j += 1
            found, wait = self.tiers.lookup(hashes[i:j], request.policy.tenant, may_wait)
            if wait:
                self.release_tier_hits(run)
                self._waited.add(request.request_id)
                return None
            run.extend(found)
            if len(found) < j - i:
                break
            i = j
        return run

    def release_tier_hits(self, tier_hits: list[Block | bytes]) -> None:
        pinned = [h for h in tier_hits if isinstance(h, bytes)]
        if pinned:
            self.tiers.release(pinned)

    def take_transfers(self) -> tuple[list[tuple[int, bytes, str]], list[tuple[int, bytes, str]]]:
        """(blocks to save, blocks to load) since the last call: the runner does both before the step's forward,
        saves first (a block evicted this step may be a load's target)."""
        if self.tiers is None:
            return [], []
        self._reserve_evicted()
        saves, self.saves = self.saves, []
        loads, self.loads = self.loads, []
        return saves, loads

    def _reserve_evicted(self) -> None:
        if self.pool.evicted:
            self.saves.extend(self.tiers.reserve(self.pool.evicted))
            self.pool.evicted = []

    def record_prefix_hit(self, request: Request, num_cached_tokens: int) -> None:
        """Count one admission's prefix lookup (once, however often admission retried)."""
        if self.enable_caching:
            self.prefix_query_tokens += request.num_tokens
            self.prefix_hit_tokens += num_cached_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_prefix: list[Block] | None = None,
                       tier_hits: list[Block | bytes] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens; False (and no change) if the pool is short.

        ``tier_hits``: the cached run after ``cached_prefix`` (``find_tier_prefix``): pool blocks are shared as
        usual; each hash of a host-tier block gets a new block, filled from the host before the next forward
        (``take_transfers``)."""
        held = self._blocks.get(request.request_id, [])
        hits: list[Block | bytes] = list(cached_prefix or []) + list(tier_hits or [])
        assert not (held and hits), "prefix hits only apply to a request with no blocks"
        shared = [b for b in hits if isinstance(b, Block)]
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        # New blocks: the host tier's hits, then the tokens to compute.
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(held) - len(shared)
        # Reviving cached blocks that sit in the free queue also consumes free blocks.
        revived = sum(1 for b in shared if b.ref_count == 0)
        if needed + revived > self.pool.num_free_blocks:
            return False
        if shared:
            self.pool.acquire(shared)
        new_blocks = iter(self.pool.allocate(max(needed, 0)))
        table = list(held)
        loaded = []
        for hit in hits:
            if isinstance(hit, Block):
                table.append(hit)
            else:
                block = next(new_blocks)
                table.append(block)
                self.loads.append((block.block_id, hit, request.policy.tenant))
                loaded.append(hit)
        table.extend(new_blocks)
        self._blocks[request.request_id] = table
        if loaded:
            self.tiers.claim(request.policy.tenant, loaded)
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Register blocks that became full and computed this step, so later requests can share them."""
        if not self.enable_caching:
            return
        blocks = self._blocks[request.request_id]
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        hashes = self._block_hashes(request, num_full)
        # From the first block not looked at in an earlier step (a run of hits may mix shared pool blocks,
        # already registered, with blocks just loaded from the host tier, not yet).
        for i in range(self._num_registered.get(request.request_id, 0), num_full):
            if blocks[i].block_hash is None:
                self.pool.register(blocks[i], hashes[i], request.policy.tenant)
        self._num_registered[request.request_id] = max(num_full, self._num_registered.get(request.request_id, 0))

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
        self._num_registered.pop(request.request_id, None)
        if request.is_finished:
            self._waited.discard(request.request_id)
        self.pool.release(list(reversed(blocks)))
