"""Whether a model can be split as an engine config says, found before any process starts."""

import torch

from engine.core.config import EngineConfig
from engine.distributed.collectives import TensorParallel
from engine.distributed.expert_parallel import ExpertParallel
from engine.core.model_config import ModelConfig
from engine.models import model_class


def check_split(model_config: ModelConfig, config: EngineConfig) -> None:
    """ValueError naming what does not divide (heads, an intermediate size, too few experts for the ranks) when
    ``model_config``'s model cannot be split over ``config``'s ranks: rank 0's modules are built on the meta
    device, as each rank builds its own (no memory, no weights read)."""
    if config.tensor_parallel_size == 1 and not config.enable_expert_parallel:
        return
    tp = TensorParallel.shape_only(config.tensor_parallel_size)
    if config.enable_expert_parallel:
        experts = TensorParallel.shape_only(config.tensor_parallel_size * config.data_parallel_size)
        tp.expert_parallel = ExpertParallel(experts, config.expert_dispatch)
    with torch.device("meta"):
        model = model_class(model_config)(model_config, moe_backend="torch", max_positions=1, tp=tp)
    if config.enable_eplb:  # the spare expert slots must divide among the ranks too
        from engine.eplb.policy import slots_per_rank

        for num_experts in {m.expert_tokens.shape[0] for m in model.modules() if hasattr(m, "expert_tokens")}:
            slots_per_rank(num_experts, config.num_redundant_experts,
                           config.tensor_parallel_size * config.data_parallel_size)
