"""Each rank's side of expert load balancing: the layers' placements, the measured load (rank 0), the decision
(rank 0, sent to the other ranks on the plans' channel), the weights moved and the maps switched.

Legend: L MoE layers, E logical experts, N expert-parallel ranks, S slots per rank, P = N * S = E + R slots.

Timeline, on rank 0's step count (steps that ran a forward, and dummy steps taken with peer replicas):

    step n, n % interval == 0:  rank 0 reads the window's load (with replicas sharing their experts, every
                                replica's rank 0 adds up all their windows, so all decide alike), runs the
                                policy; if the placement changes it
                                broadcasts a ``Rebalance`` before the step's plan, and every rank moves the
                                weights (``transfer``) layer by layer and installs the layer's new map once the
                                layer's copies are done; a control-group barrier ends the move on every rank
    then step n runs:           every rank routes with the new maps

No forward runs during a move (the engine is synchronous with several ranks), so every rank switches at the same
step boundary; a rank that fails during the move fails its peers' sends, receives or the barrier, and the engine
with them.
"""

import collections
import logging
import time
from dataclasses import dataclass

import msgspec
import torch
from torch import nn

from engine.core.stats import EXPERT_LOAD_EVERY_CUDA, SchedulerStats
from engine.distributed.collectives import TensorParallel
from engine.eplb.placement import ExpertPlacement
from engine.eplb.policy import EMPTY, mean_imbalance, rank_loads, rebalance, slots_per_rank
from engine.eplb.transfer import move_layer, plan_copies, slot_bytes
from engine.eplb.expert_load import ExpertLoadReader

logger = logging.getLogger(__name__)


class Rebalance(msgspec.Struct, frozen=True, tag=True):
    """Rank 0's decision, sent to the other ranks between two steps (``engine.worker.rank_messages``): every
    layer's new placement [L][P]."""

    placements: list[list[int]]


@dataclass(slots=True)
class BalanceStats:
    """What the balancing has done and measured (rank 0), for ``SchedulerStats``."""

    rebalances: int = 0
    bytes_moved: int = 0  # over all ranks, cumulative
    slots_copied: int = 0  # slot copies between ranks, cumulative
    slots_reassigned: int = 0  # slots whose expert was replaced by another one (moved away or dropped), cumulative
    last_rebalance_ms: float = 0.0  # deciding (rank 0's policy) plus moving, on rank 0
    imbalance_before: float | None = None  # measured over the window before the last rebalance
    imbalance_after: float | None = None  # predicted for the same window under the new placement
    rank_load_before: list[int] | None = None  # [N] tokens over that window, measured
    rank_load_after: list[float] | None = None  # [N] the same tokens under the new placement, predicted


def install(blocks: list[nn.Module], num_redundant: int) -> tuple[int, int]:
    """Give each expert-parallel MoE block ``S`` slots per rank and its first placement: its own experts as
    loaded, then empty spare slots (filled by the first rebalance); returns (N, S). ValueError when the experts
    and spare slots do not divide among the ranks."""
    num_ranks = slots = 0
    for block in blocks:
        ep = block.tp.expert_parallel
        num_experts, num_ranks = block.expert_tokens.shape[0], ep.tp.size
        slots = slots_per_rank(num_experts, num_redundant, num_ranks)
        total = slots * num_ranks
        starts = ep.expert_starts(num_experts)
        held = block.experts.w13.shape[0]
        for name, p in block.experts.named_parameters(recurse=False):
            padded = torch.cat([p.detach(), p.new_zeros((slots - held, *p.shape[1:]))])  # [S, ...]
            setattr(block.experts, name, nn.Parameter(padded, requires_grad=False))
        first = []
        for r in range(num_ranks):
            first += list(range(starts[r], starts[r + 1])) + [EMPTY] * (slots - (starts[r + 1] - starts[r]))
        block.placement = ExpertPlacement(first, num_experts, block.expert_tokens.device)
        block.dispatch = ep.dispatch(total)  # over slots: rank r holds [r*S, (r+1)*S)
    return num_ranks, slots


