"""Per-request block tables over the block pool, with prefix-cache lookups (device, then the outer tiers).

A model whose layers all attend to the whole context has one cache group: one block table per request. A model
that mixes full-attention layers with sliding-window layers of equal number (gpt-oss) has two: group 0 (the
full layers) and group 1 (the sliding layers, window W). Both groups draw blocks from the one pool (a block is
one block of K/V for as many layers as a group has, see ``engine.worker.cache_groups``), and each request has a
table per group. In the sliding group, a block that lies wholly before ``computed - W`` can never be read again:
it is handed back to the pool and its table entry points at the null block (the runner's scratch block, which
the attention masks never let a query see), so the table keeps its shape and positions.

The prefix-cache tiers below the pool (host memory, disk) hold every group's blocks, each under its group's key
(``_key``), so a hit from the tiers follows the same rule as one from the pool: the full group's blocks of the
whole prefix, a sliding group's only for the window of the first token left to compute.
"""

from dataclasses import dataclass, field
from typing import Protocol

from engine.core.block_pool import Block, BlockPool, hash_block_tokens
from engine.core.prompt_images import image_key
from engine.core.request import Request


class PrefixTiers(Protocol):
    """The prefix-cache tiers below the device pool, as the scheduler sees them (``engine.kv_tiers.store``)."""

    def reserve(self, blocks: list[tuple[int, bytes, str]]) -> list[tuple[int, bytes, str]]: ...

    def lookup(self, block_hashes: list[bytes], tenant: str, may_wait: bool) -> tuple[list[bytes], bool]: ...

    def claim(self, tenant: str, block_hashes: list[bytes]) -> None: ...

    def release(self, block_hashes: list[bytes]) -> None: ...


def group_key(block_hash: bytes, group: int) -> bytes:
    """The prefix-cache key of ``group``'s block of these tokens: each group caches its own blocks of the same
    tokens; group 0 keeps the plain hash."""
    return block_hash if group == 0 else bytes([group]) + block_hash


