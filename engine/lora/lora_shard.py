"""This rank's part of an adapter's factors under tensor and expert parallelism, sliced as the base weights are.

A LoRA delta x @ A.T @ B.T follows its base layer's split:
- column-parallel layers (qkv_proj, gate_up_proj, the experts' w13), whose output rows are divided among the
  ranks: A [r, in] whole, B [out, r] cut to this rank's rows (q heads, k/v heads with the same replication of
  too few KV heads as the attention block, the gate and up halves each cut apart);
- row-parallel layers (o_proj, down_proj, the experts' w2), whose input columns are divided: A cut to this rank's
  columns, B whole; each rank's partial delta joins its partial matmul before the layer's all-reduce, which then
  sums the deltas too (no bias-style rank-0 rule: the delta is a product of the split input, like the matmul);
- expert parallelism: the experts' factors of this rank's own experts only (``expert_rows``).
``rank_slice`` applies these to a whole adapter as it is read, so slot tables only ever see this rank's part.
Legend: E experts, I an expert's intermediate size, r the adapter's rank.
"""

import torch
from torch import nn

from engine.distributed.collectives import TensorParallel
from engine.lora.peft_format import ExpertsLora, LinearLora, LoraAdapter


def _rows(pair: LinearLora, start: int, n: int) -> LinearLora:
    return LinearLora(pair.a, pair.b[start:start + n].clone())  # b [n, r]; a copy: the whole may be freed


def _cols(pair: LinearLora, start: int, n: int) -> LinearLora:
    return LinearLora(pair.a[:, start:start + n].clone(), pair.b)  # a [r, n]


def shard_qkv(parts: dict[int, LinearLora] | None, tp: TensorParallel, num_heads: int, num_kv_heads: int,
              total_kv_heads: int, head_dim: int) -> dict[int, LinearLora] | None:
    """q (0), k (1), v (2) pairs of a packed qkv_proj -> this rank's rows of each B. ``num_heads``,
    ``num_kv_heads``: this rank's (the attention block's); ``total_kv_heads``: the model's."""
    if parts is None or tp.size == 1:
        return parts
    replicated = total_kv_heads < tp.size  # rank r holds KV head r * kvh // tp, as the loader reads it
    kv_first = tp.rank * total_kv_heads // tp.size if replicated else tp.rank * num_kv_heads
    starts = {0: (tp.rank * num_heads * head_dim, num_heads * head_dim),
              1: (kv_first * head_dim, num_kv_heads * head_dim), 2: (kv_first * head_dim, num_kv_heads * head_dim)}
    return {p: _rows(pair, *starts[p]) for p, pair in parts.items()}


def shard_out_rows(parts: dict[int, LinearLora] | None, tp: TensorParallel) -> dict[int, LinearLora] | None:
    """Column-parallel pairs cut evenly by output rows, each packed part on its own (gate_up_proj's halves)."""
    return _cut_evenly(parts, tp, by_rows=True)


def shard_in_cols(parts: dict[int, LinearLora] | None, tp: TensorParallel) -> dict[int, LinearLora] | None:
    """Row-parallel pairs (o_proj, down_proj) cut evenly by input columns."""
    return _cut_evenly(parts, tp, by_rows=False)


def _cut_evenly(parts: dict[int, LinearLora] | None, tp: TensorParallel, by_rows: bool) -> dict[int, LinearLora] | None:
    if parts is None or tp.size == 1:
        return parts
    out = {}
    for p, pair in parts.items():
        n = (pair.b.shape[0] if by_rows else pair.a.shape[1]) // tp.size
        out[p] = (_rows if by_rows else _cols)(pair, tp.rank * n, n)
    return out


def shard_experts(pair: ExpertsLora | None, tensor: str, tp: TensorParallel) -> ExpertsLora | None:
    """Fused-expert factors (a [E, r, in], b [E, out, r]) of ``tensor`` ("w13" or "w2") cut on the experts'
    intermediate size as the tensor-parallel ranks hold it: w13's B rows (gate and up halves each), w2's A columns.
    Under expert parallelism the experts are whole: pass ``tp`` of size 1 and slice by ``expert_rows``."""
    if pair is None or tp.size == 1:
        return pair
    r = tp.rank
    if tensor == "w2":
        n = pair.a.shape[2] // tp.size
        return ExpertsLora(pair.a[:, :, r * n:(r + 1) * n].clone(), pair.b)
    half = pair.b.shape[1] // 2  # I: gate rows, then up rows
    n = half // tp.size
    gate, up = pair.b[:, r * n:(r + 1) * n], pair.b[:, half + r * n:half + (r + 1) * n]  # [E, I/tp, r] each
    return ExpertsLora(pair.a, torch.cat([gate, up], dim=1))  # b [E, 2I/tp, r]


def expert_rows(first_expert: int, num_local: int) -> slice:
    """The experts this rank holds (expert parallelism): rows of the factors' expert dimension."""
    return slice(first_expert, first_expert + num_local)


def rank_slice(adapter: LoraAdapter, model: nn.Module) -> LoraAdapter:
    """This rank's part of a whole adapter (as ``peft_format.load_adapter`` reads it), under the same names: each
    target cut as ``model``'s layer of that name holds its weights (the module's ``tp``; an MoE block's
    ``dispatch``/``first_expert`` under expert parallelism). Targets the model has no layer for are kept whole
    (the caller refuses them as unserved). On one process the adapter itself."""
    tp = getattr(model, "tp", None)
    if tp is None or tp.size == 1:
        return adapter
    out = LoraAdapter(adapter.name, adapter.rank)
    for target, parts in adapter.linears.items():
        owner, _, leaf = target.rpartition(".")
        module = _module(model, owner)
        if module is None:
            out.linears[target] = parts
        elif leaf == "qkv_proj":
            out.linears[target] = shard_qkv(parts, module.tp, module.num_heads, module.num_kv_heads,
                                            module.total_kv_heads, module.head_dim)
        elif leaf == "gate_up_proj":
            out.linears[target] = shard_out_rows(parts, module.tp)
        else:  # o_proj, down_proj
            out.linears[target] = shard_in_cols(parts, module.tp)
    for target, pair in adapter.experts.items():
        owner, _, tensor = target.rpartition(".experts.")
        block = _module(model, owner)
        if block is None:
            out.experts[target] = pair
        elif block.dispatch is not None:  # expert parallel: whole experts, this rank's run of them
            rows = expert_rows(block.first_expert, block.experts.w13.shape[0])
            out.experts[target] = ExpertsLora(pair.a[rows].clone(), pair.b[rows].clone())
        else:
            out.experts[target] = shard_experts(pair, tensor, block.tp)
    return out


def _module(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
