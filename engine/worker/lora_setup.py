"""Serving LoRA adapters beside the base model: each adapted layer gets slot tables, each request a slot.

Every adapter named at start is read from its PEFT directory and written into its own slot (1..n; slot 0 is the
base model) of every attention block's qkv_proj and o_proj tables every dense MLP and shared expert, and every MoE block's routed experts, so all of them are resident and one step mixes
any of them with base-model requests. Each step the runner sets the per-token slot layout before the forward.
On a split engine every rank builds its own tables from the same directories, holding its slice of each
adapter's factors (``engine.lora.lora_shard``: as the base weights are split, and its own experts under expert
parallelism).
"""

import torch
from torch import nn

from engine.core.scheduler import ScheduledRequest
from engine.layers.attention import Attention
from engine.layers.mlp import GatedMLP
from engine.layers.moe import SparseMoeBlock
from engine.lora.lora_shard import rank_slice
from engine.lora.peft_format import LoraAdapter, load_adapter
from engine.lora.slots import AttentionLora, ExpertSlots, ExpertsLora, LinearSlots, LoraBatch, LoraStep, MlpLora


def whole_expert_size(block: SparseMoeBlock) -> int:
    """The experts' intermediate size I as the adapter's factors have it (tensor-parallel ranks hold 1/tp)."""
    local = block.experts.w2.shape[2]  # [E, H, I / tp]
    return local if block.dispatch is not None else local * block.tp.size


