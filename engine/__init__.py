"""moegate's engine: MoE models on a paged KV cache with continuous batching.

Offline use::

    from engine import LLM, SamplingParams
    llm = LLM(model="/path/to/checkpoint")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))

Names are imported lazily so that the pure-Python parts (scheduler, block
pool, request state) import without torch.
"""

import importlib

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "EngineConfig": "engine.core.config",
    "KernelChoice": "engine.core.config",
    "SamplingParams": "engine.core.sampling_params",
    "RequestPolicy": "engine.core.request_policy",
    "RequestOutput": "engine.core.outputs",
    "CheckpointError": "engine.core.model_config",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
