"""Which replica a request goes to: prefix-cache affinity traded against load (plain Python, no I/O).

Cache-aware (the default), in the manner of SGLang's cache-aware router:

1. **Balance first.** A replica with no free slot is out of the running for
   this request while another has one, or (all full) while another's queue is
   shorter: a request that must wait joins the shortest queue, so a burst
   leaves no replica idle while another works through a backlog (and moves,
   below, keep it so while the burst drains unevenly). So is one
   whose load exceeds the least loaded replica's by more than
   ``balance_abs`` requests *and* by more than ``balance_rel`` times: no
   replica idles while another has a queue, whatever the cache says. Below
   that, a gap in load is worth less than a cached prefix (a 1,000-token
   prefill costs more than a few more requests sharing the decode step), and
   breaking affinity copies the prefix to a second replica, where it evicts
   another tenant's (in a simulation of 16 tenants on 2 replicas, an
   absolute threshold of 4 instead of 8 lost 7 points of cache hits).
2. **Affinity.** Among the rest, the replica that was sent the longest run of
   this prompt's leading blocks (tenant-salted, see ``gateway.prefix_index``)
   wins, if that run is at least ``min_match_blocks`` long; ties go to the
   less loaded one.
   A request under a LoRA adapter first prefers, among the rest, the replicas
   that hold its adapter (``has_adapter``: it was among the last ``max_loras``
   adapters sent there, so likely still resident): loading an adapter costs a
   copy of its weights and evicts another's, where a missed prefix costs one
   prefill.
3. **Otherwise** (a prefix no replica holds): the least loaded replica, then
   the one holding the fewest prompt families (distinct first blocks), so new
   tenants' prefixes split evenly over the replicas instead of piling onto
   one. An uneven split costs more than it seems: with 16 tenants on 2
   replicas that each hold about 9 prefixes, the side given 9 evicts its own.

A replica's load is its requests in flight: the router's own count of what it
sent and has not finished, or the engine's reported running plus waiting
requests where that is larger (another gateway may share a remote engine). KV
usage breaks ties between equally loaded replicas.

Round-robin ignores both and takes the next live replica in turn (the
baseline of the benchmark).

**Moving queued requests** (cache-aware only; ``rebalance``). A request is
routed once, so a burst split over replicas can leave one replica's engine
with requests queued after another replica has drained (its requests were
shorter, or it is faster). When a replica has a free slot and another's load
exceeds its slots, the router moves one request from the longest queue to the
least loaded replica with a free slot; it asks again after each move. Only a
move from a queue to a free slot is made: after it the source has no free
slot and the target no queue, so a move never sets up its own reverse and
requests cannot bounce between replicas.
Which request moves, and keeping the client from seeing it, is the router's
business (``gateway.replica_router``).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

POLICIES = ("cache-aware", "round-robin")


@dataclass(slots=True)
class RouterConfig:
    policy: str = "cache-aware"
    balance_abs: int = 8  # requests: a load gap up to this never overrides affinity (unless there is a queue)
    balance_rel: float = 1.5  # ... nor one up to this factor of the least loaded replica's load
    min_match_blocks: int = 1  # a shorter shared run of blocks is not worth a less idle replica
    # Seconds between looks for a move while requests wait unstarted (besides one whenever a request ends):
    # a replica that joins or rejoins idle gets work without waiting for a request to end. 0: only on ends.
    rebalance_interval_s: float = 0.1
    # A replica silent this long (a running engine speaks every second: a frozen process, a stalled link) gets no
    # new requests until it speaks again; its stall timeout, much longer, decides whether it is dead.
    unresponsive_after_s: float = 3.0
    # Tenant weights over the whole fleet: requests wait in the router's weighted-fair queue until a replica has
    # room, and go in the order of fleet-wide virtual token counters (gateway.fleet_fairness). False: each replica's
    # scheduler shares only its own capacity, so affinity that keeps tenants apart also keeps their weights apart.
    fleet_fairness: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router policy must be one of {POLICIES}, got {self.policy!r}")
        if self.balance_abs < 0 or self.balance_rel < 1.0 or self.min_match_blocks < 1:
            raise ValueError("balance_abs must be >= 0, balance_rel >= 1 and min_match_blocks >= 1")
        if self.rebalance_interval_s < 0:
            raise ValueError("rebalance_interval_s must be >= 0")
        if not self.unresponsive_after_s > 0:
            raise ValueError("unresponsive_after_s must be > 0")


@dataclass(slots=True)
class ReplicaView:
    """What the policy sees of one live replica for one request."""

    index: int  # the replica's position in the router
    load: int  # requests in flight there
    slots: int  # requests it runs at once (max_num_seqs): more in flight wait in its queue
    kv_usage: float  # fraction of its KV pool in use (0 before its first report)
    matched_blocks: int  # leading blocks of this prompt it was sent
    families: int  # distinct prompt families (first blocks) its index holds
    has_adapter: bool = False  # the request's LoRA adapter is among those recently sent there (False: none asked)


def choose(config: RouterConfig, views: Sequence[ReplicaView], turn: int) -> int:
    """The chosen replica's ``index``; ``views`` are the live replicas (at least one), ``turn`` counts requests."""
    if config.policy == "round-robin":
        return views[turn % len(views)].index
    least = min(v.load for v in views)
    shortest_queue = min(v.load - v.slots for v in views)  # negative: that replica has free slots
    fair = [v for v in views
            if not (v.load >= v.slots and v.load - v.slots > max(shortest_queue, -1))
            and not (v.load - least > config.balance_abs and v.load > config.balance_rel * least)]
    if any(v.has_adapter for v in fair):
        fair = [v for v in fair if v.has_adapter]  # within the balance bounds: the adapter's residency first
    best = max(fair, key=lambda v: (v.matched_blocks, -v.load, -v.kv_usage))
    if best.matched_blocks >= config.min_match_blocks:
        return best.index
    # Replicas equal in all of these take new prefixes in turn (the first one would take them all, and each
    # then starts a family there, which the next requests follow).
    span = max(v.index for v in views) + 1
    return min(fair, key=lambda v: (v.load, v.families, v.kv_usage, (v.index - turn) % span)).index


def rebalance(config: RouterConfig, views: Sequence[ReplicaView], movable: Mapping[int, int]) -> tuple[int, int] | None:
    """(source, target) replica ``index`` for one queued request to move now, or None.

    ``views``: the live replicas; ``movable``: per replica ``index``, how many requests sent there have
    produced no output yet (only those may move). A move needs a target with a free slot (load < slots)
    and a source with a queue (load > slots) holding a movable request: the source with the longest
    queue gives one to the least loaded target (KV use breaks ties). Round-robin never moves requests.
    """
    if config.policy != "cache-aware":
        return None
    targets = [v for v in views if v.load < v.slots]
    sources = [v for v in views if v.load > v.slots and movable.get(v.index, 0) > 0]
    if not targets or not sources:
        return None
    source = max(sources, key=lambda v: v.load - v.slots)
    target = min(targets, key=lambda v: (v.load, v.kv_usage))
    return source.index, target.index