class LoraAdapters:
    """The resident adapters of one engine: name -> slot, and the slot tables bound into the model's layers."""

    def __init__(self, model: nn.Module, paths: dict[str, str], max_loras: int, max_rank: int,
                 num_experts: int | None, hidden_size: int) -> None:
        self.step = LoraStep()
        self.slots: dict[str, int] = {}
        adapters: list[LoraAdapter] = []
        moe = next((m for m in model.modules() if isinstance(m, SparseMoeBlock)), None)
        expert_size = whole_expert_size(moe) if moe is not None else None
        for name, path in paths.items():
            adapter = rank_slice(load_adapter(name, path, num_experts, hidden_size, expert_size), model)
            if adapter.rank > max_rank:
                raise ValueError(f"lora_adapters: {name} has rank {adapter.rank} > max_lora_rank {max_rank}")
            adapters.append(adapter)
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        bound: set[str] = set()
        for module_name, module in model.named_modules():
            if isinstance(module, SparseMoeBlock) and any(f"{module_name}.experts.w13" in a.experts
                                                          or f"{module_name}.experts.w2" in a.experts for a in adapters):
                bound.update(self._bind_experts(module_name, module, adapters, max_loras, max_rank))
            if isinstance(module, GatedMLP):
                bound.update(self._bind_mlp(module_name, module, adapters, max_loras, max_rank))
            if not isinstance(module, Attention):
                continue
            qkv_name, o_name = f"{module_name}.qkv_proj", f"{module_name}.o_proj"
            q, kv = module.q_size, module.kv_size
            qkv = LinearSlots(max_loras + 1, max_rank, module.qkv_proj.in_features,
                              [(0, q), (q, q + kv), (q + kv, q + 2 * kv)], dtype, device)
            o = LinearSlots(max_loras + 1, max_rank, module.o_proj.in_features,
                            [(0, module.o_proj.out_features)], dtype, device)
            for slot, adapter in enumerate(adapters, start=1):
                qkv.load(slot, adapter.linears.get(qkv_name))
                o.load(slot, adapter.linears.get(o_name))
            module.lora = AttentionLora(qkv, o, self.step)
            bound.update((qkv_name, o_name))
        for adapter in adapters:
            unserved = sorted((set(adapter.linears) | set(adapter.experts)) - bound)
            if unserved:  # serving it without them would be a silently different model
                raise ValueError(f"lora_adapters: {adapter.name} adapts {unserved[0]}, which is not served yet "
                                 "(attention projections are)")
        self.slots = {a.name: slot for slot, a in enumerate(adapters, start=1)}

    def _bind_mlp(self, name: str, mlp: GatedMLP, adapters: list[LoraAdapter], max_loras: int,
                  max_rank: int) -> set[str]:
        gate_up_name, down_name = f"{name}.gate_up_proj", f"{name}.down_proj"
        if not any(gate_up_name in a.linears or down_name in a.linears for a in adapters):
            return set()
        w = mlp.gate_up_proj.weight  # [2I, H]
        half = w.shape[0] // 2
        gate_up = LinearSlots(max_loras + 1, max_rank, w.shape[1], [(0, half), (half, 2 * half)], w.dtype, w.device)
        down = LinearSlots(max_loras + 1, max_rank, mlp.down_proj.in_features, [(0, mlp.down_proj.out_features)],
                           w.dtype, w.device)
        for slot, adapter in enumerate(adapters, start=1):
            gate_up.load(slot, adapter.linears.get(gate_up_name))
            down.load(slot, adapter.linears.get(down_name))
        mlp.lora = MlpLora(gate_up, down, self.step)
        return {gate_up_name, down_name}

    def _bind_experts(self, name: str, block: SparseMoeBlock, adapters: list[LoraAdapter], max_loras: int,
                      max_rank: int) -> set[str]:
        if block.experts.w13_scale is not None:
            raise ValueError("lora_adapters: LoRA on routed experts is served with unquantized experts only "
                             "(no quantized experts) for now")
        w13, w2 = block.experts.w13, block.experts.w2  # [E, 2I, H], [E, H, I]
        num_experts = w13.shape[0]
        w13_slots = ExpertSlots(max_loras + 1, max_rank, num_experts, w13.shape[1], w13.shape[2], w13.dtype, w13.device)
        w2_slots = ExpertSlots(max_loras + 1, max_rank, num_experts, w2.shape[1], w2.shape[2], w2.dtype, w2.device)
        for slot, adapter in enumerate(adapters, start=1):
            w13_slots.load(slot, adapter.experts.get(f"{name}.experts.w13"))
            w2_slots.load(slot, adapter.experts.get(f"{name}.experts.w2"))
        block.lora = ExpertsLora(w13_slots, w2_slots, self.step)
        return {f"{name}.experts.w13", f"{name}.experts.w2"}

    def begin_step(self, scheduled: list[ScheduledRequest], ranges: tuple[tuple[int, int], ...],
                   num_tokens: int, device: torch.device) -> None:
        """Set the step's per-token slots from each scheduled request's adapter (none: the layers skip LoRA)."""
        slot_ids = [0] * num_tokens  # [T]
        any_adapter = False
        for item, (start, end) in zip(scheduled, ranges):
            name = item.request.policy.lora_adapter if item.request is not None else item.lora_adapter
            if name is not None:
                slot_ids[start:end] = [self.slots[name]] * (end - start)
                any_adapter = True
        self.step.batch = LoraBatch.build(slot_ids, device) if any_adapter else None

    def end_step(self) -> None:
        self.step.batch = None


def serve_adapters(config, model_config, runner) -> LoraAdapters | None:
    """The engine config's adapters bound into ``runner``'s model (this rank's slices of them), or None; on every
    rank of a split engine alike. Graphs are turned off: captured without the per-step adapter layout they would
    replay the base model."""
    if not config.lora_adapter_paths:
        return None
    mc = model_config
    num_experts = mc.cfg("num_experts") or mc.cfg("num_local_experts") or mc.cfg("n_routed_experts")
    lora = LoraAdapters(runner.model, config.lora_adapter_paths, config.max_loras, config.max_lora_rank,
                        num_experts, mc.hidden_size)
    runner.lora, runner.decode_graphs, runner.piecewise_graphs = lora, None, None
    return lora
