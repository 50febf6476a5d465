"""Where each layer's experts go: how many replicas each logical expert gets and which physical slot holds each.

Pure Python, no torch: it is a function of the measured load. Legend: E logical experts, N ranks, S slots per
rank, P = N * S physical slots (E of them for the experts, P - E spare ones for replicas).

Per layer, from each expert's load over the window (tokens routed to it):

1. Replicas: every expert gets one; each spare slot goes to the expert whose load per replica is the highest
   (a token of a replicated expert goes to one of its replicas, spread evenly: each replica takes load / count),
   at most one replica per rank.
2. Packing: replicas from the heaviest down, each onto the rank with the least load so far that has a free slot
   and no replica of that expert yet (greedy longest-processing-time bin packing with a slot capacity). Among
   equally loaded ranks the one already holding the expert wins, so that nothing moves for nothing.
3. Slots: on each rank, an expert it already holds keeps its slot; the others take the slots left.

The predicted imbalance of a placement is max over ranks / mean over ranks of the load it would give them.
"""

import heapq

EMPTY = -1  # a slot holding no expert (the spare slots before the first rebalance)


def slots_per_rank(num_experts: int, num_redundant: int, num_ranks: int) -> int:
    """S: the slots each rank holds for ``num_experts`` experts and ``num_redundant`` spare slots over ``num_ranks``
    ranks; ValueError, naming the setting, when they do not divide evenly or a rank would hold more slots than
    there are experts (it would hold an expert twice)."""
    total = num_experts + num_redundant
    if total % num_ranks or total // num_ranks > num_experts:
        raise ValueError(f"num_redundant_experts: {num_experts} experts + {num_redundant} spare slots must divide "
                         f"evenly among the {num_ranks} expert-parallel ranks, at most {num_experts} per rank")
    return total // num_ranks


def replica_counts(load: list[float], num_slots: int, num_ranks: int, hot_spares: int | None = None) -> list[int]:
    """[E] replicas per expert: one each, then ``hot_spares`` (default: every spare slot) each to the expert with
    the most load per replica, the rest each to the expert with the least (a slot must hold some expert; a replica
    of an idle one costs nothing); the lowest expert id on ties, never more replicas than ranks."""
    counts = [1] * len(load)
    spares = num_slots - len(load)
    hot = spares if hot_spares is None else hot_spares
    for sign, n in ((-1.0, hot), (1.0, spares - hot)):
        heap = [(sign * load[e] / counts[e], e) for e in range(len(load)) if counts[e] < num_ranks]
        heapq.heapify(heap)
        for _ in range(n):
            _, e = heapq.heappop(heap)
            counts[e] += 1
            if counts[e] < num_ranks:
                heapq.heappush(heap, (sign * load[e] / counts[e], e))
    return counts


