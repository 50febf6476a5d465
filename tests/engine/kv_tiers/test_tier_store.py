"""The tiers' own contracts on real cache tensors: bytes round-trip, capacity, per-tenant shares, disk files."""

import os
import random

import torch

from engine.kv_tiers.block_copier import BlockCopier
from engine.kv_tiers.store import TieredStore

BLOCKS, BLOCK_SIZE = 40, 4


def _caches(gen):
    # Two layers: standard (K, V) [blocks + 1, block_size, kv_heads 2, head_dim 3] and an MLA latent [.., 5].
    return [(torch.randn(BLOCKS + 1, BLOCK_SIZE, 2, 3, generator=gen), torch.randn(BLOCKS + 1, BLOCK_SIZE, 2, 3, generator=gen)),
            (torch.randn(BLOCKS + 1, BLOCK_SIZE, 5, generator=gen, dtype=torch.float64),)]


def _block(caches, block_id):
    return [t[block_id].clone() for layer in caches for t in layer]


def test_round_trip_capacity_and_shares(tmp_path):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    caches = _caches(gen)
    copier = BlockCopier(caches, torch.device("cpu"))
    assert copier.block_bytes == BLOCK_SIZE * (2 * 6 * 4 + 5 * 8)
    slots = 10
    store = TieredStore(copier, b"f" * 16, slots * copier.block_bytes + 7)
    hashes = [bytes([i]) * 16 for i in range(BLOCKS)]
    originals = {i: _block(caches, i) for i in range(BLOCKS)}
    store.set_share("flood", 0.3)  # at most 3 of the 10 slots
    # "calm" saves 6 blocks, then "flood" saves 20: it may only ever push out its own.
    store.save(store.reserve([(i, hashes[i], "calm") for i in range(6)]))
    for i in range(6, 26):
        store.save(store.reserve([(i, hashes[i], "flood")]))
        assert store.host.index.used <= store.host.index.capacity and len(store.host.index) <= slots
        assert store.host.index.used_by_tenant.get("flood", 0) <= 0.3 * store.host.index.capacity
    held = {e.tenant for e in store.host.index.entries.values()}
    assert [store.host.slot_of(store.key(hashes[i]), touch=False) is not None for i in range(6)] == [True] * 6
    assert store.counters.get("host", "calm", "evictions") == 0 and store.counters.get("host", "flood", "evictions") == 17
    assert held == {"calm", "flood"}
    # Shared LRU: "other" without a share evicts the least recently used blocks, whoever's.
    store.save(store.reserve([(i, hashes[i], "other") for i in range(26, 30)]))
    assert len(store.host.index) == slots and store.counters.get("host", "calm", "evictions") == 3
    # Load back what survived into other device blocks: byte for byte what was saved.
    found, wait = store.lookup([hashes[4], hashes[5]], "calm", may_wait=True)
    assert found == [hashes[4], hashes[5]] and not wait
    for t in (t for layer in caches for t in layer):
        t[30:32].normal_(generator=gen)
    store.load([(30, hashes[4], "calm"), (31, hashes[5], "calm")])
    for target, source in ((30, 4), (31, 5)):
        assert all(torch.equal(a, b) for a, b in zip(_block(caches, target), originals[source])), f"seed={seed}"
    assert all(e.pins == 0 for e in store.host.index.entries.values())
    # A block reserved at eviction is found before its bytes are saved (a lookup in the same step); the runner
    # saves before it loads, so the load gets the saved bytes.
    reserved = store.reserve([(33, hashes[33], "calm")])
    found, _ = store.lookup([hashes[33]], "calm", may_wait=True)
    assert reserved and found == [hashes[33]]
    store.save(reserved)
    caches[0][0][34].normal_(generator=gen)
    store.load([(34, hashes[33], "calm")])
    assert torch.equal(caches[0][0][34], caches[0][0][33]) and torch.equal(caches[1][0][34], caches[1][0][33])
    assert all(e.pins == 0 for e in store.host.index.entries.values())
    # A lookup stops at the first block the host lacks; pins are released when not admitted.
    found, _ = store.lookup([hashes[4], hashes[0], hashes[5]], "calm", may_wait=True)
    assert found == [hashes[4]]
    store.release(found)
    assert all(e.pins == 0 for e in store.host.index.entries.values())


def test_disk_capacity_corruption_and_restart(tmp_path):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    caches = _caches(gen)
    copier = BlockCopier(caches, torch.device("cpu"))
    disk = str(tmp_path / "d")
    file_bytes = copier.block_bytes + 8 + 32 + 2 + len("acme") + 8 + 16
    store = TieredStore(copier, b"f" * 16, 4 * copier.block_bytes, disk, 6 * file_bytes)
    hashes = [bytes([i + 1]) * 16 for i in range(BLOCKS)]
    for i in range(9):
        store.save(store.reserve([(i, hashes[i], "acme")]))
    store.flush()
    assert len(_block_files(disk)) == 6 and store.disk.index.used <= store.disk.index.capacity
    assert store.counters.get("disk", "acme", "evictions") == 3
    originals = {i: _block(caches, i) for i in range(BLOCKS)}
    store.close()

    other_layout = TieredStore(copier, b"g" * 16, 4 * copier.block_bytes, disk, 6 * file_bytes)
    assert other_layout.lookup([hashes[5]], "acme", may_wait=True) == ([], False)  # another fingerprint: no key
    other_layout.close()
    again = TieredStore(copier, b"f" * 16, 4 * copier.block_bytes, disk, 6 * file_bytes)  # a restart
    assert len(again.disk.index) == 6 and len(again.host.index) == 0
    # Corrupt block 4's file: a payload byte flipped. Blocks 3..5 are on disk (0..2 were evicted).
    path = os.path.join(disk, again.key(hashes[4]).hex() + ".kvb")
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 1
    open(path, "wb").write(bytes(data))
    found, wait = again.lookup(hashes[3:6], "acme", may_wait=True)
    assert (found, wait) == ([], True)  # blocks are being read from disk: the request waits
    while True:
        found, wait = again.lookup(hashes[3:6], "acme", may_wait=False)
        if not wait:
            break
    assert found == [hashes[3]], "the chain stops at the corrupt block"
    assert not os.path.exists(path) and again.disk.num_deleted_corrupt == 1
    for t in (t for layer in caches for t in layer):
        t[35].normal_(generator=gen)
    again.load([(35, hashes[3], "acme")])
    assert all(torch.equal(a, b) for a, b in zip(_block(caches, 35), originals[3])), f"seed={seed}"
    again.close()


def _block_files(directory):
    return [n for n in os.listdir(directory) if n.endswith(".kvb")]
