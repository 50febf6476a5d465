"""Typed configs of the engine's parts. No I/O here: factories do the I/O."""

from dataclasses import dataclass

from engine.core.speculation import SpeculativeConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
KERNEL_OPTIONS = ("auto", "torch", "triton")
QUANTIZATION_OPTIONS = ("fp8", "fp8-block", "int8")  # engine.loading.quantization maps them to schemes
EXPERT_DISPATCH = ("all_to_all", "all_gather")


@dataclass(slots=True)
class EngineConfig:
    """Everything a user may set when building an engine (``LLM(**kwargs)`` maps onto it).

    ``num_kv_blocks`` fixes the KV pool size (tests use it to force preemption);
    otherwise the pool takes ``kv_cache_memory_gb`` on the CPU, or
    ``gpu_memory_utilization`` of the GPU minus what the weights use.

    ``kernels``: "triton" runs paged attention, the routed experts and the fused
    norms, RoPE and routing (``engine.transforms.fusion``) as Triton kernels and,
    on CUDA, measures a Triton matrix-vector kernel against ``F.linear`` for each
    dense projection shape at start and keeps it where faster
    (``engine.transforms.gemv_select``); "torch" runs torch ops only (any
    device); "auto" is "triton" on CUDA and "torch" elsewhere. Triton on a CPU
    needs ``TRITON_INTERPRET=1`` (for testing: it is slow).
    CUDA graphs replay decode-only steps at ``cuda_graph_batch_sizes`` (default:
    1, 2, 4, 8, then steps of 8 up to ``max_num_seqs``), padded up to the nearest
    size; they need CUDA and Triton attention, and ``enforce_eager`` turns them off.
    Other steps (prefill chunks, mixed prefill and decode) of at most the largest of
    ``cuda_graph_token_sizes`` tokens replay piecewise CUDA graphs (everything but
    attention captured, padded up to the nearest token count; default 16, 32, ... 512,
    capped at ``max_num_batched_tokens``; an empty tuple turns them off). They need CUDA
    and the Triton MoE kernels; capturing them costs start-up time, which is logged.
    ``random_weights`` (a preset name or config.json path, see ``engine.loading.random_weights``)
    builds a model of that shape with RANDOM weights instead of loading ``model``,
    which then only names it; tokenizer files come from ``tokenizer`` if given.
    ``background_*``: how Batch API work yields to live work (see ``SchedulerConfig``).
    ``tensor_parallel_size``: ranks (processes, one device each) the model is split over, Megatron
    style; rank 0 runs the scheduler and broadcasts each step's plan (``engine.distributed``).
    ``enable_expert_parallel``: the routed experts are divided whole among those ranks (E/N each)
    instead of each being split N ways; ``expert_dispatch`` moves tokens to their experts' ranks by
    "all_to_all" (uneven splits: each token slot travels once) or "all_gather" (every rank sees
    every token, outputs reduce-scattered back: simpler, more traffic).
    ``distributed_init_method``: the ``tcp://host:port`` the ranks meet at (None: a free local port,
    every rank on this node); ``local_ranks``: how many ranks this node starts (None: all), the rest
    joining from other nodes (``moegate engine-rank`` under ``torchrun``).
    ``distributed_timeout_s``: a collective inside a step that does not complete within it (a rank
    hung or died) fails the step with a message naming the rank.
    ``data_parallel_size`` > 1 (with ``enable_expert_parallel``): this engine is data-parallel rank
    ``data_parallel_rank`` of that many whole engines (each its own scheduler, requests and KV cache)
    whose MoE layers share one expert-parallel group; they step together, an engine with nothing to
    do running the MoE layers' collectives alone (a dummy step). Each may itself be split over
    ``tensor_parallel_size`` ranks (``local_ranks`` then counts this replica's ranks on this node):
    the experts are divided among all data_parallel_size x tensor_parallel_size ranks, attention and
    the dense layers within each replica. They meet at ``distributed_init_method``.
    ``quantization``: the routed experts stored in 8 bits, quantized at load time (``docs/quantization.md``):
    "fp8" (float8_e4m3fn, a scale per output channel), "fp8-block" (a scale per 128x128 block) or "int8"
    (weight-only, a scale per output channel); None keeps the model dtype, or the checkpoint's own FP8
    scheme when its config.json has a ``quantization_config``.
    ``overlap_scheduling``: the host schedules and prepares step N+1 while the device runs step N, the
    sampled tokens fed to the next step on the device; stop checks and outputs run one step behind (a
    request's extra token past its stop is dropped). None: on on CUDA, off on the CPU and with speculative
    decoding. Logprobs, penalties and ``n`` > 1 overlap too; a step holding a grammar-constrained request
    whose previous token is in flight is launched once that token is read; multi-process engines run
    synchronously (``engine.worker.overlap``).
    ``speculative``: "ngram" or "draft" turns speculative decoding on (None: off): each decoding request
    proposes up to ``num_speculative_tokens`` tokens, by prompt lookup ("ngram") or as the greedy tokens of
    the draft model at ``speculative_model`` ("draft": a checkpoint with the target's vocabulary), verified in the step's one forward; a request stops
    proposing while its recent acceptance is below ``speculative_min_acceptance``, and none proposes while
    more than ``speculative_max_batch`` requests run (``engine.core.speculation``). It needs overlapped
    scheduling off (None then means off).
    ``cpu_threads``: torch's intra-op threads when the model runs on the CPU; None
    is torch's default (every core) in-process; in the engine process, which
    shares the machine with the gateway feeding it, one core fewer while
    foreground work is present or was within ``background_window_s``, and every
    core otherwise (see ``engine.serving.serving_threads``).
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
    seed: int = 0
    tokenizer: str | None = None
    kernels: str = "auto"
    enforce_eager: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    cuda_graph_token_sizes: tuple[int, ...] | None = None
    random_weights: str | None = None
    background_token_budget: int = 64
    background_window_s: float = 5.0
    cpu_threads: int | None = None
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    expert_dispatch: str = "all_to_all"
    distributed_init_method: str | None = None
    local_ranks: int | None = None
    distributed_timeout_s: float = 30.0
    quantization: str | None = None
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    overlap_scheduling: bool | None = None
    speculative: str | None = None
    num_speculative_tokens: int = 4
    speculative_max_batch: int = 8
    speculative_min_acceptance: float = 0.3
    speculative_model: str | None = None

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        """Speculative decoding's settings, or None when it is off."""
        if self.speculative is None:
            return None
        return SpeculativeConfig(self.speculative, self.num_speculative_tokens, self.speculative_max_batch,
                                 self.speculative_min_acceptance, self.speculative_model)

    def __post_init__(self) -> None:
        _ = self.speculative_config  # ValueError naming the field for a bad speculative setting
        if self.speculative is not None and self.overlap_scheduling:
            raise ValueError("speculative decoding runs with overlap_scheduling off (--no-overlap-scheduling): "
                             "a step's verified tokens decide the next step's drafts")
        if self.speculative == "draft" and (self.tensor_parallel_size > 1 or self.data_parallel_size > 1):
            raise ValueError("speculative='draft' runs on a single-process engine (tensor_parallel_size and "
                             "data_parallel_size 1)")
        if self.data_parallel_size < 1 or not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, data_parallel_size), got {self.data_parallel_rank} "
                             f"of {self.data_parallel_size}")
        if self.data_parallel_size > 1:
            if not self.enable_expert_parallel:
                raise ValueError("data-parallel engines share work only through divided experts: set "
                                 "enable_expert_parallel (independent replicas need no engine setting)")
            if not self.distributed_init_method:
                raise ValueError("data-parallel engines meet at distributed_init_method (tcp://HOST:PORT)")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.expert_dispatch not in EXPERT_DISPATCH:
            raise ValueError(f"expert_dispatch must be one of {EXPERT_DISPATCH}, got {self.expert_dispatch!r}")
        if self.local_ranks is not None and not 1 <= self.local_ranks <= self.tensor_parallel_size:
            raise ValueError(f"local_ranks must be between 1 and tensor_parallel_size ({self.tensor_parallel_size}), "
                             f"got {self.local_ranks}")
        if self.local_ranks is not None and self.local_ranks < self.tensor_parallel_size and not self.distributed_init_method:
            raise ValueError("ranks on other nodes need distributed_init_method (tcp://HOST:PORT reachable from them)")
        if self.distributed_init_method is not None:
            meeting_address(self.distributed_init_method)  # ValueError for a malformed one
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.kernels not in KERNEL_OPTIONS:
            raise ValueError(f"kernels must be one of {KERNEL_OPTIONS}, got {self.kernels!r}")
        if self.cuda_graph_batch_sizes is not None:
            self.cuda_graph_batch_sizes = tuple(sorted(set(self.cuda_graph_batch_sizes)))
            if not self.cuda_graph_batch_sizes or self.cuda_graph_batch_sizes[0] < 1:
                raise ValueError(f"cuda_graph_batch_sizes must be positive batch sizes, got {self.cuda_graph_batch_sizes}")
        if self.cuda_graph_token_sizes is not None:
            self.cuda_graph_token_sizes = tuple(sorted(set(self.cuda_graph_token_sizes)))
            if self.cuda_graph_token_sizes and not (
                    1 <= self.cuda_graph_token_sizes[0] and self.cuda_graph_token_sizes[-1] <= self.max_num_batched_tokens):
                raise ValueError(f"cuda_graph_token_sizes must be token counts between 1 and max_num_batched_tokens "
                                 f"({self.max_num_batched_tokens}), got {self.cuda_graph_token_sizes}")
        if self.random_weights is not None and not self.random_weights.strip():
            raise ValueError("random_weights must name a preset or a config.json path")
        if not self.model:
            raise ValueError("model must be a path to a checkpoint directory (or a name, with random_weights)")
        if self.quantization is not None and self.quantization not in QUANTIZATION_OPTIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_OPTIONS} (or None), got {self.quantization!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.device not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}, got {self.device!r}")
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


