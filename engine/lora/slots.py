"""Device-resident adapter slots of one target module, and the batched deltas of a batch that mixes them.

Slot 0 is the base model (all zeros, never written); slots 1..max_loras hold resident adapters. Ranks below
``max_rank`` are zero-padded (and the stored rank width is rounded up to ``RANK_ALIGN``, which
``torch._grouped_mm`` needs of its operands), which leaves the delta exact. A step's tokens each carry a slot
index; the deltas are a few batched matmuls over the whole step whatever the number of adapters in it: grouped
matmuls over the tokens sorted by slot (dense layers), and over the (token, expert) pairs sorted by (expert,
slot) for routed experts, or for few tokens per adapter (decode) batched matmuls over those groups padded to
one size. So one forward serves the base model and any mix of resident adapters. Legend: T tokens, S slots,
R max rank (padded), P packed parts, E experts, N (token, expert) pairs, M padded rows per (expert, slot) group.
"""

import itertools
from dataclasses import dataclass

import torch

from engine.lora.peft_format import ExpertsLora as ExpertFactors, LinearLora
from moe_kernels.grouped_backend import grouped_mm_runs_on

# Stored rank widths are multiples of 8 elements: 16 bytes or more in every float dtype, the operand alignment
# ``torch._grouped_mm`` asks for. The zero columns add nothing to a delta.
RANK_ALIGN = 8
# (Expert, slot) groups of at most this many rows take the padded batched matmuls: in decode each group holds a
# few pairs and one grouped matmul per group costs more in per-group overhead than the padding (measured on the
# CPU: 144 groups of ~2 rows, rank 16, hidden 256: 220 us grouped against 130 us padded to 6 rows).
PADDED_MAX_ROWS = 16
# Dense layers take the padded batched matmuls while the padded rows are at most this many times the adapter
# tokens (one adapter with many tokens beside one with few would pad the few).
LINEAR_PADDING_MAX = 2
# Devices where the routed experts' deltas run as the Triton kernel (``engine.kernels.lora_experts``): every
# (expert, adapter) group in one launch, with no padding and no read-back.
TRITON_DELTA_DEVICES = ("cuda",)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _grouped_ok(x: torch.Tensor, *widths: int) -> bool:
    """Whether ``torch._grouped_mm`` runs x's dtype and device with row widths ``widths`` (16-byte multiples)."""
    return grouped_mm_runs_on(x) and all(w * x.element_size() % 16 == 0 for w in widths)


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """One step's adapter layout, built once on the host: ``slot_ids`` [T] (0: base model); for each adapter
    slot present, the rows of its tokens (``groups``: (slot, rows [T_s])); the same rows in slot order
    (``order`` [T_a]) with ``ends`` [S_b] int32, the end of each slot 0..S_b-1's run of ``order`` (slot 0's run
    is empty: base tokens need no delta); ``max_rows``, the most tokens of one adapter.

    When the adapters' token counts are even enough (``LINEAR_PADDING_MAX``), the padded layout of the dense
    deltas: slot s (1..S_b-1) owns rows (s-1)*M..s*M-1 of a [(S_b-1)*M] buffer, M = ``max_rows``;
    ``padded_source`` [(S_b-1)*M] is the token each row holds (any token past a slot's count: computed, never
    read), ``padded_rows`` [T_a] the row of each token of ``order``. None otherwise."""

    slot_ids: torch.Tensor
    groups: tuple[tuple[int, torch.Tensor], ...]
    order: torch.Tensor
    ends: torch.Tensor
    max_rows: int
    padded_source: torch.Tensor | None = None
    padded_rows: torch.Tensor | None = None

    @staticmethod
    def build(slot_ids: list[int], device: torch.device | str = "cpu") -> "LoraBatch":
        """From the host list of per-token slots: the groups are found on the host (no device sync)."""
        rows: dict[int, list[int]] = {}
        for t, s in enumerate(slot_ids):
            if s:
                rows.setdefault(s, []).append(t)
        top = max(rows, default=0)
        ends, end = [0] * (top + 1), 0
        for s in range(1, top + 1):
            end += len(rows.get(s, ()))
            ends[s] = end
        order = [t for s in sorted(rows) for t in rows[s]]
        max_rows = max((len(r) for r in rows.values()), default=0)
        padded = None
        if order and top * max_rows <= LINEAR_PADDING_MAX * len(order):
            source = [order[0]] * (top * max_rows)
            padded_rows = []
            for s, r in sorted(rows.items()):
                source[(s - 1) * max_rows:(s - 1) * max_rows + len(r)] = r
                padded_rows.extend(range((s - 1) * max_rows, (s - 1) * max_rows + len(r)))
            padded = (torch.tensor(source, dtype=torch.int64, device=device),
                      torch.tensor(padded_rows, dtype=torch.int64, device=device))
        return LoraBatch(torch.tensor(slot_ids, device=device),
                         tuple((s, torch.tensor(r, device=device)) for s, r in sorted(rows.items())),
                         torch.tensor(order, dtype=torch.int64, device=device),
                         torch.tensor(ends, dtype=torch.int32, device=device),
                         max_rows, *(padded or (None, None)))


