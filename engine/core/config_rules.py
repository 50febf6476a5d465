"""Which engine settings go together, as data: each rule names a setting, what it needs or rules out (or the
values it takes), and the one-line refusal a config that breaks it gets. ``check_rules`` walks the table in order
(``EngineConfig.__post_init__``); ``moegate features`` prints its needs and excludes rows (``feature_text``), and
docs/configuration.md holds the same rows, generated from it (``feature_table``)."""

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from engine.core.config_choices import (DEVICES, DTYPES, EVICTION_POLICIES, EXPERT_DISPATCH, KERNEL_OPTIONS,
                                        KV_CACHE_DTYPES, QUANTIZATION_OPTIONS, ROLES, EXECUTOR_BACKENDS,
                                        meeting_address)

REQUIRES, EXCLUDES, VALUES = "needs", "excludes", "values"


@dataclass(frozen=True, slots=True)
class Rule:
    """``setting`` (as the user names it) ``relation`` ``other``: a config for which ``broken`` is true is refused
    with ``message``, a ``str.format`` template over the config's fields (``{role}``, ``{max_loras!r}``).
    ``broken`` may raise its own ValueError instead (a value parsed by another part's checks)."""

    setting: str
    relation: str  # REQUIRES, EXCLUDES or VALUES
    other: str
    message: str
    broken: Callable[[object], bool]


class _Fields(Mapping):
    """A config's fields and properties by name, for the messages' templates."""

    def __init__(self, config: object) -> None:
        self._config = config

    def __getitem__(self, name: str):
        return getattr(self._config, name)

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


def check_rules(config: object, rules: tuple[Rule, ...] | None = None) -> None:
    """ValueError with the message of the first rule (in table order) ``config`` breaks."""
    for rule in RULES if rules is None else rules:
        if rule.broken(config):
            raise ValueError(rule.message.format_map(_Fields(config)))


def _parses(parse: Callable[[object], object]) -> Callable[[object], bool]:
    """A rule's test that only calls ``parse`` (which raises its own ValueError naming the field)."""
    return lambda c: parse(c) is NotImplemented


def _one_of(field: str, choices: tuple[str, ...], optional: bool = False) -> Rule:
    none = " (or None)" if optional else ""
    return Rule(field, VALUES, f"one of {choices}{none}", f"{field} must be one of {choices}{none}, got {{{field}!r}}",
                lambda c: not (optional and getattr(c, field) is None) and getattr(c, field) not in choices)


def _at_least(field: str, low: int | float, strict: bool = False) -> Rule:
    op = ">" if strict else ">="
    return Rule(field, VALUES, f"{op} {low}", f"{field} must be {op} {low}, got {{{field}}}",
                lambda c: getattr(c, field) <= low if strict else getattr(c, field) < low)


def _optional_at_least(field: str, low: int) -> Rule:
    return Rule(field, VALUES, f">= {low} (or unset)", f"{field} must be >= {low}, got {{{field}}}",
                lambda c: getattr(c, field) is not None and getattr(c, field) < low)


def _lora_excludes(other: str, what: str, broken: Callable[[object], bool]) -> Rule:
    # Tensor and expert parallelism serve adapters (engine.lora.lora_shard); these do not yet.
    return Rule("lora_adapters / enable_lora", EXCLUDES, other, f"lora_adapters are served with {what} for now",
                lambda c: c.lora_enabled and broken(c))


def _role_single_process(size: str) -> Rule:
    # The connector reads and writes KV blocks in the scheduler's process only: other ranks' slices (heads, layers)
    # would stay behind.
    return Rule("role prefill / decode", EXCLUDES, f"{size} > 1",
                f"role {{role}} runs in one process for now: {size} must be 1, got {{{size}}}",
                lambda c: c.role != "both" and getattr(c, size) > 1)


def _sorted_sizes_ok(sizes: tuple[int, ...] | None, low: int, high: int | None) -> bool:
    return sizes is None or (bool(sizes) and sizes[0] >= low and (high is None or sizes[-1] <= high))


_HOST_TIER = "host_cache_gb"

