"""The tiers together: what the scheduler asks (which blocks of a prefix the tiers hold) and what the runner
does between steps (save blocks leaving the device pool, load hits back).

Flow of one block:
- it leaves the device pool (evicted from the pool's free queue to be reused): the scheduler reserves a host
  slot for it at once (``reserve``: a lookup in the same step finds it there), the step that reuses it first
  saves it into that slot (``save``), then the disk writer thread writes it to a file (write-through from
  host, so the disk tier holds everything the host tier got and survives a restart);
- a prefix lookup (``lookup``) continues past the device's hits into host; a block found only on disk is read
  into a host slot by the reader thread, and the request waits for it (``lookup`` says wait; the scheduler
  admits it at a later step), while every other request keeps stepping;
- an admitted request's host hits are pinned (never evicted) until the runner copies them into its new device
  blocks, before the forward of the step that admitted it (``load``).

Thread safety: the scheduler and the runner call from the engine's thread (on the CPU with overlapped steps,
``save``/``load`` run on the step worker); the writer and reader threads touch the host index under ``lock``.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.kv_tiers.block_copier import BlockCopier
from engine.kv_tiers.counters import TierCounters
from engine.kv_tiers.disk_tier import DiskTier
from engine.kv_tiers.host_tier import HostTier
from engine.kv_tiers.keys import tier_key

# A lookup reads at most this share of the host tier's slots from disk for one request (so promotions of a
# long prefix cannot evict each other before the request is admitted).
PROMOTE_SHARE = 0.5


class TieredStore:
    """Host (and optionally disk) tiers over one engine's KV caches."""

    def __init__(self, copier: BlockCopier, fingerprint: bytes, host_bytes: int, disk_dir: str | None = None,
                 disk_bytes: int = 0, deployment: str | None = None, eviction_policy: str = "lru") -> None:
        """``deployment``: whose files the disk tier's directory may hold (``EngineConfig.deployment_id``).
        ``eviction_policy``: ``EngineConfig.kv_eviction_policy``, for both tiers (``LruIndex``)."""
        self.copier = copier
        self.fingerprint = fingerprint
        self.block_bytes = copier.block_bytes
        # tenant -> its priority class, from its requests' policies: both tiers' indexes read it (one dict)
        self.classes: dict[str, int] = {}
        self.host = HostTier(host_bytes, self.block_bytes, copier.device.type == "cuda", eviction_policy, self.classes)
        self.disk = DiskTier(disk_dir, disk_bytes, self.block_bytes, deployment, eviction_policy,
                             self.classes) if disk_dir else None
        self.lock = threading.RLock()
        self.counters = TierCounters()
        self.shares: dict[str, float] = {}  # tenant -> share of each tier (absent: shared LRU)
        self._promoting: set[bytes] = set()  # keys being read from disk into host slots
        # (copy event, keys) of saves and loads whose slots are pinned until their copies are done (CUDA).
        self._copying: list[tuple[object | None, list[bytes]]] = []
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="moegate-tier-write") if self.disk else None
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="moegate-tier-read") if self.disk else None

    def key(self, block_hash: bytes) -> bytes:
        return tier_key(self.fingerprint, block_hash)

    # ---- the scheduler's side (plain data in, plain data out) ---------------
    def set_share(self, tenant: str, share: float | None, priority: int | None = None) -> None:
        """The tenant's share of each tier (0 < share <= 1) from its policy; None: shared LRU. ``priority``: its
        priority class, which blocks it stores from now on carry (None: unchanged)."""
        with self.lock:
            if priority is not None:
                self.classes[tenant] = priority
            if share is None:
                self.shares.pop(tenant, None)
            else:
                self.shares[tenant] = share

    def lookup(self, block_hashes: list[bytes], tenant: str, may_wait: bool) -> tuple[list[bytes], bool]:
        """The leading run of ``block_hashes`` the host tier holds, pinned for loading (``claim`` or ``release``
        them), and whether the request should wait: the run continues on blocks being read from disk (a read
        is started here only with ``may_wait``). Waiting pins nothing."""
        with self.lock:
            self._retire_copies()
            found: list[bytes] = []
            for block_hash in block_hashes:
                key = self.key(block_hash)
                if key in self._promoting:  # a read started for this request (or another): wait for it
                    self._unpin(found)
                    return [], True
                slot = self.host.slot_of(key)
                if slot is None:
                    self.counters.add("host", tenant, "misses")
                    if self.disk is not None and may_wait and self._promote(block_hashes[len(found):], tenant):
                        self._unpin(found)
                        return [], True
                    if self.disk is not None:
                        self.counters.add("disk", tenant, "misses")
                    break
                self.host.index.get(key).pins += 1
                found.append(block_hash)
            return found, False

    def claim(self, tenant: str, block_hashes: list[bytes]) -> None:
        """Count the hits of an admitted request (the runner unpins them once loaded)."""
        with self.lock:
            self.counters.add("host", tenant, "hits", len(block_hashes))

    def release(self, block_hashes: list[bytes]) -> None:
        """Unpin hits of a request that was not admitted after all."""
        with self.lock:
            self._unpin(block_hashes)

    def _unpin(self, block_hashes: list[bytes]) -> None:
        self._unpin_keys([self.key(h) for h in block_hashes])

    def _unpin_keys(self, keys: list[bytes]) -> None:
        for key in keys:
            self.host.index.get(key, touch=False).pins -= 1

    def _promote(self, block_hashes: list[bytes], tenant: str) -> bool:
        """Start reading the leading run of ``block_hashes`` that is on disk into host slots; False if the first
        is not on disk."""
        limit = max(1, int(self.host.num_slots * PROMOTE_SHARE))
        keys = []
        for block_hash in block_hashes[:limit]:
            key = self.key(block_hash)
            if key in self.host.index or key in self._promoting or not self.disk.contains(key):
                break
            keys.append(key)
        if not keys:
            return False
        self._promoting.update(keys)
        self._reader.submit(self._read_from_disk, keys, tenant)
        return True

    def _read_from_disk(self, keys: list[bytes], tenant: str) -> None:
        """Reader thread: each block from its file into a host slot, in chain order, stopping at the first that is
        missing or corrupt (a corrupt file is deleted by ``DiskTier.read``)."""
        try:
            for i, key in enumerate(keys):
                got = self.disk.read(key)
                if got is None:
                    with self.lock:
                        self.counters.add("disk", tenant, "misses")
                    break
                owner, payload = got
                with self.lock:
                    slot, evicted = self.host.reserve(key, owner, self.shares.get(owner))
                    self._count_evictions("host", evicted)
                    if slot is None:
                        break
                    self.host.slab[slot].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
                    self.counters.add("disk", owner, "hits")
                    self.counters.add("disk", owner, "bytes_out", len(payload))
                    self.counters.add("host", owner, "bytes_in", len(payload))
                    self._promoting.discard(key)
        finally:
            with self.lock:
                self._promoting.difference_update(keys)

    # ---- the runner's side (between steps, before the forward) --------------
    def reserve(self, blocks: list[tuple[int, bytes, str]]) -> list[tuple[int, bytes, str]]:
        """Host slots for (block id, block hash, tenant) leaving the device pool, taken when the scheduler evicts
        them: from then on a lookup finds them in the host tier (the runner saves their bytes before it loads
        anything). Returns the blocks to ``save``, each pinned until then; blocks the host already holds (they
        were loaded from there) or cannot take (full of pinned blocks, or past the tenant's share) are left out."""
        reserved = []
        with self.lock:
            for block_id, block_hash, tenant in blocks:
                key = self.key(block_hash)
                if self.host.slot_of(key) is not None or key in self._promoting:
                    continue
                slot, evicted = self.host.reserve(key, tenant, self.shares.get(tenant))
                self._count_evictions("host", evicted)
                if slot is None:
                    continue
                self.host.index.get(key).pins += 1  # until its bytes are copied (``save``)
                reserved.append((block_id, block_hash, tenant))
        return reserved

    def save(self, blocks: list[tuple[int, bytes, str]]) -> list[tuple[int, int]]:
        """Copy reserved blocks (``reserve``) from the device into their host slots, then unpin them once the
        copies are done; with a disk tier, queue each for the writer thread (write-through). Returns the
        (block id, host slot) pairs copied, for the engine's other ranks (``TierCopies``)."""
        pairs, written, saved, slots = [], [], [], []
        with self.lock:
            for block_id, block_hash, tenant in blocks:
                key = self.key(block_hash)
                slot = self.host.slot_of(key, touch=False)
                slots.append((block_id, slot))
                pairs.append((block_id, self.host.slab[slot]))
                saved.append(key)
                self.counters.add("host", tenant, "bytes_in", self.block_bytes)
                if self._writer is not None and not self.disk.contains(key):
                    written.append((key, tenant, slot))
                    if self.copier.stream is not None:  # CUDA: pinned until the writer has read the slot
                        self.host.index.get(key).pins += 1
        done = self.copier.save(pairs)
        with self.lock:
            self._copying.append((done, saved))
            self._retire_copies()
        for key, tenant, slot in written:
            if done is None:  # the CPU copied already: the writer gets the bytes, the slot stays free to reuse
                self._writer.submit(self._write_to_disk, key, tenant, self.host.slab[slot].numpy().tobytes())
            else:  # CUDA: the writer reads the slot once the copy's event is done
                self._writer.submit(self._write_to_disk, key, tenant, (slot, done))
        return slots

    def _write_to_disk(self, key: bytes, tenant: str, payload) -> None:
        if not isinstance(payload, bytes):
            slot, done = payload
            done.synchronize()
            payload = self.host.slab[slot].numpy().tobytes()
            with self.lock:
                self.host.index.get(key, touch=False).pins -= 1
        with self.lock:
            share = self.shares.get(tenant)
        written = self.disk.write(key, tenant, payload, share)
        with self.lock:
            if written.stored:
                self.counters.add("disk", tenant, "bytes_in", len(payload))
            if written.failed:
                self.counters.add("disk", tenant, "write_errors")
            self._count_evictions("disk", written.evicted)

    def load(self, blocks: list[tuple[int, bytes, str]]) -> list[tuple[int, int]]:
        """Copy pinned host hits (block id, block hash, tenant) into their new device blocks, then unpin them.
        Returns the (host slot, block id) pairs copied, for the engine's other ranks (``TierCopies``)."""
        with self.lock:
            pairs, slots = [], []
            for block_id, block_hash, tenant in blocks:
                slot = self.host.slot_of(self.key(block_hash))
                slots.append((slot, block_id))
                pairs.append((self.host.slab[slot], block_id))
                self.counters.add("host", tenant, "bytes_out", self.block_bytes)
            done = self.copier.load(pairs)
            # The rows stay pinned until the copies have read them (at once on the CPU).
            self._copying.append((done, [self.key(h) for _, h, _ in blocks]))
            self._retire_copies()
        return slots

    def _retire_copies(self) -> None:
        still = []
        for done, keys in self._copying:
            if done is None or done.query():
                self._unpin_keys(keys)
            else:
                still.append((done, keys))
        self._copying = still

    def _count_evictions(self, tier: str, evicted: list) -> None:
        for _, entry in evicted:
            self.counters.add(tier, entry.tenant, "evictions")

    def flush(self) -> None:
        """Wait for the disk writes queued so far (tests; engine shutdown)."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._reader.shutdown(wait=True)
            self.disk.close()
