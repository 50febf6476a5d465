"""The router's decisions in plain Python: the prefix index against the engine's own block hashing, and the
policy simulated over replicas whose KV pools are LRU caches of blocks (the engine's eviction order)."""

import random
from collections import OrderedDict

import pytest

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from gateway.prefix_index import ReplicaBlocks, block_hashes
from gateway.routing_policy import ReplicaView, RouterConfig, choose, rebalance


def test_block_hashes_are_the_engines():
    """The router's hashes of a prompt are the ones the engine's KV cache manager registers for it."""
    rng = random.Random(0)
    prompt = [rng.randrange(1, 500) for _ in range(16 * 5 + 7)]
    manager = KVCacheManager(num_blocks=64, block_size=16, enable_caching=True)
    request = Request("r", prompt, SamplingParams(max_tokens=1), max_tokens=1,
                      policy=RequestPolicy(cache_salt="tenant-a"))
    assert manager.allocate_slots(request, len(prompt))
    request.num_computed_tokens = len(prompt)
    manager.cache_computed_blocks(request)  # what the engine does after the prompt's step
    ours = block_hashes(prompt, 16, "tenant-a")
    assert len(ours) == 5 and all(manager.pool.lookup(h) is not None for h in ours)
    # Another tenant's identical prompt shares nothing (the salt enters every block).
    assert all(manager.pool.lookup(h) is None for h in block_hashes(prompt, 16, "tenant-b"))


def test_replica_blocks_match_leading_run_and_forget_oldest():
    index = ReplicaBlocks(capacity=6)
    a = block_hashes(list(range(64)), 16, "t")  # 4 blocks
    index.add(a)
    assert index.roots == 1
    assert index.matched(a) == 4
    diverging = block_hashes(list(range(32)) + [999] * 32, 16, "t")  # same first 2 blocks, then differs
    assert index.matched(diverging) == 2
    b = block_hashes(list(range(100, 164)), 16, "t")
    index.add(b)  # 8 blocks > 6: a's two oldest (its first two) are forgotten
    assert len(index) == 6 and index.matched(a) == 0 and index.matched(b) == 4
    assert index.roots == 1  # a's first block went with its oldest blocks
    again = ReplicaBlocks(capacity=6)
    again.add(a)
    again.add(a[:2])  # the same family again: its head is now the most recent, its tail the oldest
    again.add(b)
    assert again.roots == 2 and again.matched(a) == 2


def _views(loads, matched, indexed=None, slots=64):
    indexed = indexed or [0] * len(loads)
    return [ReplicaView(i, load, slots, 0.0, m, n) for i, (load, m, n) in enumerate(zip(loads, matched, indexed))]


def test_affinity_wins_until_the_load_gap_is_too_wide():
    config = RouterConfig(balance_abs=4, balance_rel=1.5)
    assert choose(config, _views([3, 0], [10, 0]), 0) == 0  # 3 more requests: stay with the cache
    assert choose(config, _views([5, 0], [10, 0]), 0) == 1  # 5 more, none there: go to the idle one
    # A queue (4 slots, 4 in flight) while the other has a free slot: go there, whatever the gap.
    assert choose(config, _views([4, 3], [10, 0], slots=4), 0) == 1
    assert choose(config, _views([4, 4], [10, 0], slots=4), 0) == 0  # both full, equal queues: the cache
    assert choose(config, _views([5, 4], [10, 0], slots=4), 0) == 1  # both full: the shorter queue
    assert choose(config, _views([12, 9], [10, 0]), 0) == 0  # 3 more: within the gap
    assert choose(config, _views([20, 12], [10, 0]), 0) == 1  # 8 more and 1.67x: balance
    assert choose(config, _views([2, 2], [3, 7]), 0) == 1  # the longer match
    # Nobody holds it: least loaded, then the fewest prompt families.
    assert choose(config, _views([2, 1], [0, 0]), 0) == 1
    assert choose(config, _views([1, 1], [0, 0], [50, 10]), 0) == 1


def test_replicas_equal_in_every_respect_take_new_prefixes_in_turn():
    config = RouterConfig()
    views = _views([0, 0, 0], [0, 0, 0])
    assert [choose(config, views, turn) for turn in range(6)] == [0, 1, 2, 0, 1, 2]
    live = [v for v in _views([0, 0, 0, 0], [0, 0, 0, 0]) if v.index != 2]  # replica 2 is down
    assert sorted({choose(config, live, turn) for turn in range(8)}) == [0, 1, 3]
    # Anything that tells them apart still decides: fewer families, then less KV in use.
    views = _views([0, 0, 0], [0, 0, 0], indexed=[2, 1, 2])
    assert {choose(config, views, turn) for turn in range(6)} == {1}


def test_round_robin_takes_turns():
    config = RouterConfig(policy="round-robin")
    assert [choose(config, _views([0, 9, 0], [5, 0, 0]), t) for t in range(4)] == [0, 1, 2, 0]


