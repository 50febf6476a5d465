"""The sparse MoE block: router, routed experts via moe_kernels, optional shared expert (gated or not)."""

import torch
from torch import nn

import moe_kernels
from engine.distributed.collectives import SINGLE, TensorParallel
from engine.layers.mlp import GatedMLP
from engine.lora.experts import lora_experts
from engine.lora.slots import ExpertsLora, LoraBatch
from moe_kernels.activation import SILU, ExpertActivation
from moe_kernels.quant import QuantScheme, quantize
from moe_kernels.routing import RoutingSpec


def target_device(fn, tensor: torch.Tensor) -> torch.device:
    """Where ``nn.Module._apply``'s ``fn`` sends ``tensor``: read from what it does to an empty tensor on the same
    device. A dtype-only cast (``model.to(bfloat16)`` after ``model.to("cuda")``) keeps the tensor's device, so the
    probe must start there, not on the CPU."""
    return fn(torch.empty(0, dtype=tensor.dtype, device=tensor.device)).device


class ExpertWeights(nn.Module):
    """Packed expert weights: w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]; with ``bias`` (gpt-oss)
    also w13_bias [E, 2I] (gate then up) and w2_bias [E, H], which stay in float when the weights are quantized.

    After ``quantize_(scheme)`` they are 8-bit (``scheme.dtype``) with float32 ``w13_scale`` and ``w2_scale``
    (layouts in ``moe_kernels.quant``), or MXFP4 (packed uint8 w13 [E, 2I, H/2], w2 [E, H, I/2] with uint8 scales,
    ``moe_kernels.mxfp4``); ``kernel_args()`` is what ``moe_kernels.fused_moe`` then needs.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size)) if bias else None
        self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None
        self.register_parameter("w13_scale", None)
        self.register_parameter("w2_scale", None)
        self.scheme: QuantScheme | None = None

    @torch.no_grad()
    def quantize_(self, scheme: QuantScheme) -> None:
        """Replace the float weights by their 8-bit form, one expert at a time (so the float32 temporaries of
        quantizing stay one expert's size). Works on the meta device (shapes only)."""
        for name, halves in (("w13", 2), ("w2", 1)):
            weight = getattr(self, name)
            q = torch.empty(scheme.stored_shape(tuple(weight.shape)), dtype=scheme.dtype, device=weight.device)
            scales = []
            for e in range(weight.shape[0]):
                q_e, s_e = quantize(weight[e], scheme, halves)
                if not q.is_meta:
                    q[e].copy_(q_e)
                scales.append(s_e)
            scale = torch.stack(scales) if scales else torch.empty(0, dtype=torch.float32, device=weight.device)
            setattr(self, name, nn.Parameter(q, requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(scale, requires_grad=False))
        self.scheme = scheme

    def kernel_args(self) -> dict:
        """The scale keyword arguments of ``moe_kernels.fused_moe`` for these weights (empty when float)."""
        if self.scheme is None:
            return {}
        return {"w13_scale": self.w13_scale, "w2_scale": self.w2_scale, "block_shape": self.scheme.block}

    def _apply(self, fn, recurse=True):
        if self.scheme is None:
            return super()._apply(fn, recurse)
        # 8-bit weights and their float32 scales only change device: a model-wide cast (``model.to(bfloat16)``)
        # must neither turn float8 back into bfloat16 nor round the scales.
        for name, param in self._parameters.items():
            device = target_device(fn, param)
            moved = torch.empty_like(param, device=device) if param.is_meta else param.detach().to(device)
            self._parameters[name] = nn.Parameter(moved, requires_grad=False)
        return self


class SparseMoeBlock(nn.Module):
    """Legend: T tokens, H hidden, E experts, k top-k.

    ``routing`` says how experts are picked (``moe_kernels.RoutingSpec``); with ``correction_bias`` the
    block holds a float32 ``e_score_correction_bias`` [E] (DeepSeek-V3, GLM-4.5, dots.llm1, MiniMax-M2)
    that routing adds to the scores to choose experts. With ``router_float32`` the router's weight stays
    float32 in a 16-bit model and the logits are computed in float32 (as those checkpoints store and run it):
    the correction bias decides close calls between scores, which 16-bit logits would blur.

    ``shared_expert_size`` > 0 adds a shared expert that every token goes through: scaled by a sigmoid
    gate per token with ``shared_expert_gated`` (Qwen2-MoE), added as is without (DeepSeek, GLM, dots:
    ``n_shared_experts`` experts of ``moe_intermediate_size`` as one MLP of their summed width).

    ``activation``, ``expert_bias`` and ``router_bias`` are gpt-oss's expert variants
    (``moe_kernels.activation``; per-expert biases; a router with a bias).

    Tensor parallel: every rank routes (the router is replicated) and holds a 1/tp slice of
    each expert's intermediate size (and of the shared expert's); the routed and shared partial
    outputs are added, then summed over the ranks in one all-reduce.

    Expert parallel (``tp.expert_parallel`` set): each rank of the experts' group (this replica's
    ranks, or every rank of several data-parallel replicas) holds whole experts, a contiguous run of
    about E/N of them. The tokens (the same on every rank of a replica after attention) are divided
    among the replica's ranks, each rank's share goes through ``ExpertParallel``'s dispatch to the
    ranks holding its experts and back, and the shares are gathered again; the shared expert stays
    split on its intermediate size over the replica's ranks, with its own all-reduce.
    With load balancing (``placement``, ``engine.eplb``) each rank holds S slots instead, some holding
    replicas of hot experts, and every routed pick goes to one replica's slot before the dispatch.
    Expert biases: under tensor parallel the gate/up bias is split with the intermediate size and the
    down bias is added on rank 0 only (the all-reduce would count it once per rank); under expert
    parallel each rank adds its own experts' biases.
    LoRA (``lora``): under tensor parallel each rank's tables hold its slice of every expert's factors; under
    expert parallel its own experts' factors, and each token's adapter slot travels with it through the dispatch.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        routing: RoutingSpec,
        intermediate_size: int,
        backend: str,
        shared_expert_size: int = 0,
        shared_expert_gated: bool = True,
        correction_bias: bool = False,
        router_float32: bool = False,
        tp: TensorParallel = SINGLE,
        activation: ExpertActivation = SILU,
        expert_bias: bool = False,
        router_bias: bool = False,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.dispatch = tp.expert_parallel.dispatch(num_experts) if tp.expert_parallel else None
        if self.dispatch is None:
            intermediate_size = tp.shard(intermediate_size, "the expert intermediate size")[1]
            self.first_expert, local_experts = 0, num_experts
        else:
            self.first_expert, local_experts = tp.expert_parallel.local_experts(num_experts)
        routing.check(num_experts)
        self.routing, self.backend = routing, backend
        self.activation = activation
        self.gate = nn.Linear(hidden_size, num_experts, bias=router_bias)  # router
        if correction_bias:  # a Parameter so that the loader fills it; kept float32 by ``_apply``
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)
        else:
            self.register_parameter("e_score_correction_bias", None)
        # Parameters that a model-wide cast leaves in float32 (``_apply``).
        self.float32_params = ["gate.weight"] * router_float32 + ["e_score_correction_bias"] * correction_bias
        self.experts = ExpertWeights(local_experts, hidden_size, intermediate_size, bias=expert_bias)
        self.shared_expert = GatedMLP(hidden_size, shared_expert_size, tp, reduce=False) if shared_expert_size else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_expert_size and shared_expert_gated else None
        # [E] tokens routed to each expert since start; accumulated on the device, read only for stats.
        self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.routing_backend = "torch"  # engine.transforms.fusion sets "triton": routing and counting in one launch
        # [1] int64 on the device, or None: how many leading rows of the input are real and counted in
        # ``expert_tokens``; a CUDA-graph transform sets it around its padded forwards (``engine.transforms.real_rows``).
        self.count_rows: torch.Tensor | None = None
        # With load balancing (engine.eplb): which slot holds which expert; the dispatch then runs over slots.
        self.placement = None
        self.lora: ExpertsLora | None = None  # routed experts' LoRA slot tables (engine.worker.lora_setup)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x.to(self.gate.weight.dtype))  # [T, E]; float32 with a float32 router
        topk_weights, topk_ids = moe_kernels.route(
            router_logits, self.routing, correction_bias=self.e_score_correction_bias,
            expert_counts=self.expert_tokens, count_rows=self.count_rows, backend=self.routing_backend,
        )  # [T, k]
        if self.dispatch is not None:
            if self.placement is not None:  # load balancing: each pick to one slot holding a replica of its expert
                topk_ids = self.placement.to_physical(topk_ids)  # [T, k] physical slots
            return self._expert_parallel(x, topk_weights, topk_ids)
        batch = self.lora.step.batch if self.lora is not None else None
        if batch is None:
            out = moe_kernels.fused_moe(
                x, self.experts.w13, self.experts.w2, topk_weights, topk_ids, backend=self.backend,
                **self.expert_args(),
            )  # [T, H]
        else:
            out = self._experts_with_lora(x, topk_weights, topk_ids, batch)

        if self.shared_expert is not None:
            out = out + self._shared(x)
        return self.tp.all_reduce(out)

    @property
    def top_k(self) -> int:
        return self.routing.top_k

    def expert_args(self) -> dict:
        """``fused_moe``'s keyword arguments for this rank's experts: scales, activation, biases."""
        args = dict(self.experts.kernel_args(), activation=self.activation)
        if self.experts.w13_bias is not None:
            args["w13_bias"] = self.experts.w13_bias
            # Split on the intermediate size, every rank's partial sum would carry the whole down bias.
            whole_experts = self.dispatch is not None or self.tp.rank == 0
            args["w2_bias"] = self.experts.w2_bias if whole_experts else None
        return args

    def _experts_with_lora(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                           batch: LoraBatch) -> torch.Tensor:
        """Every token through the LoRA-aware experts, base-model tokens with slot 0's zero deltas: no split of
        the batch (which would read its sizes back), one sort of the pairs for the base matmuls and the deltas."""
        args = self.expert_args()
        return lora_experts(x, topk_weights, topk_ids, batch, self.experts.w13, self.experts.w2, self.lora.w13,
                            self.lora.w2, self.activation, args.get("w13_bias"), args.get("w2_bias"))

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared_expert(x)  # [T, H], this rank's partial sum
        return out if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * out

    def _apply(self, fn, recurse=True):
        # A model-wide cast (``model.to(bfloat16)``) must not round the float32 routing parameters (see the class
        # docstring); they follow the device only. ``_apply`` may overwrite a parameter's data in place: keep copies.
        if not self.float32_params:
            return super()._apply(fn, recurse)
        kept = {name: self.get_parameter(name).detach().clone() for name in self.float32_params}
        super()._apply(fn, recurse)
        for name, value in kept.items():
            device = target_device(fn, value)
            moved = torch.empty_like(value, device=device) if value.is_meta else value.to(device)
            owner, _, leaf = name.rpartition(".")
            setattr(self.get_submodule(owner) if owner else self, leaf, nn.Parameter(moved, requires_grad=False))
        return self

    def _expert_parallel(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        tp = self.tp  # this replica's ranks: they hold the same tokens after attention
        counts = tp.split(x.shape[0])  # this step's tokens divided among them (a rank may get none)
        start = sum(counts[:tp.rank])
        mine = slice(start, start + counts[tp.rank])
        # Each token's adapter slot travels with it. The ranks of the experts' group share one plan (adapters are
        # served without data-parallel replicas), so all of them send slots, or none, and the collectives pair up.
        batch = self.lora.step.batch if self.lora is not None else None
        slot_ids = batch.slot_ids[mine] if batch is not None else None
        out = self.dispatch.run(x[mine], topk_weights[mine], topk_ids[mine], self._local_experts,
                                slot_ids)  # [T_r, H]
        if x.shape[0] == 0:  # a dummy step (a peer replica has work): every rank of this replica has nothing
            return out
        out = tp.all_gather_rows(out, counts)  # [T, H]
        if self.shared_expert is not None:
            out = out + tp.all_reduce(self._shared(x))
        return out

    def _local_experts(self, x: torch.Tensor, local_ids: torch.Tensor,
                       slot_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [S, H] slots, local_ids [S] -> [S, H]: each slot through one of this rank's experts, unweighted;
        with ``slot_ids`` [S] (LoRA adapter slots from the dispatch) each adapter slot with its adapter's delta."""
        if x.shape[0] == 0:
            return x.new_zeros(x.shape)
        ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)  # [S, 1]
        if slot_ids is not None and self.lora is not None and self.lora.step.batch is not None:
            args = self.expert_args()
            # The slots came from other ranks: their layout is read back once per layer (as the dispatch's
            # split sizes are), so the grouped deltas see the same host-built layout as the local step's.
            batch = LoraBatch.build(slot_ids.tolist(), x.device)
            return lora_experts(x, ones, local_ids[:, None].to(torch.int64), batch, self.experts.w13,
                                self.experts.w2, self.lora.w13, self.lora.w2, self.activation,
                                args.get("w13_bias"), args.get("w2_bias"))
        return moe_kernels.fused_moe(x, self.experts.w13, self.experts.w2, ones, local_ids[:, None], backend=self.backend,
                                     **self.expert_args())
