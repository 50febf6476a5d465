"""Expert parallelism: the routed experts divided whole among a group's ranks, tokens moved to them and back.

Legend: T tokens this rank brings (may be 0, and differ between ranks), H hidden, k top-k,
S token slots (one token routed to one expert), E experts, N ranks.

Every rank calls ``ExpertParallel.run`` in every MoE layer of every step, with
whatever tokens it has, zero included: the collectives inside need every rank,
so a rank with nothing to compute still takes part and nothing waits forever.

Two ways to move tokens, behind one interface (``Dispatch``):
- ``AllGatherDispatch``: every rank gathers every rank's tokens, computes the
  slots that route to its experts, and the outputs are reduce-scattered back
  (simple, moves T*N rows each way);
- ``AllToAllDispatch``: each slot travels once, to its expert's rank, and its
  output once back (``all_to_all_single`` with uneven splits; moves S rows).
"""

import abc

import torch

from engine.distributed.collectives import TensorParallel

class Dispatch(abc.ABC):
    """Moves each rank's token slots to the ranks holding their experts, and the outputs back."""

    def __init__(self, tp: TensorParallel, expert_starts: list[int]) -> None:
        self.tp = tp
        self.expert_starts = expert_starts  # [N + 1]: rank i holds experts [starts[i], starts[i+1])

    @abc.abstractmethod
    def run(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts,
            slot_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H], topk_weights/topk_ids [T, k] (global expert ids) -> [T, H]: the weighted sum of each
        token's experts' outputs, for this rank's own tokens. ``experts(x [S, H], local_ids [S]) -> [S, H]``
        runs slots through this rank's experts, unweighted. With ``slot_ids`` [T] (each token's LoRA adapter
        slot, 0: the base model) the slots carry their token's adapter along: ``experts(x, local_ids,
        slot_ids [S])``. Every rank of the group passes ``slot_ids`` or none (the collectives pair up)."""


class AllGatherDispatch(Dispatch):
    def run(self, x, topk_weights, topk_ids, experts, slot_ids=None):
        tp, device = self.tp, x.device
        counts = tp.gather_counts(x.shape[0], device)
        most = max(counts)
        every_x = tp.all_gather_rows(_pad_rows(x, most), [most] * tp.size)  # [N * max T, H]
        every_ids = tp.all_gather_rows(_pad_rows(topk_ids, most, fill=-1), [most] * tp.size)  # [N * max T, k]
        every_w = tp.all_gather_rows(_pad_rows(topk_weights, most), [most] * tp.size)  # [N * max T, k]
        start, end = self.expert_starts[tp.rank], self.expert_starts[tp.rank + 1]
        mine = (every_ids >= start) & (every_ids < end)  # [N * max T, k]; padding rows hold -1: never mine
        token, slot = mine.nonzero(as_tuple=True)  # [S], [S]
        local_ids = every_ids[token, slot] - start  # [S]
        if slot_ids is None:
            y = experts(every_x.index_select(0, token), local_ids)  # [S, H]
        else:
            every_slots = tp.all_gather_rows(_pad_rows(slot_ids, most), [most] * tp.size)  # [N * max T]
            y = experts(every_x.index_select(0, token), local_ids, every_slots.index_select(0, token))
        out = torch.zeros(every_x.shape, dtype=torch.float32, device=device)  # [N * max T, H]
        out.index_add_(0, token, y.float() * every_w[token, slot].float()[:, None])
        return tp.reduce_scatter_rows(out)[:x.shape[0]].to(x.dtype)  # [T, H]


class AllToAllDispatch(Dispatch):
    def run(self, x, topk_weights, topk_ids, experts, slot_ids=None):
        tp, device = self.tp, x.device
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1).to(torch.int64)  # [T*k]
        starts = torch.tensor(self.expert_starts, dtype=torch.int64, device=device)  # [N + 1]
        owner = torch.bucketize(flat_ids, starts, right=True) - 1  # [T*k]: rank holding each slot's expert
        owner_sorted, order = torch.sort(owner, stable=True)  # slots grouped by destination rank
        send_counts = torch.bincount(owner_sorted, minlength=tp.size)  # [N]
        recv_counts = tp.exchange_counts(send_counts)
        send_counts = send_counts.tolist()
        token = order // top_k  # [S] the token of each slot, in send order
        local_ids = flat_ids.index_select(0, order) - starts.index_select(0, owner_sorted)  # [S]
        recv_x = tp.all_to_all_rows(x.index_select(0, token), send_counts, recv_counts)  # [S_in, H]
        recv_ids = tp.all_to_all_rows(local_ids.to(torch.int32), send_counts, recv_counts)  # [S_in]
        if slot_ids is None:
            y = experts(recv_x, recv_ids)  # [S_in, H]
        else:  # each slot's adapter travels with it
            recv_slots = tp.all_to_all_rows(slot_ids.index_select(0, token).to(torch.int32), send_counts, recv_counts)
            y = experts(recv_x, recv_ids, recv_slots.to(torch.int64))  # [S_in, H]
        back = tp.all_to_all_rows(y, recv_counts, send_counts)  # [S, H] in send order
        weights = topk_weights.reshape(-1).index_select(0, order).float()  # [S]
        out = torch.zeros(x.shape, dtype=torch.float32, device=device)  # [T, H]
        out.index_add_(0, token, back.float() * weights[:, None])
        return out.to(x.dtype)


def _pad_rows(t: torch.Tensor, rows: int, fill: float = 0) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    padded = t.new_full((rows, *t.shape[1:]), fill)
    padded[:t.shape[0]] = t
    return padded


class ExpertParallel:
    """How a group divides ``num_experts`` routed experts: rank i holds a contiguous run of them
    (``split``: the first ``E % N`` ranks one more), and the dispatch that moves tokens there."""

    DISPATCH = {"all_gather": AllGatherDispatch, "all_to_all": AllToAllDispatch}

    def __init__(self, tp: TensorParallel, dispatch: str = "all_to_all") -> None:
        """``tp``: the group the experts are divided among: one replica's tensor-parallel ranks, or every rank
        of several replicas (each rank brings its share of its replica's tokens)."""
        if dispatch not in self.DISPATCH:
            raise ValueError(f"expert dispatch must be one of {tuple(self.DISPATCH)}, got {dispatch!r}")
        self.tp, self.dispatch_name = tp, dispatch

    def expert_starts(self, num_experts: int) -> list[int]:
        """[N + 1]: rank i holds experts [starts[i], starts[i + 1])."""
        if num_experts < self.tp.size:
            raise ValueError(f"expert parallelism over {self.tp.size} ranks needs at least as many experts, "
                             f"the model has {num_experts}")
        starts = [0]
        for n in self.tp.split(num_experts):
            starts.append(starts[-1] + n)
        return starts

    def local_experts(self, num_experts: int) -> tuple[int, int]:
        """(first, count) of the experts this rank holds."""
        starts = self.expert_starts(num_experts)
        return starts[self.tp.rank], starts[self.tp.rank + 1] - starts[self.tp.rank]

    def dispatch(self, num_experts: int) -> Dispatch:
        return self.DISPATCH[self.dispatch_name](self.tp, self.expert_starts(num_experts))
