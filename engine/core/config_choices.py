"""The values some ``EngineConfig`` fields take (their flags' choices), and the parser of a meeting address."""

from engine.core.speculation import SPECULATIVE_METHODS

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
KERNEL_OPTIONS = ("auto", "torch", "triton")
QUANTIZATION_OPTIONS = ("fp8", "fp8-block", "int8", "mxfp4")  # engine.loading.quantization maps them to schemes
EXPERT_DISPATCH = ("all_to_all", "all_gather")
ROLES = ("both", "prefill", "decode")  # EngineConfig.role
EVICTION_POLICIES = ("priority", "lru")  # EngineConfig.kv_eviction_policy (engine.core.free_queue)
EXECUTOR_BACKENDS = ("mp", "ray")  # EngineConfig.distributed_executor_backend
KV_CACHE_DTYPES = ("auto", "fp8")  # EngineConfig.kv_cache_dtype (engine.layers.fp8_cache)
# The EngineConfig fields that take one of a few values (their flags' choices).
CHOICES = {"dtype": DTYPES, "device": DEVICES, "kernels": KERNEL_OPTIONS, "quantization": QUANTIZATION_OPTIONS,
           "expert_dispatch": EXPERT_DISPATCH, "speculative": SPECULATIVE_METHODS, "role": ROLES,
           "kv_eviction_policy": EVICTION_POLICIES, "distributed_executor_backend": EXECUTOR_BACKENDS,
           "kv_cache_dtype": KV_CACHE_DTYPES}


def meeting_address(init_method: str) -> tuple[str, int]:
    """(host, port) of a ``tcp://HOST:PORT`` meeting address (``tcp://[v6]:PORT`` too, brackets removed);
    ValueError naming what is wrong."""
    host, sep, port = init_method.removeprefix("tcp://").rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not init_method.startswith("tcp://") or not sep or not host or not port.isdigit() \
            or not 1 <= int(port) <= 65535:
        raise ValueError(f"--distributed-init-method must be tcp://HOST:PORT (a port from 1 to 65535), got "
                         f"{init_method!r}")
    return host, int(port)