# In the order __post_init__ checked them before they were data: a config breaking several gets the same message.
RULES: tuple[Rule, ...] = (
    Rule("max_loras, max_lora_rank", VALUES, ">= 1", "max_loras and max_lora_rank must be >= 1",
         lambda c: c.max_loras < 1 or c.max_lora_rank < 1),
    Rule("max_cpu_loras", VALUES, ">= max_loras", "max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})",
         lambda c: c.cpu_loras < c.max_loras),
    _lora_excludes("pipeline_parallel_size > 1", "pipeline_parallel_size 1", lambda c: c.pipeline_parallel_size > 1),
    _lora_excludes("data_parallel_size > 1", "data_parallel_size 1", lambda c: c.data_parallel_size > 1),
    _lora_excludes("role prefill / decode", "role 'both' (no disaggregated prefill/decode)", lambda c: c.role != "both"),
    _lora_excludes("enable_eplb", "enable_eplb off", lambda c: c.enable_eplb),
    Rule("speculative", VALUES, "a method and its settings (SpeculativeConfig)", "",
         _parses(lambda c: c.speculative_config)),
    Rule("speculative", EXCLUDES, "overlap_scheduling",
         "speculative decoding runs with overlap_scheduling off (--no-overlap-scheduling): a step's verified tokens "
         "decide the next step's drafts", lambda c: c.speculative is not None and c.overlap_scheduling),
    Rule("speculative draft", EXCLUDES, "tensor_parallel_size > 1, data_parallel_size > 1",
         "speculative='draft' runs on a single-process engine (tensor_parallel_size and data_parallel_size 1)",
         lambda c: c.speculative == "draft" and (c.tensor_parallel_size > 1 or c.data_parallel_size > 1)),
    Rule("data_parallel_rank", VALUES, "in [0, data_parallel_size)",
         "data_parallel_rank must be in [0, data_parallel_size), got {data_parallel_rank} of {data_parallel_size}",
         lambda c: c.data_parallel_size < 1 or not 0 <= c.data_parallel_rank < c.data_parallel_size),
    Rule("data_parallel_size > 1", REQUIRES, "enable_expert_parallel",
         "data-parallel engines share work only through divided experts: set enable_expert_parallel (independent "
         "replicas need no engine setting)", lambda c: c.data_parallel_size > 1 and not c.enable_expert_parallel),
    Rule("data_parallel_size > 1", REQUIRES, "distributed_init_method",
         "data-parallel engines meet at distributed_init_method (tcp://HOST:PORT)",
         lambda c: c.data_parallel_size > 1 and not c.distributed_init_method),
    _at_least("num_redundant_experts", 0),
    Rule("eplb_window_steps, eplb_interval_steps", VALUES, ">= 1",
         "eplb_window_steps and eplb_interval_steps must be >= 1, got {eplb_window_steps} and {eplb_interval_steps}",
         lambda c: c.eplb_window_steps < 1 or c.eplb_interval_steps < 1),
    Rule("num_redundant_experts", REQUIRES, "enable_eplb",
         "num_redundant_experts needs enable_eplb (--enable-eplb): the spare slots hold replicas that only the "
         "rebalancing fills", lambda c: c.num_redundant_experts and not c.enable_eplb),
    Rule("enable_eplb", REQUIRES, "enable_expert_parallel and tensor_parallel_size or data_parallel_size >= 2",
         "enable_eplb balances experts divided among ranks: set enable_expert_parallel and tensor_parallel_size or "
         "data_parallel_size >= 2", lambda c: c.enable_eplb and (
             not c.enable_expert_parallel or c.tensor_parallel_size * c.data_parallel_size < 2)),
    Rule("enable_eplb", EXCLUDES, "pipeline_parallel_size > 1",
         "enable_eplb balances the experts of one stage's ranks; with pipeline_parallel_size > 1 it is not "
         "supported yet: leave one of them off", lambda c: c.enable_eplb and c.pipeline_parallel_size > 1),
    _at_least("tensor_parallel_size", 1),
    _at_least("pipeline_parallel_size", 1),
    _at_least("pipeline_micro_batches", 1),
    Rule("pipeline_parallel_size > 1", EXCLUDES, "data_parallel_size > 1, speculative",
         "pipeline_parallel_size > 1 runs one engine without speculative decoding (data_parallel_size 1, "
         "speculative off)",
         lambda c: c.pipeline_parallel_size > 1 and (c.data_parallel_size > 1 or c.speculative is not None)),
    _one_of("expert_dispatch", EXPERT_DISPATCH),
    Rule("local_ranks", VALUES, "1 to pipeline_parallel_size x tensor_parallel_size",
         "local_ranks must be between 1 and pipeline_parallel_size x tensor_parallel_size ({engine_ranks}), got "
         "{local_ranks}", lambda c: c.local_ranks is not None and not 1 <= c.local_ranks <= c.engine_ranks),
    Rule("local_ranks < all ranks", REQUIRES, "distributed_init_method",
         "ranks on other nodes need distributed_init_method (tcp://HOST:PORT reachable from them)",
         lambda c: c.local_ranks is not None and c.local_ranks < c.engine_ranks and not c.distributed_init_method),
    _one_of("distributed_executor_backend", EXECUTOR_BACKENDS),
    Rule("distributed_executor_backend ray", EXCLUDES,
         "local_ranks, distributed_init_method, data_parallel_size > 1",
         "distributed_executor_backend='ray' places every rank itself: leave local_ranks and "
         "distributed_init_method unset; replicas sharing experts (data_parallel_size > 1) run on local "
         "processes for now",
         lambda c: c.distributed_executor_backend == "ray" and (
             c.local_ranks is not None or c.distributed_init_method is not None or c.data_parallel_size > 1)),
    Rule("ray_address", REQUIRES, "distributed_executor_backend ray",
         "ray_address is the Ray cluster of distributed_executor_backend='ray' (--distributed-executor-backend ray)",
         lambda c: c.ray_address is not None and c.distributed_executor_backend != "ray"),
    Rule("distributed_init_method", VALUES, "tcp://HOST:PORT", "",
         _parses(lambda c: c.distributed_init_method is not None and meeting_address(c.distributed_init_method))),
    _at_least("distributed_timeout_s", 0, strict=True),
    _optional_at_least("cpu_threads", 1),
    _one_of("kernels", KERNEL_OPTIONS),
    Rule("cuda_graph_batch_sizes", VALUES, "positive batch sizes",
         "cuda_graph_batch_sizes must be positive batch sizes, got {cuda_graph_batch_sizes}",
         lambda c: not _sorted_sizes_ok(c.cuda_graph_batch_sizes, 1, None)),
    Rule("cuda_graph_token_sizes", VALUES, "1 to max_num_batched_tokens",
         "cuda_graph_token_sizes must be token counts between 1 and max_num_batched_tokens ({max_num_batched_tokens}), "
         "got {cuda_graph_token_sizes}", lambda c: c.cuda_graph_token_sizes != () and not _sorted_sizes_ok(
             c.cuda_graph_token_sizes, 1, c.max_num_batched_tokens)),
    Rule("random_weights", VALUES, "a preset or a config.json path",
         "random_weights must name a preset or a config.json path",
         lambda c: c.random_weights is not None and not c.random_weights.strip()),
    Rule("model", VALUES, "a checkpoint directory",
         "model must be a path to a checkpoint directory (or a name, with random_weights)", lambda c: not c.model),
    _one_of("quantization", QUANTIZATION_OPTIONS, optional=True),
    _one_of("dtype", DTYPES),
    _one_of("kv_cache_dtype", KV_CACHE_DTYPES),
    _one_of("device", DEVICES),
    Rule("block_size", VALUES, "a power of two", "block_size must be a power of two, got {block_size}",
         lambda c: c.block_size < 1 or c.block_size & (c.block_size - 1)),
    _at_least("max_num_seqs", 1),
    _at_least("max_num_batched_tokens", 1),
    _optional_at_least("max_model_len", 2),
    _optional_at_least("max_num_encoder_tokens", 1),
    _optional_at_least("max_num_encoder_token_blocks", 0),
    Rule("encoder_cache_gb", VALUES, ">= 0", "encoder_cache_gb must be >= 0, got {encoder_cache_gb}",
         lambda c: c.encoder_cache_gb < 0),
    Rule("encoder_cache_tenant_share", VALUES, "in (0, 1] or none",
         "encoder_cache_tenant_share must be in (0, 1] or none, got {encoder_cache_tenant_share}",
         lambda c: c.encoder_cache_tenant_share is not None and not 0.0 < c.encoder_cache_tenant_share <= 1.0),
    _optional_at_least("num_kv_blocks", 1),
    Rule("state_checkpoint_interval, state_checkpoint_share", VALUES, ">= 1, in [0, 1)",
         "state_checkpoint_interval must be >= 1 and state_checkpoint_share in [0, 1), got "
         "{state_checkpoint_interval} and {state_checkpoint_share}",
         lambda c: c.state_checkpoint_interval < 1 or not 0.0 <= c.state_checkpoint_share < 1.0),
    Rule("gpu_memory_utilization", VALUES, "in (0, 1]",
         "gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}",
         lambda c: not 0.0 < c.gpu_memory_utilization <= 1.0),
    Rule("background_token_budget, background_window_s", VALUES, ">= 1, >= 0",
         "background_token_budget must be >= 1 and background_window_s >= 0, got {background_token_budget} and "
         "{background_window_s}", lambda c: c.background_token_budget < 1 or c.background_window_s < 0),
    Rule("starvation_bound_s", VALUES, "> 0 or none",
         "starvation_bound_s must be > 0 seconds or None (no bound), got {starvation_bound_s}",
         lambda c: c.starvation_bound_s is not None and not c.starvation_bound_s > 0),
    Rule("host_cache_gb, disk_cache_gb", VALUES, ">= 0",
         "host_cache_gb and disk_cache_gb must be >= 0, got {host_cache_gb} and {disk_cache_gb}",
         lambda c: c.host_cache_gb < 0 or c.disk_cache_gb < 0),
    Rule("disk_cache_dir", REQUIRES, "disk_cache_gb (and the other way round)",
         "disk_cache_dir and disk_cache_gb go together: set both (--disk-cache-dir DIR --disk-cache-gb N) or neither",
         lambda c: (c.disk_cache_dir is None) != (c.disk_cache_gb == 0)),
    Rule("disk_cache_dir", REQUIRES, _HOST_TIER,
         "the disk cache tier loads through the host tier: set host_cache_gb > 0 too",
         lambda c: c.host_cache_gb == 0 and c.disk_cache_dir is not None),
    Rule(_HOST_TIER, REQUIRES, "enable_prefix_caching",
         "host_cache_gb needs enable_prefix_caching: the tiers hold prefix-cache blocks",
         lambda c: c.host_cache_gb > 0 and not c.enable_prefix_caching),
    Rule(_HOST_TIER, EXCLUDES, "pipeline_parallel_size > 1, data_parallel_size > 1",
         "the prefix-cache tiers (host_cache_gb) are not served with pipeline or data parallelism yet (tensor "
         "parallelism is): set their sizes to 1",
         lambda c: c.host_cache_gb > 0 and (c.pipeline_parallel_size > 1 or c.data_parallel_size > 1)),
    Rule("disk_cache_dir", EXCLUDES, "several ranks (tensor_parallel_size > 1)",
         "the disk cache tier is served by single-process engines for now: with tensor parallelism use the host tier "
         "alone (no disk_cache_dir)", lambda c: c.host_cache_gb > 0 and c.disk_cache_dir is not None
         and c.engine_ranks > 1),
    Rule(_HOST_TIER, EXCLUDES, "speculative draft",
         "the prefix-cache tiers (host_cache_gb) do not hold the draft model's cache: use speculative='ngram' or no "
         "speculation with them", lambda c: c.host_cache_gb > 0 and c.speculative == "draft"),
    _at_least("kv_cache_memory_gb", 0, strict=True),
    _one_of("role", ROLES),
    _one_of("kv_eviction_policy", EVICTION_POLICIES),
    Rule("role prefill / decode", REQUIRES, "enable_prefix_caching",
         "role {role} finds the blocks it hands over by their prefix hashes: keep enable_prefix_caching on",
         lambda c: c.role != "both" and not c.enable_prefix_caching),
    _role_single_process("tensor_parallel_size"),
    _role_single_process("pipeline_parallel_size"),
    _role_single_process("data_parallel_size"),
    _at_least("decode_prefill_chunk_tokens", 0),
    Rule("kv_transfer_timeout_s, local_prefill_tokens, prefill_queue_tokens", VALUES, "> 0, >= 0, >= 0",
         "kv_transfer_timeout_s must be > 0, local_prefill_tokens and prefill_queue_tokens >= 0, got "
         "{kv_transfer_timeout_s}, {local_prefill_tokens} and {prefill_queue_tokens}",
         lambda c: c.kv_transfer_timeout_s <= 0 or c.local_prefill_tokens < 0 or c.prefill_queue_tokens < 0),
)


def feature_rows() -> list[tuple[str, str, str, str]]:
    """(setting, relation, other settings, refusal) of each needs and excludes rule, in table order; settings by
    their ``EngineConfig`` names (``LLM()``'s keywords; the flags are the same names with dashes, ``--help`` shows
    the few that differ), a refusal's values as ``<field>``."""
    return [(r.setting, r.relation, r.other, re.sub(r"\{(\w+)[^}]*\}", r"<\1>", r.message)) for r in RULES
            if r.relation != VALUES]


def feature_table() -> str:
    """The needs and excludes rules as a Markdown table (docs/configuration.md)."""
    rows = ["| setting | relation | other settings | refusal |", "| --- | --- | --- | --- |"]
    rows += [f"| {setting} | {relation} | {other} | {message.replace('|', chr(92) + '|')} |"
             for setting, relation, other, message in feature_rows()]
    return "\n".join(rows) + "\n"


def feature_text() -> str:
    """The needs and excludes rules for a terminal (``moegate features``): each as a line, its refusal under it."""
    return "".join(f"{setting} {relation} {other}\n    {message}\n" for setting, relation, other, message in feature_rows())
