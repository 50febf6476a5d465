"""Typed configs of the engine's parts. No I/O here: factories do the I/O."""

from dataclasses import dataclass

from engine.core.config_choices import (CHOICES, DEVICES, DTYPES, EXPERT_DISPATCH, KERNEL_OPTIONS,  # noqa: F401
                                        QUANTIZATION_OPTIONS, ROLES, meeting_address)
from engine.core.config_rules import check_rules
from engine.core.speculation import SpeculativeConfig

@dataclass(slots=True)
class EngineConfig:
    """Everything a user may set when building an engine: ``LLM(**kwargs)`` maps onto it, and each field is a
    flag of ``moegate serve``, ``moegate engine`` and ``moegate run-batch`` (``engine.engine_flags``), its help
    the string under the field. A name in double backquotes there is another field; the help shows its flag.
    """

    model: str
    """local checkpoint directory (with ``random_weights``: only the name served)"""
    dtype: str = "auto"
    """the weights' and activations' dtype; auto: float32 on the CPU, on a GPU the checkpoint's (bfloat16 for a
    float32 one)"""
    device: str = "auto"
    """where the model runs; auto: CUDA when there is a GPU"""
    block_size: int = 16
    """tokens per KV block (a power of two): the unit of the KV pool and of prefix caching"""
    max_num_seqs: int = 256
    """requests running at once, at most (a cap: a smaller batch costs nothing)"""
    max_num_batched_tokens: int = 2048
    """tokens one step computes, at most: longer prompts are prefilled in chunks of this, so a long prompt
    delays the running requests' next tokens by one such step at most"""
    max_num_encoder_tokens: int | None = None
    """image tokens one step encodes with the vision tower, at most (models that read images): a prompt's
    chunk stops before an image that would pass it, so a request with many images is encoded over several steps
    while the others keep decoding; an image larger than this is encoded alone in its step; images the encoder
    cache holds cost nothing (default: ``max_num_batched_tokens``)"""
    max_num_encoder_token_blocks: int | None = None
    """layer-chunked image encoding (models that read images): the vision tower work one step runs, at most, in
    token-blocks (an image's patches, its tokens before merging, times the tower blocks run; the patch embedding
    counts as one block), so a step that
    encodes is short whatever the image's size (a block is split over the image's rows when one block of one
    image passes the budget); an image is encoded a few blocks a step, and its request's
    prefill reaches it once its last block has run (its first token comes later: text streams' tokens do not
    wait for a whole image). Replaces ``max_num_encoder_tokens``. Default: counted from the model, the tower work
    that costs about a quarter of a ``max_num_batched_tokens`` prompt chunk (a decode engine's:
    ``decode_prefill_chunk_tokens``; ``engine.models.encoder_budget``; a
    served model's usual images then run whole in one step, a large one over a few); 0, or setting
    ``max_num_encoder_tokens`` alone: off, whole images"""
    encoder_cache_gb: float = 1.0
    """host memory, in GB, for vision-encoder outputs kept across requests (models that read images): the same
    image sent again by the same tenant (same preprocessed pixels, same prefix-cache salt) is not encoded again;
    least recently used first out; never shared between tenants; 0: off"""
    encoder_cache_tenant_share: float | None = None
    """the most of the encoder cache one tenant's images may hold, a share in (0, 1]: past it, its new images
    evict only its own least recently used ones, so a tenant sending many distinct images cannot push another
    tenant's out beyond it; a tenant whose quota sets a cache share (moegate admin quota set NAME --cache-share F)
    is held to that one instead (default: none, one LRU shared by the tenants without a cache share)"""
    language_model_only: bool = False
    """serve an image-text checkpoint that can also be served as text (Qwen3.5-MoE) as its text model: the vision
    tower is not loaded, images are refused, and the settings refused with images (tensor parallelism) are open"""
    max_model_len: int | None = None
    """prompt plus output tokens of one request, at most (default: the checkpoint's context length)"""
    enable_prefix_caching: bool = True
    """share the KV blocks of prompt prefixes already computed (salted per tenant)"""
    kv_eviction_policy: str = "priority"
    """which cached prefix blocks make room first, in the KV pool and the host and disk tiers: priority: those
    of the least urgent priority class that used them, within it the tenant holding the most, least recently
    used first (a batch flood evicts its own blocks, not a realtime tenant's prompt); lru: least recently used
    first, whoever's (docs/decisions/priority-eviction.md)"""
    state_checkpoint_interval: int = 64
    """hybrid linear-attention models' prefix cache: keep the linear layers' state after every this many blocks
    of a sequence (and after each prompt's last full block); a hit resumes at the last block with one
    (docs/decisions/hybrid_prefix_cache.md)"""
    state_checkpoint_share: float = 0.25
    """hybrid linear-attention models: the share of the KV cache's memory (blocks and checkpoints together) the
    state checkpoints may take; 0: no checkpoints, so no prefix cache for them"""
    num_kv_blocks: int | None = None
    """fix the KV pool at this many blocks (default: sized from ``kv_cache_memory_gb`` on the CPU, or
    ``gpu_memory_utilization`` on a GPU); where sliding-window layers keep their own block tables (gpt-oss), a
    block holds half the layers"""
    kv_cache_memory_gb: float = 2.0
    """KV pool size on the CPU, in GB (taken only as blocks are first written)"""
    kv_cache_dtype: str = "auto"
    """what the KV cache stores: auto: the model dtype; fp8 (DeepSeek-V3.2 and GLM-5 only): DeepSeek-V3.2's FP8
    format, the latent and the indexer key in e4m3 with a float32 scale per 128 values, the rotary part in bf16
    (788 bytes a token and layer at DeepSeek-V3.2's shapes, against 1,408 in bf16), quantized as written"""
    gpu_memory_utilization: float = 0.9
    """share of the GPU's memory the engine may use: the KV pool takes what the weights leave of it"""
    seed: int = 0
    """seed of ``random_weights``' weights (every rank and replica of a group must give the same) and of
    sampling for requests that give none"""
    tokenizer: str | None = None
    """tokenizer files' directory (default: ``model``'s)"""
    kernels: str = "auto"
    """triton: paged attention, the linear-attention layers' delta rules, the routed experts, the fused norms, RoPE
    and routing as Triton kernels, and on CUDA a Triton matrix-vector kernel for each dense projection shape
    where it measures faster than F.linear at start; torch: torch ops only (any device); auto: triton on CUDA,
    torch elsewhere (Triton on a CPU needs TRITON_INTERPRET=1, for testing: it is slow)"""
    lora_adapters: str | None = None
    """LoRA adapters to serve beside the base model, as NAME=DIR pairs separated by commas (PEFT directories:
    adapter_config.json and adapter_model.safetensors); a request names one as its policy's ``lora_adapter``
    (any number: ``max_loras`` resident on the device, the others loaded while their requests wait; more can be
    added and removed while serving; served under tensor and expert parallelism); implies ``enable_lora``"""
    enable_lora: bool = False
    """serve LoRA adapters (slot tables in every adaptable layer), also with none named at start: adapters can then
    be added while serving"""
    max_loras: int = 4
    """adapters resident on the device at once, each in its own slot of every adapted layer (a device-slot LRU)"""
    max_cpu_loras: int | None = None
    """adapters whose factors are kept in host memory (an LRU; others are read from disk again when needed); at
    least ``max_loras``, default ``max_loras``"""
    max_lora_rank: int = 16
    """the largest adapter rank served (slots are this wide; smaller ranks are zero-padded)"""
    enforce_eager: bool = False
    """never capture or replay CUDA graphs"""
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    """batch sizes decode-only steps are padded to and replayed as whole CUDA graphs (default 1, 2, 4, 8, then
    steps of 8 up to ``max_num_seqs``; CUDA with the Triton attention kernels only)"""
    cuda_graph_token_sizes: tuple[int, ...] | None = None
    """token counts prefill and mixed steps are padded to and replayed as piecewise CUDA graphs (attention
    eager between them); none (an empty tuple): off (default 16, 32, ..., 512 up to
    ``max_num_batched_tokens``; CUDA with the Triton MoE kernels only; capturing costs start-up time, which
    is logged)"""
    random_weights: str | None = None
    """serve a RANDOM-weight model of a real shape instead of ``model``'s weights (for speed tests): a preset
    (qwen3-30b-a3b, olmoe-1b-7b, qwen1.5-moe-a2.7b, mixtral-8x7b, glm-4.5-air, minimax-m2, gpt-oss-20b,
    gpt-oss-120b, deepseek-v3, deepseek-v3.2, deepseek-v2-lite) or a config.json path
    (``engine.loading.random_weights``)"""
    background_token_budget: int = 64
    """tokens a step's batch work may take while live traffic is present or was within
    ``background_window_s`` (``engine.core.config.SchedulerConfig``)"""
    background_window_s: float = 5.0
    """how long after live traffic batch work stays capped, and the engine leaves a core to the gateway on
    the CPU"""
    starvation_bound_s: float | None = 60.0
    """seconds a request may go unserved (waiting, preempted, or running without tokens behind more urgent
    classes and live traffic) before it is promoted ahead of every class until it ends; it then takes the
    next free sequence slot and blocks, without preempting anyone (none: strict priority, no bound)"""
    cpu_threads: int | None = None
    """torch threads of the engine on the CPU (default: in the engine process, which shares the machine with
    the gateway, one core fewer than the machine while live traffic is recent and every core otherwise; in
    process, torch's own) (``engine.serving.serving_threads``)"""
    tensor_parallel_size: int = 1
    """ranks (processes, one device each) the model is split over: attention heads, MLPs, experts,
    vocabulary; rank 0 schedules and broadcasts each step's plan (``engine.distributed``)"""
    pipeline_parallel_size: int = 1
    """stages the model's layers are split over, each of ``tensor_parallel_size`` ranks (world: the
    product): a stage holds only its layers and their KV cache and sends (hidden, residual) on to the next;
    the first stage also holds the embedding, the LM head and the sampler (``engine.distributed.pipeline``)"""
    pipeline_micro_batches: int = 2
    """pieces (by token ranges) each step is cut into so that the stages work on different pieces at once
    (with steps overlapped, the decodes waiting for the step in flight are one more piece)"""
    enable_expert_parallel: bool = False
    """divide the routed experts whole among the ranks instead of splitting each one"""
    expert_dispatch: str = "all_to_all"
    """how tokens reach their experts' ranks: all_to_all (uneven splits: each token slot travels once) or
    all_gather (every rank sees every token, outputs reduce-scattered back: simpler, more traffic)"""
    enable_eplb: bool = False
    """with ``enable_expert_parallel``: balance the experts' load over the ranks while serving: every
    ``eplb_interval_steps`` steps the most loaded experts get replicas in the ``num_redundant_experts`` spare
    slots and experts are re-placed among the ranks from the load of the last ``eplb_window_steps`` steps, the
    weights moved between steps (``engine.eplb``)"""
    num_redundant_experts: int = 0
    """with ``enable_eplb``: spare expert slots over all ranks, for replicas of hot experts (the routed experts
    plus these must divide evenly among the expert-parallel ranks)"""
    eplb_window_steps: int = 1000
    """steps of measured expert load the rebalancing looks at"""
    eplb_interval_steps: int = 3000
    """steps between two rebalances"""
    distributed_init_method: str | None = None
    """tcp://HOST:PORT where the ranks meet (default: a free port on this node, every rank here); independent
    replicas split over ranks meet at PORT + their index"""
    local_ranks: int | None = None
    """ranks this node starts of each engine's ``pipeline_parallel_size`` x ``tensor_parallel_size`` (default all; with
    ``data_parallel_size``, of this replica's); the others run `moegate engine-rank` elsewhere"""
    distributed_executor_backend: str = "mp"
    """what runs an engine's ranks: mp (local processes: the engine process and its followers on this node, ranks
    elsewhere started by hand) or ray (every rank a Ray actor, an engine's ranks in one placement group on the
    cluster at ``ray_address``; docs/scaling.md)"""
    ray_address: str | None = None
    """with ``distributed_executor_backend`` ray: the Ray cluster to join (HOST:PORT of its head, or auto);
    default: RAY_ADDRESS, else a local Ray started for this process"""
    distributed_timeout_s: float = 30.0
    """seconds a collective may take before the step fails with a message naming the rank, and the engine
    restarts"""
    quantization: str | None = None
    """store the routed experts in 8 bits, quantized at load time (docs/quantization.md): fp8 (e4m3, a scale
    per output channel), fp8-block (a scale per 128x128 block) or int8 (weight-only, a scale per output
    channel); or in 4 bits: mxfp4 (e2m1, a power-of-two scale per 32 values, gpt-oss's format); default: the
    model dtype, or an FP8 checkpoint's own scheme, or an MXFP4 checkpoint's on CUDA with the Triton kernels"""
    data_parallel_size: int = 1
    """with ``enable_expert_parallel``: whole engines (each its own scheduler, requests and KV cache) whose MoE
    layers share one expert-parallel group, meeting at ``distributed_init_method``; they step together, one
    with nothing to do running the MoE layers' collectives alone. Each may be split over
    ``tensor_parallel_size`` ranks: the experts are divided among all of their ranks"""
    data_parallel_rank: int = 0
    """this engine's place among the ``data_parallel_size`` engines"""
    overlap_scheduling: bool | None = None
    """schedule and prepare the next step while the device runs this one, stop checks one step behind
    (default: on with CUDA, off on the CPU, where it measured no gain, and with speculative decoding;
    tensor- and data-parallel engines run synchronously) (``engine.worker.overlap``). A pipelined engine
    overlaps its steps across stages unless this is False: stage 0 runs the next step while the last stage
    finishes this one (``engine.worker.pipeline_overlap``)"""
    speculative: str | None = None
    """speculative decoding: ngram proposes the tokens that followed the latest
    earlier occurrence of a request's last tokens, draft the greedy tokens of a small draft model
    (``speculative_model``); verified in the same step; needs overlapped scheduling off (default: off)
    (``engine.core.speculation``)"""
    num_speculative_tokens: int = 4
    """draft tokens a request proposes per step"""
    speculative_max_batch: int = 8
    """no request speculates while more than this many run"""
    speculative_min_acceptance: float = 0.3
    """a request whose recent acceptance rate is below this stops proposing, trying again every few steps"""
    speculative_model: str | None = None
    """the draft model's checkpoint directory for speculative draft (the served model's vocabulary)"""
    role: str = "both"
    """what this engine does with prompts: both (prefill and decode), prefill (computes prompts and
    hands their KV blocks to decode engines) or decode (receives prompts' KV from prefill engines and
    generates) (docs/disaggregation.md)"""
    kv_transfer_address: str | None = None
    """HOST or HOST:PORT where a decode engine waits for its prefill engines' KV transfers (default: 127.0.0.1
    and a free port; name an address other nodes reach when prefill engines run there)"""
    kv_transfer_timeout_s: float = 30.0
    """seconds a decode engine waits for a prompt's KV from a prefill engine before it prefills the prompt
    itself"""
    local_prefill_tokens: int = 64
    """a decode engine prefills a prompt itself when fewer than this many of its tokens are missing from its
    prefix cache (short prompts, mostly cached ones): a transfer would cost more than it saves"""
    prefill_queue_tokens: int = 1024
    """conditional disaggregation, read by the gateway from the decode engines' settings: when the prefill
    engine picked for a long prompt already has at least this many prompt tokens queued or computing, a decode
    engine that is not already computing such a prompt itself computes the new prompt itself rather than
    queueing it behind them
    (its streams see that one prompt's chunked prefill); 0: every long prompt goes to a prefill engine"""
    decode_prefill_chunk_tokens: int = 256
    """a decode engine computes the prompts it prefills itself (short ones, conditional disaggregation's, those
    whose transfer failed) at most this many tokens a step, so its streams' steps stay short; 0: as many as
    ``max_num_batched_tokens`` allows. Other roles: unused"""

    host_cache_gb: float = 0.0
    """host memory, in GB, for prefix-cache blocks evicted from the KV pool (pinned on CUDA): a later prompt
    with the same prefix (same tenant) loads them back instead of computing them; 0: off; the whole engine's:
    tensor-parallel ranks each hold an equal part (docs/prefix_cache_tiers.md)"""
    disk_cache_dir: str | None = None
    """directory for prefix-cache blocks below the host tier, one file per block, kept across restarts (needs
    ``host_cache_gb`` and ``disk_cache_gb``); one engine at a time (a second is refused), and only the files of
    its deployment (others' are deleted at start)"""
    disk_cache_gb: float = 0.0
    """size of ``disk_cache_dir``'s prefix cache in GB, least recently used blocks deleted first"""
    deployment_id: str | None = None
    """the deployment (tenants database) this engine serves, set by ``moegate serve`` from its database: the disk
    tier keeps only files written under the same one and deletes others' at start (None: an engine without a
    database)"""

    @property
    def engine_ranks(self) -> int:
        """Ranks (processes) of one engine: ``pipeline_parallel_size`` x ``tensor_parallel_size``."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def lora_adapter_paths(self) -> dict[str, str]:
        """``lora_adapters`` parsed: adapter name -> directory, in the order given."""
        paths: dict[str, str] = {}
        for item in (self.lora_adapters or "").split(","):
            if not item.strip():
                continue
            name, sep, path = item.strip().partition("=")
            if not sep or not name or not path or name in paths:
                raise ValueError(f"lora_adapters: {item.strip()!r} is not NAME=DIR with a new NAME")
            paths[name] = path
        return paths

    @property
    def overlaps_pipeline_steps(self) -> bool:
        """Whether a pipelined engine keeps two steps in flight (``overlap_scheduling`` not False)."""
        return self.pipeline_parallel_size > 1 and self.overlap_scheduling is not False

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine serves LoRA adapters: ``enable_lora`` or adapters named at start."""
        return self.enable_lora or bool(self.lora_adapter_paths)

    @property
    def cpu_loras(self) -> int:
        """``max_cpu_loras`` resolved: adapters kept in host memory (``max_loras`` unless set)."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        """Speculative decoding's settings, or None when it is off."""
        if self.speculative is None:
            return None
        return SpeculativeConfig(self.speculative, self.num_speculative_tokens, self.speculative_max_batch,
                                 self.speculative_min_acceptance, self.speculative_model)

    def __post_init__(self) -> None:
        """Sizes lists sorted and deduplicated, then ValueError with the one line of the first rule of
        ``engine.core.config_rules`` the settings break (which settings go together, and the values each takes)."""
        for field in ("cuda_graph_batch_sizes", "cuda_graph_token_sizes"):
            if getattr(self, field) is not None:
                setattr(self, field, tuple(sorted(set(getattr(self, field)))))
        check_rules(self)


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
    # The window of the sliding-window layers when they keep their own block tables (a second cache group whose
    # blocks go back to the pool once the window has passed them); None: one block table for every layer.
    sliding_window: int | None = None
    # Hybrid models: fixed-size recurrent states, one per running request (``engine.core.state_slots``), taken
    # from the same memory budget as the blocks; 0: the model keeps none.
    num_state_slots: int = 0
    # Their prefix cache's state checkpoints (``engine.core.state_checkpoints``): rows of the state cache after
    # the slots, and a checkpoint every this many blocks besides each prompt's last full block; 0: none.
    num_state_checkpoints: int = 0
    state_checkpoint_interval: int = 64
    # Which cached blocks the pool evicts first: "priority" (least urgent class, then the largest tenant) or
    # "lru" (``engine.core.free_queue``).
    eviction_policy: str = "priority"

    def __post_init__(self) -> None:
        assert self.block_size >= 1 and self.num_blocks >= 1 and self.num_state_slots >= 0
        assert self.num_state_checkpoints >= 0 and self.state_checkpoint_interval >= 1


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
    prefill_chunk_tokens: int = 0  # at most this many of one request's prompt tokens a step (0: no cap)
    # Image tokens a step hands to the vision tower, at most (None: no cap); one image larger than this is
    # encoded alone in its step, and images the encoder cache holds cost nothing (``Scheduler.image_cached``).
    max_num_encoder_tokens: int | None = None
    # Layer-chunked encoding (``engine.core.encoder_pieces``): tower work a step runs, at most, in token-blocks
    # (patches x tower stages) for a tower of ``encoder_stages`` stages (the patch embedding, then each block),
    # ``encoder_patches_per_token`` patches an image token; in place of ``max_num_encoder_tokens``. None: whole
    # images.
    max_num_encoder_token_blocks: int | None = None
    encoder_stages: int = 1
    encoder_patches_per_token: int = 1
    # A block's attention per patch of an image, as a share of a token-block (``encoder_budget.attention_per_patch``).
    encoder_attention_per_patch: float = 0.0
    # Whether the encoder cache keeps anything (False: ``encoder_cache_gb`` 0): layer-chunked, a request then never
    # waits for another's encoding of its picture, which it could not read back.
    encoder_cache_keeps: bool = True
    # A request unserved this long (waiting, preempted, or running without tokens) is promoted ahead of every
    # class until it ends (None: never): strict priority and the background caps cannot starve anyone forever.
    # The engine passes ``EngineConfig.starvation_bound_s``.
    starvation_bound_s: float | None = None

    def __post_init__(self) -> None:
        assert self.max_num_seqs >= 1 and self.max_num_batched_tokens >= 1 and self.max_model_len >= 2
        assert self.prefill_chunk_tokens >= 0
        assert self.max_num_encoder_tokens is None or self.max_num_encoder_tokens >= 1
        assert self.max_num_encoder_token_blocks is None or self.max_num_encoder_token_blocks >= 1
        assert self.background_token_budget >= 1 and self.background_window_s >= 0
        assert self.starvation_bound_s is None or self.starvation_bound_s > 0
