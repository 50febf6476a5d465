"""Typed configs of the engine's parts. No I/O here: factories do the I/O."""

from dataclasses import dataclass

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
_MOE_BACKENDS = ("auto", "torch", "triton")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
BATCHING_STRATEGIES = ("continuous", "dynamic", "static")
DENSE_GEMV_MODES = ("auto", "off", "on")


@dataclass(slots=True)
class EngineConfig:
    """Everything a user may set when building an engine (``LLM(**kwargs)`` maps onto it).

    ``num_kv_blocks`` fixes the KV pool size (tests use it to force preemption);
    otherwise the pool takes ``kv_cache_memory_gb`` on the CPU, or
    ``gpu_memory_utilization`` of the GPU minus what the weights use.

    ``attention_backend``: "auto" is Triton paged attention on CUDA, torch elsewhere.
    ``elementwise_backend``: "auto" fuses norms, RoPE and routing into Triton
    kernels on CUDA (``engine.layers.fusion``), torch ops elsewhere.
    ``dense_gemv``: the dense projections at up to 8 rows through a Triton
    matrix-vector kernel (``engine.dense_gemv_select``). "auto" measures it
    against ``F.linear`` per shape at start on CUDA and uses it where faster
    (off elsewhere); "on" uses it everywhere unmeasured (tests); "off" never.
    CUDA graphs replay decode-only steps at ``cuda_graph_batch_sizes`` (default:
    1, 2, 4, 8, then steps of 8 up to ``max_num_seqs``), padded up to the nearest
    size; they need CUDA and Triton attention, and ``enforce_eager`` turns them off.
    ``random_weights`` (a preset name or config.json path, see ``engine.random_weights``)
    builds a model of that shape with RANDOM weights instead of loading ``model``,
    which then only names it; tokenizer files come from ``tokenizer`` if given.
    ``background_*``: how Batch API work yields to live work (see ``SchedulerConfig``).
    ``cpu_threads``: torch's intra-op threads when the model runs on the CPU; None
    is torch's default (every core) in-process; in the engine process, which
    shares the machine with the gateway feeding it, one core fewer while
    foreground work is present or was within ``background_window_s``, and every
    core otherwise (see ``engine.serving_threads``).
    """

    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 2.0
    gpu_memory_utilization: float = 0.9
    moe_backend: str = "auto"
    seed: int = 0
    tokenizer: str | None = None
    batching: str = "continuous"
    max_wait_ms: float = 50.0
    attention_backend: str = "auto"
    elementwise_backend: str = "auto"
    dense_gemv: str = "auto"
    enforce_eager: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    random_weights: str | None = None
    background_token_budget: int = 64
    background_window_s: float = 5.0
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.elementwise_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"elementwise_backend must be one of {ATTENTION_BACKENDS}, got {self.elementwise_backend!r}")
        if self.dense_gemv not in DENSE_GEMV_MODES:
            raise ValueError(f"dense_gemv must be one of {DENSE_GEMV_MODES}, got {self.dense_gemv!r}")
        if self.cuda_graph_batch_sizes is not None:
            self.cuda_graph_batch_sizes = tuple(sorted(set(self.cuda_graph_batch_sizes)))
            if not self.cuda_graph_batch_sizes or self.cuda_graph_batch_sizes[0] < 1:
                raise ValueError(f"cuda_graph_batch_sizes must be positive batch sizes, got {self.cuda_graph_batch_sizes}")
        if self.random_weights is not None and not self.random_weights.strip():
            raise ValueError("random_weights must name a preset or a config.json path")
        if self.batching not in BATCHING_STRATEGIES:
            raise ValueError(f"batching must be one of {BATCHING_STRATEGIES}, got {self.batching!r}")
        if self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        if not self.model:
            raise ValueError("model must be a path to a checkpoint directory (or a name, with random_weights)")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.device not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}, got {self.device!r}")
        if self.moe_backend not in _MOE_BACKENDS:
            raise ValueError(f"moe_backend must be one of {_MOE_BACKENDS}, got {self.moe_backend!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.background_token_budget < 1 or self.background_window_s < 0:
            raise ValueError("background_token_budget must be >= 1 and background_window_s >= 0, got "
                             f"{self.background_token_budget} and {self.background_window_s}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")


@dataclass(slots=True)
class CacheConfig:
    """The KV block pool, once its size is known."""

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool

    def __post_init__(self) -> None:
        assert self.block_size >= 1 and self.num_blocks >= 1


@dataclass(slots=True)
class SchedulerConfig:
    """Step budget and batching strategy of the scheduler.

    ``continuous``: iteration-level scheduling. ``static``: wait for
    ``max_num_seqs`` requests (or a drain), run them until the last finishes.
    ``dynamic``: like static, but a batch also starts ``max_wait_ms`` after its
    oldest request arrived.

    Background requests (``Request.background``: the Batch API's lines) take idle
    capacity only (continuous batching). A step that prefills foreground work
    serves no background work, so a first token never shares its step with batch
    work; and while foreground work is present, or was within the last
    ``background_window_s``, background work gets at most ``background_token_budget``
    tokens a step, so steps stay short and a foreground arrival waits little for
    the step in flight. With no foreground traffic, background work has the
    whole step.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    batching: str = "continuous"
    max_wait_ms: float = 50.0
    background_token_budget: int = 64
    background_window_s: float = 5.0

    def __post_init__(self) -> None:
        assert self.max_num_seqs >= 1 and self.max_num_batched_tokens >= 1 and self.max_model_len >= 2
        assert self.background_token_budget >= 1 and self.background_window_s >= 0
        assert self.batching in BATCHING_STRATEGIES
