"""The synchronous engine: add requests, step, read outputs. One step = schedule, execute, update."""

import itertools
import logging

import torch

from engine.core.config import CacheConfig, EngineConfig, KernelChoice, SchedulerConfig
from engine.text.prompts import InputProcessor
from engine.loading.model_config import CheckpointError, load_model_config
from engine.loading.model_loader import build_model
from engine.core.outputs import OutputProcessor, RequestOutput
from engine.core.request import Request
from engine.worker.runner import ModelRunner, kv_bytes_per_block
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.stats import EXPERT_LOAD_EVERY_CUDA, SchedulerStats
from engine.text.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # half precision matmuls are slow and inexact on most CPUs
    return _DTYPES.get(checkpoint_dtype, torch.bfloat16) if checkpoint_dtype != "float32" else torch.bfloat16


class LLMEngine:
    """Loads a checkpoint and serves requests step by step (no threads, no I/O beyond loading)."""

    def __init__(self, config: EngineConfig, kernel_choice: KernelChoice | None = None) -> None:
        """``kernel_choice`` overrides what ``config.kernels`` resolves to (to compare one part's kernels)."""
        self.config = config
        self.device = resolve_device(config.device)
        if config.random_weights:
            from engine.loading.random_weights import random_model_config

            self.model_config = random_model_config(config.random_weights)
        else:
            self.model_config = load_model_config(config.model)
        if self.device.type == "cpu" and config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        self.dtype = resolve_dtype(config.dtype, self.model_config.torch_dtype, self.device)
        self.kernels = kernel_choice or KernelChoice.resolve(config.kernels, self.device.type)
        if self.kernels.uses_triton:
            import moe_kernels

            if "triton" not in moe_kernels.available_backends():
                raise ValueError("the triton kernels need CUDA (or TRITON_INTERPRET=1 for CPU testing)")
        max_len = min(config.max_model_len or self.model_config.max_position_embeddings, self.model_config.max_position_embeddings)
        torch.manual_seed(config.seed)
        if config.random_weights:
            from engine.loading.random_weights import build_random_model

            self.model = build_random_model(self.model_config, self.dtype, self.device, self.kernels.moe, max_len, config.seed)
        else:
            self.model = build_model(self.model_config, config.model, self.dtype, self.device, self.kernels.moe, max_len)
        if self.kernels.elementwise == "triton":
            from engine.transforms.fusion import enable_triton_elementwise

            enable_triton_elementwise(self.model)
        # Before the KV pool is sized: the measurement's scratch memory is given back by then.
        self.dense_gemv_choices = []
        if self.kernels.dense_gemv != "off":
            from engine.transforms.gemv_select import apply_dense_gemv

            self.dense_gemv_choices = apply_dense_gemv(self.model, self.device, self.kernels.dense_gemv)
        num_blocks = config.num_kv_blocks or self._num_blocks_for_memory()
        # A sequence can never hold more tokens than the whole pool.
        self.max_model_len = min(max_len, num_blocks * config.block_size)
        cache_config = CacheConfig(config.block_size, num_blocks, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                background_token_budget=config.background_token_budget,
                background_window_s=config.background_window_s,
            ),
            cache_config,
        )
        self._expert_load_read_at = -EXPERT_LOAD_EVERY_CUDA  # runner.num_steps at the last expert-load read
        self.runner = ModelRunner(self.model, cache_config, self.device, self.dtype, config.seed, self.kernels.attention)
        # The torch MoE backend reads expert counts on the host, which a graph capture forbids.
        graph_safe_moe = self.kernels.moe != "torch"
        if self.device.type == "cuda" and graph_safe_moe:
            from engine.transforms.warmup import warm_up_moe

            warm_up_moe(self.model, config.max_num_batched_tokens, self.device, self.dtype)
        if self.device.type == "cuda" and self.kernels.attention == "triton" and graph_safe_moe and not config.enforce_eager:
            from engine.transforms.cuda_graphs import enable_decode_graphs

            enable_decode_graphs(self.runner, config.cuda_graph_batch_sizes, config.max_num_seqs, self.max_model_len)
        tokenizer_dir = config.tokenizer or (None if config.random_weights else config.model)
        self.tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else None
        self.inputs = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        logger.info(
            "engine ready: %s%s on %s/%s, %s attention, %d KV blocks of %d tokens, max_model_len %d, CUDA graphs %s",
            self.model_config.architecture, " (RANDOM WEIGHTS)" if config.random_weights else "", self.device, self.dtype,
            self.kernels.attention, num_blocks, config.block_size, self.max_model_len,
            self.runner.decode_graphs.sizes if self.runner.decode_graphs else "off",
        )

    def _num_blocks_for_memory(self) -> int:
        per_block = kv_bytes_per_block(self.model, self.config.block_size, self.dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - self.config.gpu_memory_utilization) * total
        else:
            budget = self.config.kv_cache_memory_gb * 2**30
        return max(int(budget // per_block), 1)

    # ---- requests --------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of text (or checked token ids), without the length checks of ``prepare_prompt``."""
        return self.inputs.encode(prompt) if isinstance(prompt, str) else self.inputs.token_ids(prompt)

    def prepare_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a servable prompt, or ValueError (``InvalidPrompt``) saying why it is not."""
        return self.inputs.token_ids(prompt)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 1,
        tenant: str = "default",
        weight: float = 1.0,
        preemptible: bool = True,
        background: bool = False,
        may_preempt: bool = True,
    ) -> str:
        """Queue a request; raises ValueError (nothing queued) for a prompt that cannot be served."""
        prompt_ids = self.prepare_prompt(prompt)
        room = self.max_model_len - len(prompt_ids)
        max_tokens = min(params.max_tokens or room, room)
        request_id = request_id if request_id is not None else str(next(self._ids))
        eos = self.model_config.eos_token_ids[0] if self.model_config.eos_token_ids else None
        if weight <= 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        request = Request(
            request_id, prompt_ids, params, max_tokens, eos_token_id=eos, cache_salt=cache_salt,
            priority=priority, tenant=tenant, weight=weight, preemptible=preemptible, background=background,
            may_preempt=may_preempt,
        )
        self.output_processor.add_request(request)
        try:
            self.scheduler.add_request(request)
        except BaseException:  # all or nothing: a request the scheduler refused leaves no state behind
            self.output_processor.discard(request_id)
            raise
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        return self.output_processor.abort(request) if request is not None else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update: one iteration of continuous batching; returns what changed."""
        plan = self.scheduler.schedule()
        sampled = self.runner.execute(plan)
        return self.output_processor.process(self.scheduler.update(plan, sampled), self.scheduler)

    def stats(self) -> SchedulerStats:
        """The scheduler's counters and the last step's host times; the expert load where it is cheap to read
        (every step on the CPU, every ``EXPERT_LOAD_EVERY_CUDA`` steps on CUDA, where reading it syncs)."""
        stats = self.scheduler.stats()
        stats.step_schedule_ms = self.scheduler.last_step_ms
        stats.step_prepare_ms = self.runner.last_prepare_ms
        stats.step_execute_ms = self.runner.last_execute_ms
        steps = self.runner.num_steps
        if self.device.type == "cpu" or steps - self._expert_load_read_at >= EXPERT_LOAD_EVERY_CUDA:
            self._expert_load_read_at = steps
            stats.expert_load = self.runner.expert_load()
        return stats


__all__ = ["LLMEngine", "CheckpointError"]
