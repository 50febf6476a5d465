"""moegate's engine: MoE models on a paged KV cache with continuous batching.

Offline use::

    from engine import LLM, SamplingParams
    llm = LLM(model="/path/to/checkpoint")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
"""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.model_config import CheckpointError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CheckpointError"]