class ExpertBalancer:
    """One rank's balancing over its expert-parallel MoE ``blocks`` (``tp``: the experts' group). Rank 0 calls
    ``due`` before each step; every rank calls ``apply`` with the ``Rebalance`` it returned."""

    def __init__(self, blocks: list[nn.Module], tp: TensorParallel, num_redundant: int, window_steps: int,
                 interval_steps: int, device: torch.device, drivers: TensorParallel | None = None) -> None:
        """``drivers``: with replicas sharing their experts, the replicas' rank-0 processes (this one among them):
        they sum their windows before each decision, so that all of them make the same one (their balancing
        settings are the same: ``engine.distributed.world`` checks them as the replicas meet)."""
        self.blocks, self.tp, self.device = blocks, tp, device
        self.num_ranks, self.slots_per_rank = install(blocks, num_redundant)
        self.window_steps, self.interval_steps = window_steps, interval_steps
        self.stats = BalanceStats()
        # On CUDA the counters are copied every EXPERT_LOAD_EVERY_CUDA steps, never waited for: the window's grain.
        self._logical = ExpertLoadReader([b.expert_tokens for b in blocks], device, EXPERT_LOAD_EVERY_CUDA)
        self._last_logical: list[list[int]] | None = None
        self._window: collections.deque = collections.deque()  # (step, [L][E] tokens routed since the last read)
        self._physical: ExpertLoadReader | None = None
        self._last_physical: list[list[int]] | None = None
        self._rank_window: collections.deque = collections.deque()  # (step, [L][N] tokens each rank received)
        self.rank_tokens = [0] * self.num_ranks  # tokens each rank's slots received since start, all layers
        self._decided_at = 0
        self.drivers = drivers if drivers is not None and drivers.size > 1 else None
        self._decide_ms = 0.0  # the policy's time for the decision being applied (rank 0)
        self._watch_slots()

    @property
    def placements(self) -> list[list[int]]:
        return [b.placement.slot_experts for b in self.blocks]

    def _watch_slots(self) -> None:
        self._physical = ExpertLoadReader([b.placement.slot_tokens for b in self.blocks], self.device,
                                          EXPERT_LOAD_EVERY_CUDA)
        self._last_physical = [[0] * (self.num_ranks * self.slots_per_rank) for _ in self.blocks]
        self._rank_window.clear()

    def observe(self, num_steps: int) -> None:
        """Take in the load counted up to now (rank 0; on CUDA, a copy once it has landed)."""
        logical = self._logical.poll(num_steps)
        if logical is not None:
            if self._last_logical is not None:
                self._window.append((num_steps, [[a - b for a, b in zip(now, was)]
                                                 for now, was in zip(logical, self._last_logical)]))
            self._last_logical = logical
        physical = self._physical.poll(num_steps)
        if physical is not None:
            delta = [[a - b for a, b in zip(now, was)] for now, was in zip(physical, self._last_physical)]
            self._last_physical = physical
            per_rank = [[sum(layer[r * self.slots_per_rank:(r + 1) * self.slots_per_rank])
                         for r in range(self.num_ranks)] for layer in delta]
            for layer in per_rank:
                for r, n in enumerate(layer):
                    self.rank_tokens[r] += n
            self._rank_window.append((num_steps, per_rank))
        for window in (self._window, self._rank_window):
            while window and window[0][0] <= num_steps - self.window_steps:
                window.popleft()

    def imbalance(self) -> float | None:
        """Measured over the window under the current placement: per layer, max over ranks / mean of the tokens
        each rank's slots received, averaged over the layers (None before any token)."""
        if not self._rank_window:
            return None
        per_layer = [[sum(col) for col in zip(*layers)] for layers in zip(*(entry for _, entry in self._rank_window))]
        return mean_imbalance(per_layer)

    def due(self, num_steps: int) -> Rebalance | None:
        """Rank 0, before step ``num_steps`` + 1: a rebalance to apply now, or None. With replicas sharing their
        experts every replica's rank 0 calls it at the same step and they sum their windows (a collective)."""
        self.observe(num_steps)
        if num_steps == 0 or num_steps % self.interval_steps or num_steps == self._decided_at:
            return None
        self._decided_at = num_steps
        start = time.perf_counter()
        load = [[sum(col) for col in zip(*layers)] for layers in zip(*(entry for _, entry in self._window))]  # [L][E]
        if not load:
            load = [[0] * len(p) for p in self._expert_counts()]
        if self.drivers is not None:  # every replica's tokens: the same sum, so the same decision, on each
            load = [[sum(col) for col in zip(*layers)] for layers in zip(*self.drivers.all_gather_object(load))]
        if not any(map(any, load)):
            return None
        new = rebalance(load, self.num_ranks, self.slots_per_rank, self.placements)
        if new == self.placements:
            return None
        before = [rank_loads(layer, now, self.num_ranks) for layer, now in zip(load, self.placements)]
        after = [rank_loads(layer, placed, self.num_ranks) for layer, placed in zip(load, new)]
        measured = self.imbalance()
        self.stats.imbalance_before = measured if measured is not None else mean_imbalance(before)
        self.stats.imbalance_after = mean_imbalance(after)
        if self._rank_window:  # measured: tokens each rank's slots received over the window, all layers
            self.stats.rank_load_before = [sum(sum(layer[r] for layer in entry) for _, entry in self._rank_window)
                                           for r in range(self.num_ranks)]
        else:
            self.stats.rank_load_before = [round(sum(col)) for col in zip(*before)]
        self.stats.rank_load_after = [sum(col) for col in zip(*after)]
        self._decide_ms = (time.perf_counter() - start) * 1e3
        return Rebalance(new)

    def apply(self, decision: Rebalance) -> None:
        """Every rank: move the weights layer by layer and switch each layer's map once its copies are done; then
        wait for every rank to have finished (a rank that failed fails the others here)."""
        start = time.perf_counter()
        moved = copied = 0
        for block, new in zip(self.blocks, decision.placements):
            old = block.placement.slot_experts
            copies = plan_copies(old, new, self.slots_per_rank)
            move_layer(block.experts, copies, self.tp, self.slots_per_rank)
            remote = sum(c.src // self.slots_per_rank != c.dst // self.slots_per_rank for c in copies)
            moved += remote * slot_bytes(block.experts)
            copied += remote
            self.stats.slots_reassigned += sum(a != EMPTY and a != b for a, b in zip(old, new))
            block.placement.update(new)  # in place: captured CUDA graphs read the old tables' addresses
        self.tp.min_over_ranks(1, "finishing the move of expert weights")
        self._watch_slots()
        elapsed_ms = (time.perf_counter() - start) * 1e3 + self._decide_ms
        self.stats.rebalances += 1
        self.stats.bytes_moved += moved
        self.stats.slots_copied += copied
        self.stats.last_rebalance_ms = elapsed_ms
        if self.tp.rank == 0:
            logger.info("experts rebalanced in %.1f ms: %d slot copies between ranks, %.1f MB moved; predicted "
                        "imbalance %.3f -> %.3f", elapsed_ms, copied, moved / 1e6,
                        self.stats.imbalance_before or 0.0, self.stats.imbalance_after or 0.0)

    def _expert_counts(self) -> list[list[int]]:
        return [[0] * b.expert_tokens.shape[0] for b in self.blocks]

    def fill_stats(self, stats: SchedulerStats, num_steps: int) -> None:
        """Rank 0: the balance's fields of ``stats`` (the load read up to step ``num_steps``, on the clock ``due``
        is given: steps every replica of the experts' group takes together)."""
        self.observe(num_steps)
        done = self.stats
        stats.expert_load_by_rank = list(self.rank_tokens)
        stats.expert_imbalance = self.imbalance()
        stats.eplb_rebalances, stats.eplb_bytes_moved = done.rebalances, done.bytes_moved
        stats.eplb_slots_copied, stats.eplb_slots_reassigned = done.slots_copied, done.slots_reassigned
        stats.eplb_last_rebalance_ms = done.last_rebalance_ms
        stats.eplb_replicated_experts = self.replicated_experts()
        stats.eplb_rank_load_before, stats.eplb_rank_load_after = done.rank_load_before, done.rank_load_after
        stats.eplb_imbalance_before, stats.eplb_imbalance_after = done.imbalance_before, done.imbalance_after

    def replicated_experts(self) -> int:
        """Logical experts holding more than one slot now, summed over the layers."""
        return sum(sum(n > 1 for n in collections.Counter(e for e in p if e != EMPTY).values())
                   for p in self.placements)

