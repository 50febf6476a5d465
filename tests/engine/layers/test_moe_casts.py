"""The MoE block's float32 routing parameters and 8-bit experts keep their dtype under a model-wide cast and
follow the device. The meta device stands in for CUDA: a dtype-only cast after a move (``model.to("cuda")``
then ``model.to(bfloat16)``) once sent them back to the CPU, and the first GPU run failed with "mat2 is on cpu"
in the router of every family with a float32 router (DeepSeek-V3, GLM-4.5, MiniMax-M2)."""

import torch

from engine.layers.moe import SparseMoeBlock
from moe_kernels.quant import QuantScheme
from moe_kernels.routing_spec import RoutingSpec


def _block() -> SparseMoeBlock:
    spec = RoutingSpec(top_k=2, scoring="sigmoid", renormalize=True)
    block = SparseMoeBlock(16, 4, spec, 8, "torch", correction_bias=True, router_float32=True)
    for p in block.parameters():
        torch.nn.init.normal_(p)
    return block


def test_float32_routing_parameters_follow_the_device_through_a_dtype_cast():
    block = _block().to("meta").to(torch.bfloat16)
    assert block.gate.weight.device.type == "meta" and block.gate.weight.dtype == torch.float32
    assert block.e_score_correction_bias.device.type == "meta"
    assert block.e_score_correction_bias.dtype == torch.float32
    assert block.experts.w13.device.type == "meta" and block.experts.w13.dtype == torch.bfloat16


def test_float32_routing_parameters_keep_their_values_through_a_cast():
    block = _block()
    gate = block.gate.weight.detach().clone()
    block = block.to(torch.bfloat16)
    assert block.gate.weight.dtype == torch.float32 and torch.equal(block.gate.weight, gate)


def test_quantized_experts_follow_the_device_through_a_dtype_cast():
    block = _block()
    block.experts.quantize_(QuantScheme("int8"))
    block = block.to("meta").to(torch.bfloat16)
    assert block.experts.w13.device.type == "meta" and block.experts.w13.dtype == torch.int8
    assert block.experts.w13_scale.device.type == "meta" and block.experts.w13_scale.dtype == torch.float32
