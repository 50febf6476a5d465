"""Serving LoRA adapters beside the base model: each adapted layer gets slot tables, each request a slot.

Every attention block's qkv_proj and o_proj, every dense MLP and shared expert, and every MoE block's routed
experts (unquantized) get slot tables at start (slot 0 is the base model, 1..max_loras adapters), so an adapter
added while serving may adapt any of them. Which adapter sits in which slot is decided by the scheduler
(``engine.core.lora_residency``); every rank writes the same slot (``load_into_slot``) from its host copy of the
factors (``engine.lora.host_cache``) between steps, each rank reading its copy in the background as soon as rank 0
begins reading its own (``LoraReads``). Each step the runner sets the per-token slot layout before the
forward. On a split engine every rank holds its slice of each adapter's factors (``engine.lora.lora_shard``: as
the base weights are split, and its own experts under expert parallelism).
"""

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from engine.core.lora_residency import LoraLoad, registered_digest, registered_name, registration_key
from engine.lora.identity import adapter_digest
from engine.core.scheduler import ScheduledRequest
from engine.layers.attention import Attention
from engine.layers.mlp import GatedMLP
from engine.layers.moe import SparseMoeBlock
from engine.lora.host_cache import HostLoraCache
from engine.lora import reader_process
from engine.lora.lora_shard import rank_slice
from engine.lora.peft_format import LoraAdapter, load_adapter
from engine.lora.slots import AttentionLora, ExpertSlots, ExpertsLora, LinearSlots, LoraBatch, LoraStep, MlpLora

logger = logging.getLogger(__name__)


def whole_expert_size(block: SparseMoeBlock) -> int:
    """The experts' intermediate size I as the adapter's factors have it (tensor-parallel ranks hold 1/tp)."""
    local = block.experts.w2.shape[2]  # [E, H, I / tp]
    return local if block.dispatch is not None else local * block.tp.size


