"""Dense SwiGLU MLP (shared experts, and dense layers of mixed models)."""

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.collectives import SINGLE, TensorParallel
from engine.lora.slots import MlpLora
from moe_kernels.activation import SILU, ExpertActivation, gated_activation


class GatedMLP(nn.Module):
    """SwiGLU; tensor parallel: gate/up column-parallel and down row-parallel over the intermediate size.

    With ``reduce`` the output is summed over the ranks here; without, the caller sums it
    (the MoE block adds its shared expert's partial output to the experts' before one all-reduce).
    ``activation``: the gated activation (``moe_kernels.activation``; Step-3.7-Flash clamps some layers').
    """

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel = SINGLE,
                 reduce: bool = True, activation: ExpertActivation = SILU) -> None:
        super().__init__()
        self.tp, self.reduce, self.activation = tp, reduce, activation
        intermediate_size = tp.shard(intermediate_size, "the MLP intermediate size")[1]
        # Packed gate then up rows, loaded from gate_proj/up_proj.
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.lora: MlpLora | None = None  # LoRA slot tables (engine.worker.lora_setup); None: no adapters served

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = self.lora.step.batch if self.lora is not None else None
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if batch is not None:
            gate_up = self.lora.gate_up.add_delta(x, gate_up, batch)
        if self.activation == SILU:
            gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
            hidden = F.silu(gate) * up
        else:
            hidden = gated_activation(gate_up, self.activation)  # [T, I]
        out = self.down_proj(hidden)  # [T, H], this rank's part of the sum
        if batch is not None:
            out = self.lora.down.add_delta(hidden, out, batch)
        return self.tp.all_reduce(out) if self.reduce else out
