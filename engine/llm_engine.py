"""The synchronous engine: add requests, step, read outputs. One step = schedule, execute, update."""

import itertools
import logging
import time

import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.inputs import InputProcessor
from engine.model_config import CheckpointError, load_model_config
from engine.model_loader import build_model
from engine.outputs import OutputProcessor, RequestOutput
from engine.request import Request
from engine.runner import ModelRunner, kv_bytes_per_block
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.stats import EXPERT_LOAD_EVERY_CUDA, SchedulerStats
from engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is available")
    return torch.device(name)


def resolve_kernel_backend(name: str, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA, 'torch' elsewhere (attention and elementwise backends)."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def resolve_dtype(name: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # half precision matmuls are slow and inexact on most CPUs
    return _DTYPES.get(checkpoint_dtype, torch.bfloat16) if checkpoint_dtype != "float32" else torch.bfloat16


class LLMEngine:
    """Loads a checkpoint and serves requests step by step (no threads, no I/O beyond loading)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if config.random_weights:
            from engine.random_weights import random_model_config

            self.model_config = random_model_config(config.random_weights)
        else:
            self.model_config = load_model_config(config.model)
        if self.device.type == "cpu" and config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        self.dtype = resolve_dtype(config.dtype, self.model_config.torch_dtype, self.device)
        self.attention_backend = resolve_kernel_backend(config.attention_backend, self.device)
        self.elementwise_backend = resolve_kernel_backend(config.elementwise_backend, self.device)
        if "triton" in (config.moe_backend, config.attention_backend, config.elementwise_backend) or config.dense_gemv == "on":
            import moe_kernels

            if "triton" not in moe_kernels.available_backends():
                raise ValueError("the triton backends need CUDA (or TRITON_INTERPRET=1 for CPU testing)")
        max_len = min(config.max_model_len or self.model_config.max_position_embeddings, self.model_config.max_position_embeddings)
        torch.manual_seed(config.seed)
        if config.random_weights:
            from engine.random_weights import build_random_model

            self.model = build_random_model(self.model_config, self.dtype, self.device, config.moe_backend, max_len, config.seed)
        else:
            self.model = build_model(self.model_config, config.model, self.dtype, self.device, config.moe_backend, max_len)
        if self.elementwise_backend == "triton":
            from engine.layers.fusion import enable_triton_elementwise

            enable_triton_elementwise(self.model)
        # Before the KV pool is sized: the measurement's scratch memory is given back by then.
        self.dense_gemv_choices = []
        if config.dense_gemv == "on" or (config.dense_gemv == "auto" and self.device.type == "cuda"):
            from engine.dense_gemv_select import apply_dense_gemv

            self.dense_gemv_choices = apply_dense_gemv(self.model, self.device, "on" if config.dense_gemv == "on" else "measure")
        num_blocks = config.num_kv_blocks or self._num_blocks_for_memory()
        # A sequence can never hold more tokens than the whole pool.
        self.max_model_len = min(max_len, num_blocks * config.block_size)
        cache_config = CacheConfig(config.block_size, num_blocks, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                batching=config.batching, max_wait_ms=config.max_wait_ms,
                background_token_budget=config.background_token_budget,
                background_window_s=config.background_window_s,
            ),
            cache_config,
        )
        self.last_stats: SchedulerStats | None = None
        self._steps = 0
        self.runner = ModelRunner(self.model, cache_config, self.device, self.dtype, config.seed, self.attention_backend)
        # The torch MoE backend reads expert counts on the host, which a graph capture forbids.
        graph_safe_moe = config.moe_backend != "torch"
        if self.device.type == "cuda" and graph_safe_moe:
            from engine.warmup import warm_up_moe

            warm_up_moe(self.model, config.max_num_batched_tokens, self.device, self.dtype)
        if self.device.type == "cuda" and self.attention_backend == "triton" and graph_safe_moe and not config.enforce_eager:
            from engine.cuda_graphs import enable_decode_graphs

            enable_decode_graphs(self.runner, config.cuda_graph_batch_sizes, config.max_num_seqs, self.max_model_len)
        tokenizer_dir = config.tokenizer or (None if config.random_weights else config.model)
        self.tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else None
        self.inputs = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        logger.info(
            "engine ready: %s%s on %s/%s, %s attention, %d KV blocks of %d tokens, max_model_len %d, CUDA graphs %s",
            self.model_config.architecture, " (RANDOM WEIGHTS)" if config.random_weights else "", self.device, self.dtype,
            self.attention_backend, num_blocks, config.block_size, self.max_model_len,
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
        t0 = time.perf_counter()
        sched_out = self.scheduler.schedule()
        t1 = time.perf_counter()
        sampled = self.runner.execute(sched_out)
        t2 = time.perf_counter()
        updates = self.scheduler.update(sched_out, sampled)
        t3 = time.perf_counter()
        self.last_stats = self.scheduler.stats()
        self.last_stats.step_schedule_ms = ((t1 - t0) + (t3 - t2)) * 1e3
        self.last_stats.step_prepare_ms = self.runner.last_prepare_ms
        self.last_stats.step_execute_ms = (t2 - t1) * 1e3
        self._steps += 1
        if self.device.type == "cpu" or self._steps % EXPERT_LOAD_EVERY_CUDA == 0:
            self.last_stats.expert_load = self.runner.expert_load()
        return self.output_processor.process(updates, self.scheduler)


__all__ = ["LLMEngine", "CheckpointError"]