def test_rebalance_moves_only_from_a_queue_to_a_free_slot_until_neither_is_left():
    """Random loads over 2-5 replicas, moves applied until the policy stops: every move went from a
    replica over its slots to one under them, the longest queue first, and at the end no replica has a
    free slot while another has a queue with something movable (checked by brute force)."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    config = RouterConfig()
    for _ in range(300):
        n = rng.randint(2, 5)
        slots = [rng.randint(1, 6) for _ in range(n)]
        loads = [rng.randint(0, 2 * s + 2) for s in slots]
        movable = {i: rng.randint(0, max(0, loads[i] - slots[i] + 1)) for i in range(n)}
        if rng.random() < 0.5:  # force the precondition in half the cases: one idle, one queued
            idle, busy = rng.sample(range(n), 2)
            loads[idle], loads[busy], movable[busy] = 0, slots[busy] + 2, 2
        assert rebalance(RouterConfig(policy="round-robin"), _loaded(loads, slots), movable) is None
        moves = 0
        while (move := rebalance(config, _loaded(loads, slots), movable)) is not None:
            source, target = move
            assert loads[target] < slots[target] and loads[source] > slots[source] and movable[source] > 0, seed
            assert loads[source] - slots[source] == max(loads[i] - slots[i] for i in range(n) if movable[i]), seed
            loads[source], loads[target], movable[source] = loads[source] - 1, loads[target] + 1, movable[source] - 1
            moves += 1
            assert moves <= 100, seed
        free = [i for i in range(n) if loads[i] < slots[i]]
        queued = [i for i in range(n) if loads[i] > slots[i] and movable[i]]
        assert not (free and queued), (seed, loads, slots, movable)


def _loaded(loads, slots):
    return [ReplicaView(i, load, s, 0.0, 0, 0) for i, (load, s) in enumerate(zip(loads, slots))]


def test_bad_router_config_is_refused():
    with pytest.raises(ValueError, match="policy"):
        RouterConfig(policy="random")
    with pytest.raises(ValueError, match="balance_rel"):
        RouterConfig(balance_rel=0.5)


class _SimReplica:
    """A replica as the scheduler would see it, reduced to its prefix cache: an LRU of block hashes of
    ``capacity`` blocks (the pool's eviction order), and a queue of requests in flight."""

    def __init__(self, capacity: int) -> None:
        self.cache: OrderedDict[bytes, None] = OrderedDict()
        self.capacity = capacity
        self.in_flight = 0
        self.hit = self.query = 0

    def serve(self, hashes: list[bytes], block_size: int) -> None:
        for n, h in enumerate(hashes):
            if h not in self.cache:
                break
        else:
            n = len(hashes)
        self.hit += n * block_size
        self.query += len(hashes) * block_size
        for h in hashes:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)


def _simulate(policy: str, tenants=16, requests=2000, prefix_blocks=63, capacity=600, concurrency=8, seed=0):
    """Requests of random tenants through the policy over 2 simulated replicas; each request stays
    ``concurrency`` arrivals in flight. Returns (cached fraction, requests per replica, worst load gap)."""
    rng = random.Random(seed)
    bs = 16
    prefixes = [[rng.randrange(1, 10_000) for _ in range(prefix_blocks * bs)] for _ in range(tenants)]
    replicas = [_SimReplica(capacity), _SimReplica(capacity)]
    index = [ReplicaBlocks(capacity), ReplicaBlocks(capacity)]
    config = RouterConfig(policy=policy)
    running: list[int] = []
    routed = [0, 0]
    worst_gap = 0
    for turn in range(requests):
        if len(running) >= concurrency:
            replicas[running.pop(0)].in_flight -= 1
        t = rng.randrange(tenants)
        hashes = block_hashes(prefixes[t] + [rng.randrange(1, 10_000) for _ in range(32)], bs, f"t{t}")
        views = [ReplicaView(i, r.in_flight, 16, 0.0, index[i].matched(hashes), index[i].roots)
                 for i, r in enumerate(replicas)]
        i = choose(config, views, turn)
        index[i].add(hashes)
        replicas[i].serve(hashes, bs)
        replicas[i].in_flight += 1
        running.append(i)
        routed[i] += 1
        worst_gap = max(worst_gap, abs(replicas[0].in_flight - replicas[1].in_flight))
    cached = sum(r.hit for r in replicas) / sum(r.query for r in replicas)
    return cached, routed, worst_gap


def test_simulated_cache_aware_routing_keeps_each_tenants_prefix_on_one_replica():
    """16 tenants' 63-block prefixes over 2 replicas that hold about half of them each: round-robin makes
    every replica cycle through all 16 (LRU thrashes), the router splits them 8 and 8 and keeps them."""
    cached_rr, routed_rr, _ = _simulate("round-robin")
    cached_ca, routed_ca, gap = _simulate("cache-aware")
    assert cached_ca >= 0.9, cached_ca
    assert cached_rr <= 0.6, cached_rr
    assert min(routed_ca) >= 0.35 * sum(routed_ca), routed_ca  # both replicas work
    assert gap <= RouterConfig().balance_abs + 1
    assert routed_rr == [1000, 1000]


def test_an_adapter_request_prefers_replicas_holding_its_adapter_within_the_balance_bounds():
    config, rng = RouterConfig(), random.Random()
    for _ in range(200):
        load = rng.randrange(0, 4)
        views = [ReplicaView(i, load + rng.randrange(0, 3), 8, rng.random(), rng.randrange(0, 4), rng.randrange(0, 5),
                             has_adapter=False) for i in range(4)]
        holder = rng.randrange(4)
        views[holder].has_adapter = True
        assert choose(config, views, 0) == holder  # over more cached blocks and less load elsewhere
    # Past the balance bounds the adapter does not hold the request: a queue beats a resident adapter.
    busy = ReplicaView(0, 8, 8, 0.5, 0, 1, has_adapter=True)
    idle = ReplicaView(1, 0, 8, 0.0, 0, 1)
    assert choose(config, [busy, idle], 0) == 1
    # Nobody holds it: the usual choice (the prefix, then load).
    views = [ReplicaView(0, 1, 8, 0.0, 3, 1), ReplicaView(1, 0, 8, 0.0, 0, 1)]
    assert choose(config, views, 0) == 0