def first_live_block(num_computed: int, window: int | None, block_size: int) -> int:
    """Index of the first block a request's next queries can read in a group with ``window`` (None: full).

    The next query sits at position ``num_computed`` or later and sees keys after ``position - window``; every
    block ending at or before ``num_computed - window`` is out of reach for good."""
    if window is None:
        return 0
    return max(0, (num_computed - window) // block_size)


def sliding_blocks_bound(window: int, block_size: int, num_new_tokens: int) -> int:
    """Most blocks one request holds in a sliding group while a step computes ``num_new_tokens`` of its tokens:
    those after ``first_live_block`` up to the step's last token (``ceil(W / block_size) + 1`` for a decode)."""
    return -(-(window + num_new_tokens) // block_size) + 1


@dataclass(slots=True)
class CachedPrefix:
    """A prefix-cache hit: ``num_blocks`` leading full blocks, with each group's blocks for them: a pool block
    (shared), the hash of a block the host tier holds (pinned there; copied into a new block before the forward
    that needs it), or None where a sliding group needs none (out of the window of the first token left to
    compute; Nones lead a group's list)."""

    num_blocks: int = 0
    groups: list[list[Block | bytes | None]] = field(default_factory=list)


class KVCacheManager:
    """Maps each running request to one append-only block table per cache group.

    ``allocate_slots`` is the only way blocks are added; ``free``, ``trim`` and a sliding group's window the
    only ways they are returned. Full blocks get a chained hash once their KV is written.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, sliding_window: int | None = None,
                 tiers: PrefixTiers | None = None, eviction_policy: str = "priority") -> None:
        """``sliding_window``: the window of the second cache group's layers (None: one group, every layer full).
        ``tiers``: host and disk tiers below the pool (None: blocks evicted from the pool are dropped).
        ``eviction_policy``: which cached blocks the pool evicts first (``engine.core.free_queue``)."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching, eviction_policy)
        self.enable_caching = enable_caching
        self.tiers = tiers if enable_caching else None
        if self.tiers is not None:
            self.pool.evicted = []
        # (block id, hash, tenant) of evicted blocks given host slots, to save, and of blocks to fill from the
        # host tier, both before the next forward.
        self.saves: list[tuple[int, bytes, str]] = []
        self.loads: list[tuple[int, bytes, str]] = []
        self._waited: set[str] = set()  # requests that already waited once for blocks read from disk
        self._num_registered: dict[str, int] = {}  # leading full blocks of the request already registered
        # The window of each group: None for full attention. Group 0 is always the full group.
        self.windows: tuple[int | None, ...] = (None,) if sliding_window is None else (None, sliding_window)
        # Where a released block's table entry points: the runner's scratch block (never handed out).
        self.null_block_id = num_blocks
        self._tables: dict[str, list[list[Block | None]]] = {}  # request -> one table per group
        # request -> per group, how many leading entries are released (None): they always lead the table
        self._released: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # hashes of the request's full blocks, in order
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        # Most blocks one request held at once in each group (the sliding group's stays bounded by its window).
        self.peak_request_blocks = [0] * len(self.windows)
        self.tier_loads_by_group = [0] * len(self.windows)  # blocks each group's hits took from the host tier

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def _ids(self, table: list[Block | None]) -> list[int]:
        null = self.null_block_id
        return [null if b is None else b.block_id for b in table]

    def block_ids(self, request_id: str) -> list[int]:
        """The request's table in group 0 (every layer's table when there is one group)."""
        tables = self._tables.get(request_id)
        return [b.block_id for b in tables[0]] if tables else []

    def window_block_ids(self, request_id: str) -> list[int]:
        """The request's table in the sliding group, the null block where blocks left the window; [] with one
        group. As long as group 0's table: position p is in entry p // block_size of either."""
        tables = self._tables.get(request_id)
        return self._ids(tables[1]) if tables and len(tables) > 1 else []

    def blocks_held(self, request_id: str) -> list[int]:
        """Blocks the request holds in each group (its share of the pool)."""
        tables = self._tables.get(request_id)
        if not tables:
            return [0] * len(self.windows)
        return [len(table) - released for table, released in zip(tables, self._released[request_id])]

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            images = image_key(request.images, i * bs, (i + 1) * bs) if request.images else None
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs:(i + 1) * bs],
                                            request.policy.cache_salt, request.policy.lora_adapter, images))
        return hashes

    def prefix_key(self, request: Request, num_blocks: int) -> bytes:
        """The prefix-cache key of the request's first ``num_blocks`` full blocks (their tokens must be known)."""
        return self._block_hashes(request, num_blocks)[num_blocks - 1]

    @staticmethod
    def _key(block_hash: bytes, group: int) -> bytes:
        return group_key(block_hash, group)

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """Longest run of cached full blocks matching the request's tokens, in every group.

        The last token is always left to compute so the step has its logits. In a sliding group only the
        blocks the first token left to compute can see must be cached (blocks further back may be gone), so
        the hit is the longest run of the full group's blocks whose window is whole in every sliding group.
        """
        if not self.enable_caching:
            return CachedPrefix()
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        full: list[Block] = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            full.append(block)
        n = len(full)
        while True:  # n only shrinks: a hit ends at or before the last block found missing
            groups: list[list[Block | None]] = [full[:n]]
            for g, window in enumerate(self.windows[1:], start=1):
                first = first_live_block(n * self.block_size, window, self.block_size)
                live = [self.pool.lookup(self._key(h, g)) for h in hashes[first:n]]
                missing = [i for i, b in enumerate(live) if b is None]
                if missing:
                    n = first + missing[-1]  # a hit must end at or before the last missing block
                    break
                groups.append([None] * first + live)
            else:
                return CachedPrefix(n, groups)

    def record_prefix_hit(self, request: Request, num_cached_tokens: int) -> None:
        """Count one admission's prefix lookup (once, however often admission retried)."""
        if self.enable_caching:
            self.prefix_query_tokens += request.num_tokens
            self.prefix_hit_tokens += num_cached_tokens

    def find_tier_prefix(self, request: Request, cached: CachedPrefix) -> CachedPrefix | None:
        """``cached`` (the pool's hit) extended through the pool and the host tier: the full group's run of blocks
        after the pool's leading hits (a chain may alternate between pool and host: the pool evicts a sequence's
        tail first, but requests interleave), shortened until every sliding group has its window's blocks. The
        host blocks of the result are pinned: pass it to ``allocate_slots`` or ``release_tier_hits``. None: the
        request waits a step or more while its blocks are read from disk (once; after that it takes what the
        host has)."""
        if self.tiers is None:
            return cached
        self._reserve_evicted()  # blocks evicted earlier in this step are found in the host tier
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        may_wait = request.request_id not in self._waited
        n0 = cached.num_blocks
        run, wait = self._tier_run(hashes, 0, n0, len(hashes), request.policy.tenant, may_wait)
        if wait:  # while the full group's blocks are read, so are the sliding groups' for the whole prefix's window
            for g, window in enumerate(self.windows[1:], start=1):
                first = max(first_live_block(len(hashes) * self.block_size, window, self.block_size), n0)
                found, _ = self.tiers.lookup([self._key(h, g) for h in hashes[first:]], request.policy.tenant, True)
                self.tiers.release(found)
            return self._wait_for_disk(request)
        n = n0 + len(run)
        base = [list(g) for g in cached.groups] or [[] for _ in self.windows]
        while n > n0:
            groups = [base[0] + run[:n - n0]]
            for g, window in enumerate(self.windows[1:], start=1):
                first = first_live_block(n * self.block_size, window, self.block_size)
                kept = base[g][first:n0] if first < n0 else []  # the pool hit's window blocks still needed
                start = max(first, n0)
                found, wait = self._tier_run(hashes, g, start, n, request.policy.tenant, may_wait)
                if wait:  # unpin what this lookup holds: the full group's run up to n, the sliding groups' so far
                    self.release_tier_hits(CachedPrefix(n, groups))
                    return self._wait_for_disk(request)
                if len(found) < n - start:  # a hit must end at or before the first block missing here
                    shorter = start + len(found)
                    self.release_tier_hits(CachedPrefix(0, groups[1:] + [found, run[shorter - n0:n - n0]]))
                    n = shorter
                    break
                groups.append([None] * first + kept + found)
            else:
                return CachedPrefix(n, groups)
        return cached  # (every host block of the full group's run was unpinned as n shrank to n0)

    def _tier_run(self, hashes: list[bytes], group: int, start: int, end: int, tenant: str,
                  may_wait: bool) -> tuple[list[Block | bytes], bool]:
        """Group ``group``'s blocks ``start..end-1`` as far as they are cached: per block, the pool's block, or the
        key of a block the host tier holds (pinned); stops at the first missing. True: wait (read from disk)."""
        run: list[Block | bytes] = []
        i = start
        while i < end:
            block = self.pool.lookup(self._key(hashes[i], group))
            if block is not None:
                run.append(block)
                i += 1
                continue
            j = i + 1
            while j < end and self.pool.lookup(self._key(hashes[j], group)) is None:
                j += 1
            found, wait = self.tiers.lookup([self._key(h, group) for h in hashes[i:j]], tenant, may_wait)
            if wait:
                self.release_tier_hits(CachedPrefix(0, [run]))
                return [], True
            run.extend(found)
            if len(found) < j - i:
                break
            i = j
        return run, False

    def _wait_for_disk(self, request: Request) -> None:
        self._waited.add(request.request_id)
        return None

    def release_tier_hits(self, prefix: CachedPrefix) -> None:
        """Unpin the host-tier blocks of a prefix that was not admitted after all."""
        pinned = [h for group in prefix.groups for h in group if isinstance(h, bytes)]
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

    def _release_out_of_window(self, request: Request, tables: list[list[Block | None]]) -> None:
        # Sliding groups: blocks the next queries cannot see go back to the pool (tail-first, like ``free``).
        released = self._released[request.request_id]
        for g, window in enumerate(self.windows[1:], start=1):
            table = tables[g]
            first = min(first_live_block(request.num_computed_tokens, window, self.block_size), len(table))
            if first > released[g]:
                gone = table[released[g]:first]
                self._register_released(request, g, released[g], gone)
                table[released[g]:first] = [None] * len(gone)
                released[g] = first
                self.pool.release(list(reversed(gone)))

    def _register_released(self, request: Request, group: int, start: int, gone: list[Block]) -> None:
        # With overlapped steps the computed count already covers the step in flight, whose blocks are registered
        # only when its tokens are read (``cache_computed_blocks`` at ``resolve``): a block the window passes
        # before then would go back to the pool unhashed, and the next prompt sharing the prefix would find no
        # window to hit. So it is registered here. Its tokens are all known (the one token still on the device is
        # the request's last, past the window) and its K/V is written by the step in flight, which runs on the
        # device before any step that could read the block as a hit.
        if not self.enable_caching:
            return
        hashes = self._block_hashes(request, start + len(gone))
        for i, block in enumerate(gone, start=start):
            if block.block_hash is None:
                self.pool.register(block, self._key(hashes[i], group), request.policy.tenant,
                                   request.policy.priority)

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_prefix: CachedPrefix | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens in every group; False (and no new block) if the pool is
        short. A sliding group first hands back the blocks its window has passed, so it holds at most
        ``ceil(W / block_size) + 1`` blocks plus those of the new tokens.

        ``cached_prefix`` (``find_cached_prefix``, extended by ``find_tier_prefix``): its pool blocks are shared;
        each host-tier block gets a new block, filled from the host before the next forward (``take_transfers``)."""
        tables = self._tables.get(request.request_id)
        hit = cached_prefix or CachedPrefix()
        assert not (tables and hit.num_blocks), "prefix hits only apply to a request with no blocks"
        if tables is not None:
            self._release_out_of_window(request, tables)
        held = tables or [[] for _ in self.windows]
        prefix = hit.groups or [[] for _ in self.windows]
        num_computed = request.num_computed_tokens + hit.num_blocks * self.block_size
        total_blocks = -(-(num_computed + num_new_tokens) // self.block_size)
        # New blocks per group: past what it holds and its hit, plus one per host-tier block of its hit.
        needed = [max(total_blocks - len(h) - len(p), 0) + sum(isinstance(b, bytes) for b in p)
                  for h, p in zip(held, prefix)]
        # Every group's hits are taken before any block is allocated: a hit may sit in the free queue, and
        # reviving it there also consumes a free block.
        hits = [b for blocks in prefix for b in blocks if isinstance(b, Block)]
        revived = sum(1 for b in hits if b.ref_count == 0)
        if sum(needed) + revived > self.pool.num_free_blocks:
            return False
        if hits:
            self.pool.acquire(hits, request.policy.priority)
        if tables is None:  # a hit's sliding tables lead with the blocks its window has passed
            tables = self._tables[request.request_id] = [[] for _ in self.windows]
            self._released[request.request_id] = [sum(b is None for b in p) for p in prefix]
        released = self._released[request.request_id]
        loaded = []
        for g, (table, p, n) in enumerate(zip(tables, prefix, needed)):
            new_blocks = iter(self.pool.allocate(n))
            for entry in p:
                if isinstance(entry, bytes):
                    block = next(new_blocks)
                    table.append(block)
                    self.loads.append((block.block_id, entry, request.policy.tenant))
                    loaded.append(entry)
                    self.tier_loads_by_group[g] += 1
                else:
                    table.append(entry)
            table.extend(new_blocks)
            self.peak_request_blocks[g] = max(self.peak_request_blocks[g], len(table) - released[g])
        if loaded:
            self.tiers.claim(request.policy.tenant, loaded)
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Register blocks that became full and computed this step, so later requests can share them."""
        if not self.enable_caching:
            return
        tables = self._tables[request.request_id]
        num_full = min(request.num_computed_tokens // self.block_size, len(tables[0]))
        hashes = self._block_hashes(request, num_full)
        # From the first block not looked at in an earlier step (a run of hits may mix shared pool blocks,
        # already registered, with blocks just loaded from the host tier, not yet; released entries are None).
        start = self._num_registered.get(request.request_id, 0)
        for g, blocks in enumerate(tables):
            for i in range(start, num_full):
                block = blocks[i]
                if block is not None and block.block_hash is None:
                    self.pool.register(block, self._key(hashes[i], g), request.policy.tenant,
                                       request.policy.priority)
        self._num_registered[request.request_id] = max(num_full, start)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Return the request's blocks past the first ``num_tokens`` tokens' (speculative decoding's rejected
        drafts). Those blocks hold no computed full block, so none of them is in the prefix cache."""
        tables = self._tables.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        for blocks in tables or ():
            if len(blocks) > keep:
                extra = [b for b in blocks[keep:] if b is not None]
                del blocks[keep:]
                assert all(b.block_hash is None for b in extra), "a block past the verified tokens was cached"
                self.pool.release(list(reversed(extra)))

    def free(self, request: Request) -> None:
        """Return every block of the request; full blocks stay cached until evicted."""
        tables = self._tables.pop(request.request_id, [])
        self._released.pop(request.request_id, None)
        self._hashes.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        if request.is_finished:
            self._waited.discard(request.request_id)
        for blocks in reversed(tables):
            self.pool.release([b for b in reversed(blocks) if b is not None])