class LoraAdapters:
    """The slot tables bound into the model's layers, which adapter each slot holds, and the host copies."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int,
                 num_experts: int | None, hidden_size: int) -> None:
        self.step = LoraStep()
        self.max_rank = max_rank
        self.slots: dict[str, int] = {}  # adapter -> the slot it was last written into (this rank's tables)
        self._num_experts, self._hidden_size = num_experts, hidden_size
        moe = next((m for m in model.modules() if isinstance(m, SparseMoeBlock)), None)
        self._model = model
        self._expert_size = whole_expert_size(moe) if moe is not None else None  # I as the adapters have it
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
            if module.v_size != module.kv_size:  # the adapters' v rows and their split assume v heads of width d
                raise ValueError("LoRA adapters (--enable-lora, --lora-adapters) are not supported for a model whose "
                                 f"value heads are narrower than its query/key heads ({module_name}: v_head_dim "
                                 f"{module.v_head_dim}, head_dim {module.head_dim}); serve it without adapters")
            q, kv = module.q_size, module.kv_size
            qkv = LinearSlots(max_loras + 1, max_rank, module.qkv_proj.in_features,
                              [(0, q), (q, q + kv), (q + kv, q + 2 * kv)], dtype, device)
            o = LinearSlots(max_loras + 1, max_rank, module.o_proj.in_features,
                            [(0, module.o_proj.out_features)], dtype, device)
            module.lora = AttentionLora(qkv, o, self.step)
            self.linears[f"{module_name}.qkv_proj"], self.linears[f"{module_name}.o_proj"] = qkv, o
        # Background reads in a child process (engine.lora.reader_process: a read on a thread of this process
        # would hold the GIL the step loop needs); the check at add time and a rare synchronous read stay here.
        self._reader = reader_process.AdapterReaderProcess() if reader_process.available() else None
        self.host = HostLoraCache(max_cpu_loras, self._as_registered(self.read), background_read=self._as_registered(
            self._read_in_child if self._reader is not None else self.read))
        self._held: set[str] = set()  # the names ``hold`` was asked for, less those ``forget`` was told of
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
        if block.experts.w13_scale is not None:
            self.unserved_experts = (" (LoRA on routed experts is served with unquantized experts only, for now)")
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
        return self._checked(name, load_adapter(name, path, self._num_experts, self._hidden_size, self._expert_size))

    def hold(self, name: str, path: str) -> str:
        """Read and check the adapter (``read``) and keep it in host memory under its registration key, which it
        returns (of its files' content: ``engine.lora.identity``; every rank reads the same files). Once more
        adapters are held (by name, less those removed: ``forget``) than the host has copies for, some will be read
        from disk again while serving: the reader process starts now (``start_reader``), not at the first of those
        reads. Every rank calls this for the configured adapters at start (a follower's copies; rank 0's through
        ``add_lora``, which also calls it, and ``forget``, for adapters added and removed while serving)."""
        digest = adapter_digest(path)
        adapter = self.read(name, path)  # ValueError naming what is wrong
        if digest is None or adapter_digest(path) != digest:  # the factors read may not be what the key names
            raise ValueError(f"lora adapter {name}: its files in {path} changed while they were read: add it again")
        key = registration_key(name, path, digest)
        self.host.put(key, path, adapter)
        self._held.add(name)
        if len(self._held) > self.host.capacity:
            self.start_reader()
        return key

    @staticmethod
    def _as_registered(read: Callable[[str, str], LoraAdapter]) -> Callable[[str, str], LoraAdapter]:
        """``read(key, path)`` for the host copies, which reads an adapter again from disk (after an eviction):
        ValueError (one line) unless the files hold what was added, the content digest in its registration key
        (files replaced while serving are another adapter: served under this key, they would be computed with
        and cached as the old one's). That error fails only the adapter's requests (``HostLoraCache.failures``)."""
        def checked(key: str, path: str) -> LoraAdapter:
            digest = registered_digest(key)
            before = adapter_digest(path) if digest is not None else None
            adapter = read(key, path)  # a read that fails says why (a tensor no longer finite, a file gone)
            if digest is not None and (before != digest or adapter_digest(path) != digest):
                raise ValueError(f"lora adapter {registered_name(key)}: its files in {path} changed since it was "
                                 "added (their content digest differs): add it again to serve the new files")
            return adapter
        return checked

    def forget(self, name: str) -> None:
        """Adapter ``name`` was removed: it no longer counts toward the reader's start (``hold``); its host copy
        goes when the scheduler drops it (``engine.core.lora_residency``)."""
        self._held.discard(name)

    def _read_in_child(self, name: str, path: str) -> LoraAdapter:
        """``read``, the parse done by the reader process (on a thread here, if that process is gone)."""
        try:
            whole = self._reader.read(name, path, self._num_experts, self._hidden_size, self._expert_size)
        except OSError as e:
            logger.warning("%s: reading it here instead", e)
            return self.read(name, path)
        return self._checked(name, whole)

    def _checked(self, name: str, whole: LoraAdapter) -> LoraAdapter:
        """This rank's slices of ``whole`` (under the same names), checked against the slot tables."""
        adapter = rank_slice(whole, self._model)
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

    @property
    def reader_pid(self) -> int | None:
        """The reader process's id while it runs (None if background reads run here or have not started)."""
        return self._reader.pid if self._reader is not None else None

    def start_reader(self) -> None:
        """Start the reader process now (its interpreter's start takes seconds) if background reads use one."""
        if self._reader is not None:
            self._reader.start()

    def close(self) -> None:
        """Stop the background reads (and the reader process)."""
        self.host.close()
        if self._reader is not None:
            self._reader.close()

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

    def prefetch(self, reads: tuple[tuple[str, str], ...]) -> None:
        """Start background reads of (key, directory) pairs rank 0 began reading (a follower's copies)."""
        for key, path in reads:
            self.host.ready(key, path)

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
            name = item.request.policy.lora_adapter if item.request is not None else item.lora_adapter
            if name is not None:
                slot_ids[start:end] = [self.slots[name]] * (end - start)
                any_adapter = True
        self.step.batch = LoraBatch.build(slot_ids, device) if any_adapter else None

    def end_step(self) -> None:
        self.step.batch = None


def serve_adapters(config, model_config, model: nn.Module) -> LoraAdapters | None:
    """Slot tables bound into ``model`` when the engine serves adapters (``lora_enabled``), else None; on every
    rank of a split engine alike (the adapters themselves arrive as slot writes). Such a runner is built without
    CUDA graphs: captured without the per-step adapter layout they would replay the base model."""
    if not config.lora_enabled:
        return None
    mc = model_config
    num_experts = mc.cfg("num_experts") or mc.cfg("num_local_experts") or mc.cfg("n_routed_experts")
    return LoraAdapters(model, config.max_loras, config.max_lora_rank, config.cpu_loras, num_experts, mc.hidden_size)
