"""Serving LoRA adapters beside the base model: each adapted layer gets slot tables, each request a slot.

Every attention block's qkv_proj and o_proj, every dense MLP and shared expert, and every MoE block's routed
experts (whole and unquantized) get slot tables at start (slot 0 is the base model, 1..max_loras adapters), so an
adapter added while serving may adapt any of them. Which adapter sits in which slot is decided by the scheduler
(``engine.core.lora_residency``); every rank writes the same slot (``load_into_slot``) from its host copy of the
factors (``engine.lora.host_cache``) between steps. Each step the runner sets the per-token slot layout before the
forward.
"""

import time

import torch
from torch import nn

from engine.core.lora_residency import LoraLoad
from engine.core.scheduler import ScheduledRequest
from engine.layers.attention import Attention
from engine.layers.mlp import GatedMLP
from engine.layers.moe import SparseMoeBlock
from engine.lora.host_cache import HostLoraCache
from engine.lora.peft_format import LoraAdapter, load_adapter
from engine.lora.slots import AttentionLora, ExpertSlots, ExpertsLora, LinearSlots, LoraBatch, LoraStep, MlpLora


class LoraAdapters:
    """The slot tables bound into the model's layers, which adapter each slot holds, and the host copies."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int,
                 num_experts: int | None, hidden_size: int) -> None:
        if getattr(model, "tp", None) is not None and model.tp.size > 1:
            raise ValueError("lora_adapters: serving adapters under tensor parallelism is not supported yet")
        self.step = LoraStep()
        self.max_rank = max_rank
        self.slots: dict[str, int] = {}  # adapter -> the slot it was last written into (this rank's tables)
        self._num_experts, self._hidden_size = num_experts, hidden_size
        moe = next((m for m in model.modules() if isinstance(m, SparseMoeBlock)), None)
        self._expert_size = moe.experts.w2.shape[2] if moe is not None else None  # I (whole: no TP with adapters)
        self.linears: dict[str, LinearSlots] = {}  # target module -> its slot table
        self.experts: dict[str, ExpertSlots] = {}
        self.unserved_experts = ""  # why routed experts have no tables ("" where they have)
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        for module_name, module in model.named_modules():
            if isinstance(module, SparseMoeBlock):
                self._bind_experts(module_name, module, max_loras, max_rank)
            if isinstance(module, GatedMLP):
                self._bind_mlp(module_name, module, max_loras, max_rank)
            if not isinstance(module, Attention):
                continue
            q, kv = module.q_size, module.kv_size
            qkv = LinearSlots(max_loras + 1, max_rank, module.qkv_proj.in_features,
                              [(0, q), (q, q + kv), (q + kv, q + 2 * kv)], dtype, device)
            o = LinearSlots(max_loras + 1, max_rank, module.o_proj.in_features,
                            [(0, module.o_proj.out_features)], dtype, device)
            module.lora = AttentionLora(qkv, o, self.step)
            self.linears[f"{module_name}.qkv_proj"], self.linears[f"{module_name}.o_proj"] = qkv, o
        self.host = HostLoraCache(max_cpu_loras, self.read)
        self.slot_load_seconds = 0.0  # cumulative host time of the slot writes (host-to-device copies)

    def _bind_mlp(self, name: str, mlp: GatedMLP, max_loras: int, max_rank: int) -> None:
        w = mlp.gate_up_proj.weight  # [2I, H]
        half = w.shape[0] // 2
        gate_up = LinearSlots(max_loras + 1, max_rank, w.shape[1], [(0, half), (half, 2 * half)], w.dtype, w.device)
        down = LinearSlots(max_loras + 1, max_rank, mlp.down_proj.in_features, [(0, mlp.down_proj.out_features)],
                           w.dtype, w.device)
        mlp.lora = MlpLora(gate_up, down, self.step)
        self.linears[f"{name}.gate_up_proj"], self.linears[f"{name}.down_proj"] = gate_up, down

    def _bind_experts(self, name: str, block: SparseMoeBlock, max_loras: int, max_rank: int) -> None:
        if block.dispatch is not None or block.experts.w13_scale is not None:
            self.unserved_experts = (" (LoRA on routed experts is served with whole, unquantized experts only: no "
                                     "expert parallelism, no quantized experts, for now)")
            return
        w13, w2 = block.experts.w13, block.experts.w2  # [E, 2I, H], [E, H, I]
        num_experts = w13.shape[0]
        w13_slots = ExpertSlots(max_loras + 1, max_rank, num_experts, w13.shape[1], w13.shape[2], w13.dtype, w13.device)
        w2_slots = ExpertSlots(max_loras + 1, max_rank, num_experts, w2.shape[1], w2.shape[2], w2.dtype, w2.device)
        block.lora = ExpertsLora(w13_slots, w2_slots, self.step)
        self.experts[f"{name}.experts.w13"], self.experts[f"{name}.experts.w2"] = w13_slots, w2_slots

    def read(self, name: str, path: str) -> LoraAdapter:
        """Read and check the adapter at ``path`` (host memory); ValueError (one line) if this engine cannot serve
        it: not a PEFT LoRA directory, a rank above ``max_lora_rank``, or a module without slot tables."""
        adapter = load_adapter(name, path, self._num_experts, self._hidden_size, self._expert_size)
        if adapter.rank > self.max_rank:
            raise ValueError(f"lora adapter {name}: rank {adapter.rank} > max_lora_rank {self.max_rank}")
        unserved = sorted((set(adapter.linears) - set(self.linears)) | (set(adapter.experts) - set(self.experts)))
        if unserved:  # serving it without them would be a silently different model
            raise ValueError(f"lora adapter {name} adapts {unserved[0]}, which this engine does not adapt"
                             f"{self.unserved_experts if unserved[0] in adapter.experts else ''}")
        for target, parts in adapter.linears.items():
            table = self.linears[target]
            for part, pair in parts.items():
                lo, hi = table.part_rows[part]
                if pair.b.shape[0] != hi - lo or pair.a.shape[1] != table.a.shape[2]:
                    raise ValueError(f"lora adapter {name}: {target} factors {tuple(pair.a.shape)}, "
                                     f"{tuple(pair.b.shape)} do not fit the base model's {hi - lo} x {table.a.shape[2]}")
        return adapter

    def load_into_slot(self, slot: int, name: str, path: str) -> None:
        """Write adapter ``name`` into ``slot`` of every table (zeros where it adapts nothing): a host-to-device
        copy of its factors, between two steps; the slot's previous adapter is no longer resident."""
        adapter = self.host.take(name, path)
        for target, table in self.linears.items():
            table.load(slot, adapter.linears.get(target))
        for target, table in self.experts.items():
            table.load(slot, adapter.experts.get(target))
        for other in [n for n, s in self.slots.items() if s == slot]:
            del self.slots[other]
        self.slots[name] = slot

    def apply(self, loads: tuple[LoraLoad, ...] | list[LoraLoad]) -> None:
        """A step's slot writes (the scheduler's decision, the same on every rank)."""
        start = time.perf_counter()
        for load in loads:
            self.load_into_slot(load.slot, load.name, load.path)
        self.slot_load_seconds += time.perf_counter() - start

    def begin_step(self, scheduled: list[ScheduledRequest], ranges: tuple[tuple[int, int], ...],
                   num_tokens: int, device: torch.device) -> None:
        """Set the step's per-token slots from each scheduled request's adapter (none: the layers skip LoRA)."""
        slot_ids = [0] * num_tokens  # [T]
        any_adapter = False
        for item, (start, end) in zip(scheduled, ranges):
            name = item.request.policy.lora_adapter if item.request is not None else None
            if name is not None:
                slot_ids[start:end] = [self.slots[name]] * (end - start)
                any_adapter = True
        self.step.batch = LoraBatch.build(slot_ids, device) if any_adapter else None

    def end_step(self) -> None:
        self.step.batch = None