class LinearSlots:
    """Stacked factors of one (packed) linear layer: ``a`` [S, W, in], ``b`` [S, out, W], W = P*R rounded up to
    ``RANK_ALIGN``.

    ``part_rows``: the output rows of each packed part ((0, out) for a plain layer; q, k, v rows of a qkv
    projection). Part p's factors use rank columns p*R..(p+1)*R and only its own rows of ``b`` (block-diagonal),
    so one pair per slot is exactly the sum of the sub-projections' deltas.
    """

    def __init__(self, num_slots: int, max_rank: int, in_features: int, part_rows: list[tuple[int, int]],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.max_rank, self.part_rows = max_rank, part_rows
        width = _round_up(len(part_rows) * max_rank, RANK_ALIGN)
        out = part_rows[-1][1]
        # [S, W, in]; stored in-major on the CPU, as ``ExpertSlots.a`` (its batched matmuls read A faster so).
        if torch.device(device).type == "cpu":
            self.a = torch.zeros(num_slots, in_features, width, dtype=dtype, device=device).transpose(1, 2)
        else:
            self.a = torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, out, width, dtype=dtype, device=device)  # [S, out, W]

    def load(self, slot: int, parts: dict[int, LinearLora] | None) -> None:
        """Write an adapter's pairs into ``slot`` (None or a missing part: zeros, no delta)."""
        assert slot > 0, "slot 0 is the base model"
        self.a[slot].zero_()
        self.b[slot].zero_()
        for p, pair in (parts or {}).items():
            rank = pair.a.shape[0]
            lo, hi = self.part_rows[p]
            if rank > self.max_rank or pair.b.shape[0] != hi - lo or pair.a.shape[1] != self.a.shape[2]:
                raise ValueError(f"LoRA factors {tuple(pair.a.shape)}, {tuple(pair.b.shape)} do not fit rows "
                                 f"{hi - lo} x {self.a.shape[2]} at rank <= {self.max_rank}")
            cols = slice(p * self.max_rank, p * self.max_rank + rank)
            self.a[slot, cols] = pair.a.to(self.a.dtype)
            self.b[slot, lo:hi, cols] = pair.b.to(self.b.dtype)

    def add_delta(self, x: torch.Tensor, out: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        """out [T, out] += each token's adapter delta of x [T, in]; returns out.

        Adapters with even token counts (decode): two batched matmuls over their tokens padded to one count.
        Otherwise two grouped matmuls over the adapter tokens in slot order where ``torch._grouped_mm`` runs
        (whatever the number of adapters), else a pair of matmuls per adapter present."""
        if batch.padded_source is not None:
            adapters = batch.ends.shape[0] - 1  # slots 1..S_b-1
            xp = x.index_select(0, batch.padded_source).view(adapters, batch.max_rows, -1)  # [S_b-1, M, in]
            low = torch.bmm(xp, self.a[1:adapters + 1].transpose(1, 2))  # [S_b-1, M, W]
            delta = torch.bmm(low, self.b[1:adapters + 1].transpose(1, 2)).view(-1, out.shape[1])  # [(S_b-1)*M, out]
            return out.index_add_(0, batch.order, delta.index_select(0, batch.padded_rows).to(out.dtype))
        if _grouped_ok(x, x.shape[1], self.a.shape[1], out.shape[1]) and x.dtype == self.a.dtype:
            groups = batch.ends.shape[0]  # slots 0..S_b-1: the higher ones have no tokens this step
            xs = x.index_select(0, batch.order)  # [T_a, in]
            low = torch._grouped_mm(xs, self.a[:groups].transpose(-2, -1), offs=batch.ends)  # [T_a, W]
            delta = torch._grouped_mm(low, self.b[:groups].transpose(-2, -1), offs=batch.ends)  # [T_a, out]
            return out.index_add_(0, batch.order, delta.to(out.dtype))
        for slot, rows in batch.groups:
            low = x[rows] @ self.a[slot].T  # [T_s, W]
            out.index_add_(0, rows, low @ self.b[slot].T)  # [T_s, out]
        return out


@dataclass(frozen=True, slots=True)
class ExpertPairs:
    """A MoE layer's (token, expert) pairs of one step, sorted by (expert, slot): each expert's pairs form one
    run (the base matmuls' groups); within it the adapter pairs form one group per slot (the deltas' groups).
    Built once per layer call by ``sort``, shared by both expert tensors. Group g = expert * (S-1) + slot - 1
    (slot 0, the base model, has no factors and no group).

    ``adapted`` lists the adapter pairs' sorted positions in group order; ``ends`` [E*(S-1)] ends each group's
    run of ``adapted``. The padded layout (``rows`` M > 0): group g owns rows g*M..g*M+M-1 of a [E*(S-1)*M]
    buffer; ``padded_source`` says which sorted pair each row holds (any pair where the group has fewer: those
    rows are computed and never read), ``padded_rows`` where each adapter pair's row is.
    """

    order: torch.Tensor  # [N] sorted position -> pair index (token * k + choice)
    experts: torch.Tensor  # [N] the expert of each sorted pair
    expert_ends: torch.Tensor  # [E] int32: end of each expert's run of the sorted pairs
    adapted: torch.Tensor  # [N_a] sorted positions of the adapter pairs, in group order
    ends: torch.Tensor  # [E*(S-1)] int32: end of each group's run of ``adapted``
    max_rows: int  # no group holds more pairs (the largest group's size, or a bound known on the host)
    rows: int  # M: padded rows per group; 0: no padded layout (groups too large for it, or the Triton kernel)
    padded_source: torch.Tensor | None  # [E*(S-1)*M] padded row -> sorted position of the pair it holds
    padded_rows: torch.Tensor | None  # [N_a] adapter pair (in ``adapted`` order) -> its padded row

    @staticmethod
    def sort(topk_ids: torch.Tensor, batch: LoraBatch, num_experts: int, num_slots: int) -> "ExpertPairs":
        """topk_ids [T, k]; ``batch``: the step's slots. Reads nothing back from a GPU (on the CPU, the largest
        group's size, which costs nothing there and trims the padding)."""
        top_k = topk_ids.shape[1]
        experts = topk_ids.reshape(-1).to(torch.int64)  # [N]
        slots = batch.slot_ids.to(torch.int64).repeat_interleave(top_k)  # [N]
        key, order = torch.sort(experts * num_slots + slots, stable=True)  # stable: a group stays in token order
        counts = torch.zeros(num_experts * num_slots, dtype=torch.int64, device=key.device)
        counts.index_add_(0, key, torch.ones_like(key))  # [E*S] pairs per (expert, slot), slot 0 included
        per_expert = counts.view(num_experts, num_slots)
        expert_ends = per_expert.sum(1).cumsum(0).to(torch.int32)  # [E]
        group_counts = per_expert[:, 1:].reshape(-1)  # [G], G = E*(S-1)
        ends = group_counts.cumsum(0)  # [G]
        num_adapted = batch.order.shape[0] * top_k  # known on the host: the batch's adapter tokens times k
        # Sorted positions of the adapter pairs first (stable: in key order, which is group order).
        adapted = torch.sort((key % num_slots == 0).to(torch.int8), stable=True)[1][:num_adapted]  # [N_a]
        max_rows = batch.max_rows  # no group is larger: a token meets an expert once
        if key.device.type == "cpu" and num_adapted:
            max_rows = int(group_counts.max())
        rows = 0 if key.device.type in TRITON_DELTA_DEVICES else max_rows
        padded_source = padded_rows = None
        if 0 < rows <= PADDED_MAX_ROWS:
            starts = ends - group_counts  # [G]
            group = key.index_select(0, adapted)  # [N_a] (expert, slot) key of each adapter pair
            group = group // num_slots * (num_slots - 1) + group % num_slots - 1  # [N_a] its group
            padded_rows = group * rows + torch.arange(num_adapted, device=key.device) - starts[group]  # [N_a]
            within = torch.arange(rows, device=key.device)  # [M]
            source = (starts[:, None] + within).clamp_(max=num_adapted - 1).reshape(-1)  # [G*M] into ``adapted``
            padded_source = adapted.index_select(0, source)  # [G*M] sorted positions
        else:
            rows = 0
        return ExpertPairs(order, key // num_slots, expert_ends, adapted, ends.to(torch.int32), max_rows, rows,
                           padded_source, padded_rows)


class ExpertSlots:
    """Stacked per-expert factors of one fused expert tensor [E, out, in], expert-major so that one (expert,
    adapter) group is one matrix of a [E*(S-1), ...] view: ``a`` [E, S-1, R, in], ``b`` [E, S-1, out, R]; adapter
    slot s (1..S-1) is index s-1 (slot 0, the base model, has no factors)."""

    def __init__(self, num_slots: int, max_rank: int, num_experts: int, out_features: int, in_features: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.max_rank = max_rank
        rank = _round_up(max_rank, RANK_ALIGN)
        # Off the Triton devices A is stored in-major ([in, R] per group): the CPU's batched matmuls read a
        # contiguous right operand about 1.5x faster than a transposed one (rank 16, hidden 256). ``a`` is the
        # [E, S-1, R, in] view either way; the Triton kernel takes it contiguous.
        if torch.device(device).type not in TRITON_DELTA_DEVICES:
            self.a = torch.zeros(num_experts, num_slots - 1, in_features, rank, dtype=dtype,
                                 device=device).transpose(-2, -1)
        else:
            self.a = torch.zeros(num_experts, num_slots - 1, rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_experts, num_slots - 1, out_features, rank, dtype=dtype, device=device)

    @property
    def num_slots(self) -> int:
        """Slots, the base model's included."""
        return self.a.shape[1] + 1

    def load(self, slot: int, pair: ExpertFactors | None, experts: slice = slice(None)) -> None:
        """Write an adapter's per-expert factors into ``slot``; ``experts``: the rows this rank holds (EP)."""
        assert slot > 0, "slot 0 is the base model"
        self.a[:, slot - 1].zero_()
        self.b[:, slot - 1].zero_()
        if pair is None:
            return
        a, b = pair.a[experts], pair.b[experts]  # [E_local, r, in], [E_local, out, r]
        rank = a.shape[1]
        if rank > self.max_rank or a.shape[0] != self.a.shape[0] or b.shape[1] != self.b.shape[2]:
            raise ValueError(f"expert LoRA factors {tuple(a.shape)}, {tuple(b.shape)} do not fit "
                             f"{(self.b.shape[0], self.b.shape[2], self.a.shape[3])} at rank <= {self.max_rank}")
        self.a[:, slot - 1, :rank] = a.to(self.a.dtype)
        self.b[:, slot - 1, :, :rank] = b.to(self.b.dtype)

    def add_delta(self, x: torch.Tensor, pairs: ExpertPairs, out: torch.Tensor) -> torch.Tensor:
        """out [N, out] += each adapter pair's delta on x [N, in] (both in ``pairs``' sorted order): the factors
        of the pair's expert under its token's adapter. Returns out.

        On ``TRITON_DELTA_DEVICES``: the Triton kernel, every group in one launch. Few rows per group
        (``pairs.rows``): two batched matmuls over the groups padded to one size. Otherwise two grouped matmuls
        over the groups, or where ``torch._grouped_mm`` does not run, a pair of matmuls per group (reading the
        group sizes back)."""
        num_experts, adapters, rank, fan_in = self.a.shape
        a = self.a.flatten(0, 1)  # [G, R, in] (a view: in-major storage flattens its two leading dims alike)
        b = self.b.view(num_experts * adapters, -1, rank)  # [G, out, R]
        if pairs.adapted.shape[0] == 0:
            return out
        if x.device.type in TRITON_DELTA_DEVICES and x.stride(1) == 1 and out.stride(1) == 1 and x.dtype == a.dtype:
            from engine.kernels.lora_experts import expert_lora_delta  # Triton: imported where it runs

            return expert_lora_delta(x, pairs.adapted, pairs.ends, a, b, out, pairs.max_rows)
        if pairs.rows:
            xp = x.index_select(0, pairs.padded_source).view(a.shape[0], pairs.rows, fan_in)  # [G, M, in]
            low = torch.bmm(xp, a.transpose(1, 2))  # [G, M, R]
            delta = torch.bmm(low, b.transpose(1, 2)).view(-1, b.shape[1])  # [G*M, out]
            return out.index_add_(0, pairs.adapted, delta.index_select(0, pairs.padded_rows).to(out.dtype))
        xa = x.index_select(0, pairs.adapted)  # [N_a, in]
        if _grouped_ok(x, fan_in, rank, out.shape[1]) and x.dtype == a.dtype:
            low = torch._grouped_mm(xa, a.transpose(-2, -1), offs=pairs.ends)  # [N_a, R]
            delta = torch._grouped_mm(low, b.transpose(-2, -1), offs=pairs.ends)  # [N_a, out]
        else:
            delta = xa.new_empty(xa.shape[0], out.shape[1])  # [N_a, out]
            start = 0
            for group, end in enumerate(pairs.ends.tolist()):
                rows = slice(start, end)
                delta[rows] = (xa[rows] @ a[group].T) @ b[group].T  # [c, R] -> [c, out]
                start = end
        return out.index_add_(0, pairs.adapted, delta.to(out.dtype))

    def add_expert_delta(self, expert: int, x: torch.Tensor, counts: list[int], out: torch.Tensor) -> torch.Tensor:
        """out [n, out] += the deltas of one expert on x [n, in], whose rows run adapter by adapter: ``counts[i]``
        rows of slot i+1 (host counts). Two grouped matmuls over the adapters where ``torch._grouped_mm`` runs,
        else a pair of matmuls per adapter. Returns out."""
        a, b = self.a[expert], self.b[expert]  # [S-1, R, in], [S-1, out, R]
        if _grouped_ok(x, a.shape[2], a.shape[1], out.shape[1]) and x.dtype == a.dtype and x.stride(1) == 1:
            ends = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=x.device)  # [S-1]
            low = torch._grouped_mm(x, a.transpose(-2, -1), offs=ends)  # [n, R]
            return out.add_(torch._grouped_mm(low, b.transpose(-2, -1), offs=ends).to(out.dtype))
        start = 0
        for adapter, count in enumerate(counts):
            if count:
                rows = slice(start, start + count)
                out[rows] += ((x[rows] @ a[adapter].T) @ b[adapter].T).to(out.dtype)  # [c, R] -> [c, out]
            start += count
        return out


class LoraStep:
    """The current step's adapter layout, shared by every adapted layer: set by the runner before the forward,
    cleared after (None: no token of the step uses an adapter, the layers skip the deltas)."""

    __slots__ = ("batch",)

    def __init__(self) -> None:
        self.batch: LoraBatch | None = None


@dataclass(frozen=True, slots=True)
class AttentionLora:
    """An attention block's slot tables (packed qkv_proj, o_proj) and the shared step layout."""

    qkv: LinearSlots
    o: LinearSlots
    step: LoraStep


@dataclass(frozen=True, slots=True)
class ExpertsLora:
    """A MoE block's routed-expert slot tables (w13, w2) and the shared step layout."""

    w13: ExpertSlots
    w2: ExpertSlots
    step: LoraStep


@dataclass(frozen=True, slots=True)
class MlpLora:
    """A dense SwiGLU MLP's (dense layer or shared expert) slot tables (packed gate_up_proj, down_proj)."""

    gate_up: LinearSlots
    down: LinearSlots
    step: LoraStep
