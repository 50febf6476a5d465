"""Device-resident adapter slots of one target module, and the batched deltas of a batch that mixes them.

Slot 0 is the base model (all zeros, never written); slots 1..max_loras hold resident adapters. Ranks below
``max_rank`` are zero-padded, which leaves the delta exact. A step's tokens each carry a slot index; the
deltas are computed per adapter present in the batch (gathered matmuls over that adapter's rows), so one
forward serves the base model and any mix of resident adapters. Legend: T tokens, S slots, R max rank,
P packed parts, E experts, N (token, expert) pairs.
"""

from dataclasses import dataclass

import torch

from engine.lora.peft_format import ExpertsLora as ExpertFactors, LinearLora


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """One step's adapter layout, built once on the host: ``slot_ids`` [T] (0: base model), and for each adapter
    slot present, the rows of its tokens (``groups``: (slot, rows [T_s])); empty when no token uses one."""

    slot_ids: torch.Tensor
    groups: tuple[tuple[int, torch.Tensor], ...]

    @staticmethod
    def build(slot_ids: list[int], device: torch.device | str = "cpu") -> "LoraBatch":
        """From the host list of per-token slots: the groups are found on the host (no device sync)."""
        rows: dict[int, list[int]] = {}
        for t, s in enumerate(slot_ids):
            if s:
                rows.setdefault(s, []).append(t)
        return LoraBatch(torch.tensor(slot_ids, device=device),
                         tuple((s, torch.tensor(r, device=device)) for s, r in sorted(rows.items())))


class LinearSlots:
    """Stacked factors of one (packed) linear layer: ``a`` [S, P*R, in], ``b`` [S, out, P*R].

    ``part_rows``: the output rows of each packed part ((0, out) for a plain layer; q, k, v rows of a qkv
    projection). Part p's factors use rank columns p*R..(p+1)*R and only its own rows of ``b`` (block-diagonal),
    so one pair per slot is exactly the sum of the sub-projections' deltas.
    """

    def __init__(self, num_slots: int, max_rank: int, in_features: int, part_rows: list[tuple[int, int]],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.max_rank, self.part_rows = max_rank, part_rows
        width = len(part_rows) * max_rank
        out = part_rows[-1][1]
        self.a = torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)  # [S, P*R, in]
        self.b = torch.zeros(num_slots, out, width, dtype=dtype, device=device)  # [S, out, P*R]

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
        """out [T, out] += each token's adapter delta of x [T, in]; returns out."""
        for slot, rows in batch.groups:
            low = x[rows] @ self.a[slot].T  # [T_s, P*R]
            out.index_add_(0, rows, low @ self.b[slot].T)  # [T_s, out]
        return out


class ExpertSlots:
    """Stacked per-expert factors of one fused expert tensor [E, out, in]: ``a`` [S, E, R, in], ``b`` [S, E, out, R]."""

    def __init__(self, num_slots: int, max_rank: int, num_experts: int, out_features: int, in_features: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.max_rank = max_rank
        self.a = torch.zeros(num_slots, num_experts, max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, num_experts, out_features, max_rank, dtype=dtype, device=device)

    def load(self, slot: int, pair: ExpertFactors | None, experts: slice = slice(None)) -> None:
        """Write an adapter's per-expert factors into ``slot``; ``experts``: the rows this rank holds (EP)."""
        assert slot > 0, "slot 0 is the base model"
        self.a[slot].zero_()
        self.b[slot].zero_()
        if pair is None:
            return
        a, b = pair.a[experts], pair.b[experts]  # [E_local, r, in], [E_local, out, r]
        rank = a.shape[1]
        if rank > self.max_rank or a.shape[0] != self.a.shape[1] or b.shape[1] != self.b.shape[2]:
            raise ValueError(f"expert LoRA factors {tuple(a.shape)}, {tuple(b.shape)} do not fit "
                             f"{tuple(self.b.shape[1:3])} at rank <= {self.max_rank}")
        self.a[slot, :, :rank] = a.to(self.a.dtype)
        self.b[slot, :, :, :rank] = b.to(self.b.dtype)

    def add_delta(self, x: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [N, out] += the delta of expert ``experts[n]`` under adapter ``slots[n]`` on x [N, in].

        Pairs are grouped by (adapter, expert): sorted by that key, each group is one pair of matmuls."""
        key = slots * self.a.shape[1] + experts  # [N]
        used = (slots > 0).nonzero().squeeze(1)
        if used.numel() == 0:
            return out
        order = used[torch.argsort(key[used], stable=True)]  # pair indices, grouped
        keys, counts = torch.unique_consecutive(key[order], return_counts=True)
        start = 0
        num_experts = self.a.shape[1]
        for k, c in zip(keys.tolist(), counts.tolist()):
            rows = order[start:start + c]
            start += c
            s, e = divmod(k, num_experts)
            out.index_add_(0, rows, (x[rows] @ self.a[s, e].T) @ self.b[s, e].T)  # [c, R] -> [c, out]
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