_PARTS = ("torch", "triton")
_GEMV_MODES = ("off", "measure", "on")


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """The implementation each part of the model runs, resolved from ``EngineConfig.kernels`` and the device.

    Users set ``kernels``; benchmarks and tests build a choice by hand to compare
    one part's kernels with everything else held fixed. ``dense_gemv``: "measure"
    picks per projection shape by timing (CUDA), "on" uses the Triton gemv for
    every shape unmeasured (for testing it), "off" never.
    """

    attention: str = "torch"
    elementwise: str = "torch"
    moe: str = "torch"
    dense_gemv: str = "off"

    def __post_init__(self) -> None:
        for part in (self.attention, self.elementwise, self.moe):
            if part not in _PARTS:
                raise ValueError(f"a kernel choice is one of {_PARTS}, got {part!r}")
        if self.dense_gemv not in _GEMV_MODES:
            raise ValueError(f"dense_gemv must be one of {_GEMV_MODES}, got {self.dense_gemv!r}")

    @classmethod
    def resolve(cls, kernels: str, device_type: str) -> "KernelChoice":
        if kernels == "auto":
            kernels = "triton" if device_type == "cuda" else "torch"
        if kernels == "torch":
            return cls()
        # Measuring the gemv needs device timers; under the CPU interpreter it would only be slow.
        return cls("triton", "triton", "triton", "measure" if device_type == "cuda" else "off")

    @property
    def uses_triton(self) -> bool:
        return "triton" in (self.attention, self.elementwise, self.moe) or self.dense_gemv != "off"


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
    """The scheduler's step budget (it batches continuously: a request joins the running batch at the next step).

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
    background_token_budget: int = 64
    background_window_s: float = 5.0

    def __post_init__(self) -> None:
        assert self.max_num_seqs >= 1 and self.max_num_batched_tokens >= 1 and self.max_model_len >= 2
        assert self.background_token_budget >= 1 and self.background_window_s >= 0


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