def place_layer(load: list[float], num_ranks: int, slots_per_rank: int, current: list[int]) -> list[int]:
    """[P] the logical expert each physical slot holds after rebalancing one layer from ``load`` [E] (rank r holds
    slots [r*S, (r+1)*S)); ``current`` [P] is what they hold now (``EMPTY`` for none).

    A few splits of the spare slots between hot experts and idle ones are packed (replicating every spare into the
    hottest experts is not always best: three equal hot experts on two ranks pack better with one of them
    replicated than two), and the least imbalanced packing wins, then improved by swaps."""
    num_experts, num_slots = len(load), num_ranks * slots_per_rank
    if not num_experts <= num_slots <= num_experts * num_ranks:
        raise ValueError(f"{num_slots} slots over {num_ranks} ranks cannot hold {num_experts} experts (at most one "
                         "replica of an expert per rank)")
    spares = num_slots - num_experts
    best = None  # (max rank load, -hot spares, chosen experts per rank)
    for hot in sorted({spares, spares - 1, spares - 2, *(spares * i // 4 for i in range(4))}, reverse=True):
        if hot < 0:
            continue
        counts = replica_counts(load, num_slots, num_ranks, hot)
        chosen, rank_load = _pack(load, counts, num_ranks, slots_per_rank, current)
        if best is None or max(rank_load) < best[0] - 1e-9 * max(1.0, best[0]):
            best = (max(rank_load), chosen, rank_load, counts)
    _, chosen, rank_load, counts = best
    _improve_by_swaps(chosen, rank_load, [load[e] / counts[e] for e in range(num_experts)])
    placement = []
    for r in range(num_ranks):
        slots = current[r * slots_per_rank:(r + 1) * slots_per_rank]
        wanted = sorted(chosen[r])
        kept = [EMPTY] * slots_per_rank
        for i, e in enumerate(slots):  # an expert staying on this rank keeps its slot: no copy
            if e in wanted:
                wanted.remove(e)
                kept[i] = e
        rest = iter(wanted)
        placement += [e if e != EMPTY else next(rest) for e in kept]
    return placement


def _pack(load: list[float], counts: list[int], num_ranks: int, slots_per_rank: int,
          current: list[int]) -> tuple[list[list[int]], list[float]]:
    """The experts each rank holds ([N] lists of S) and the load each gets, packing ``counts`` replicas."""
    replicas = sorted(((load[e] / counts[e], e) for e in range(len(load)) for _ in range(counts[e])),
                      key=lambda item: (-item[0], item[1]))
    holds_now = [set(current[r * slots_per_rank:(r + 1) * slots_per_rank]) for r in range(num_ranks)]
    rank_load, free = [0.0] * num_ranks, [slots_per_rank] * num_ranks
    chosen: list[list[int]] = [[] for _ in range(num_ranks)]
    chosen_sets: list[set[int]] = [set() for _ in range(num_ranks)]
    for weight, e in replicas:
        open_ranks = [r for r in range(num_ranks) if free[r] and e not in chosen_sets[r]]
        # Only the last slots can leave no rank without this expert; then any free rank.
        open_ranks = open_ranks or [r for r in range(num_ranks) if free[r]]
        r = min(open_ranks, key=lambda r: (rank_load[r], e not in holds_now[r], r))
        chosen[r].append(e)
        chosen_sets[r].add(e)
        rank_load[r] += weight
        free[r] -= 1
    weight = [load[e] / counts[e] for e in range(len(load))]
    _separate_replicas(chosen, rank_load, weight)
    return chosen, rank_load


def _separate_replicas(chosen: list[list[int]], rank_load: list[float], weight: list[float]) -> None:
    """Where the last free slots left two replicas of an expert on one rank, swap one of them with an expert of
    another rank that holds neither (the swap that keeps the larger rank load lowest)."""
    for r, mine in enumerate(chosen):
        for i, e in enumerate(mine):
            if mine.count(e) < 2:
                continue
            options = [(max(rank_load[r] - weight[e] + weight[b], rank_load[o] - weight[b] + weight[e]), o, j)
                       for o, theirs in enumerate(chosen) if o != r and e not in theirs
                       for j, b in enumerate(theirs) if b not in mine]
            if not options:
                continue
            _, o, j = min(options)
            b = chosen[o][j]
            mine[i], chosen[o][j] = b, e
            rank_load[r] += weight[b] - weight[e]
            rank_load[o] += weight[e] - weight[b]


def _improve_by_swaps(chosen: list[list[int]], rank_load: list[float], weight: list[float],
                      max_rounds: int = 32, partners: int = 4) -> None:
    """Swap single replicas between the most loaded rank and one of the ``partners`` least loaded ones while that
    lowers the larger of the two (the greedy packing leaves such swaps when slots, not load, bound a rank)."""
    for _ in range(max_rounds):
        hot = max(range(len(chosen)), key=lambda r: (rank_load[r], -r))
        best = None  # (new max of the pair, other rank, index on hot, index on other)
        on_hot = set(chosen[hot])
        for other in sorted((r for r in range(len(chosen)) if r != hot), key=lambda r: (rank_load[r], r))[:partners]:
            on_other = set(chosen[other])
            for i, a in enumerate(chosen[hot]):
                if a in on_other:
                    continue
                for j, b in enumerate(chosen[other]):
                    delta = weight[a] - weight[b]
                    if delta <= 0 or b in on_hot:
                        continue
                    pair_max = max(rank_load[hot] - delta, rank_load[other] + delta)
                    if pair_max < rank_load[hot] - 1e-12 and (best is None or pair_max < best[0]):
                        best = (pair_max, other, i, j)
        if best is None:
            return
        _, other, i, j = best
        a, b = chosen[hot][i], chosen[other][j]
        chosen[hot][i], chosen[other][j] = b, a
        delta = weight[a] - weight[b]
        rank_load[hot] -= delta
        rank_load[other] += delta


def rebalance(load: list[list[float]], num_ranks: int, slots_per_rank: int, current: list[list[int]],
              min_gain: float = 0.02) -> list[list[int]]:
    """[L][P] new placement of every layer from its ``load`` [L][E]. A layer keeps ``current`` when it had no load,
    or when the new placement would lower its predicted imbalance by less than ``min_gain`` (a move pauses
    serving; chasing noise would pay that for nothing)."""
    out = []
    for layer, now in zip(load, current):
        if sum(layer) <= 0:
            out.append(list(now))
            continue
        placed = place_layer(layer, num_ranks, slots_per_rank, now)
        gain = imbalance(rank_loads(layer, now, num_ranks)) - imbalance(rank_loads(layer, placed, num_ranks))
        out.append(placed if gain >= min_gain else list(now))
    return out


def rank_loads(load: list[float], placement: list[int], num_ranks: int) -> list[float]:
    """[N] the load each rank would get under ``placement`` [P]: each expert's load spread evenly over its
    replicas (an expert with no slot counts nowhere)."""
    counts = [0] * len(load)
    for e in placement:
        if e != EMPTY:
            counts[e] += 1
    slots_per_rank = len(placement) // num_ranks
    return [sum(load[e] / counts[e] for e in placement[r * slots_per_rank:(r + 1) * slots_per_rank] if e != EMPTY)
            for r in range(num_ranks)]


def imbalance(per_rank: list[float]) -> float:
    """max / mean of per-rank loads (1.0 is perfectly even; 1.0 for no load at all)."""
    total = sum(per_rank)
    return max(per_rank) * len(per_rank) / total if total > 0 else 1.0


def mean_imbalance(per_layer: list[list[float]]) -> float | None:
    """Mean over layers of ``imbalance`` of each layer's per-rank loads ([L][N]); None when nothing was routed."""
    loaded = [layer for layer in per_layer if sum(layer) > 0]
    return sum(imbalance(layer) for layer in loaded) / len(loaded) if loaded else None
