"""The synchronous engine: add requests, step, read outputs. One step = schedule, execute, update."""

import itertools
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import msgspec
import torch

from engine.core.config import EngineConfig, KernelChoice
from engine.text.prompts import InputProcessor
from engine.core.family_support import check_family_support
from engine.core.model_config import CheckpointError
from engine.distributed.collectives import SINGLE
from engine.distributed.groups import CollectiveError
from engine.distributed.pipeline import WHOLE, StageTiming
from engine.ranks.engine_ranks import EngineRanks
from engine.core.outputs import OutputProcessor, RequestOutput, merge_step_outputs
from engine.core.parallel_sampling import ChoiceGroups, child_id, choice_params
from engine.core.prompt_images import PromptImage
from engine.core.request import Request, RequestStatus
from engine.core.lora_residency import registered_name
from engine.core.request_policy import DEFAULT_POLICY, RequestPolicy
from engine.worker.cpu_allocator import keep_freed_memory
from engine.worker.model_setup import engine_model_config, resolve_dtype
from engine.ranks.rank_builder import BuiltRank, Leader, build_rank, build_scheduler, check_kernels
from engine.worker.pipeline_overlap import PipelinedSteps
from engine.worker.rank_messages import AskStageTimings, send_message
from engine.worker.overlap import OverlappedRunner, StepInFlight, fill_placeholders, waits_for_step_in_flight
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import SchedulerOutput
from engine.core.stats import SchedulerStats, TierStats
from engine.eplb.policy import mean_imbalance
from engine.text.tokenizer import check_vocabulary, load_tokenizer

logger = logging.getLogger(__name__)

# Devices where overlapped scheduling is on unless EngineConfig.overlap_scheduling says otherwise.
OVERLAP_BY_DEFAULT = ("cuda",)
# An engine with nothing to run but requests waiting for adapters' reads waits this long at most per step.
LORA_READ_WAIT_S = 0.05
# ... or for images' pixels being preprocessed on its image worker (some 25 ms a 448x448 PNG on the CPU).
IMAGE_WAIT_S = 0.02


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is available")
    return torch.device(name)


def _replica_note(config: EngineConfig) -> str:
    """How the engine's ranks sit among the experts' group, for its start-up line."""
    if not config.enable_expert_parallel:
        return ""
    if config.data_parallel_size == 1:
        return " (experts divided)"
    return (f", replica {config.data_parallel_rank} of {config.data_parallel_size} (experts divided over "
            f"{config.data_parallel_size * config.tensor_parallel_size} ranks)")


def _prepare_host(config: EngineConfig, device: torch.device) -> None:
    """The engine process's CPU settings: its torch threads, and a heap that keeps freed pages."""
    if device.type == "cpu" and config.cpu_threads is not None:
        torch.set_num_threads(config.cpu_threads)
    if device.type == "cpu":
        keep_freed_memory()  # step activations reuse heap pages: fewer page faults per step


class LLMEngine:
    """Loads a checkpoint and serves requests step by step (no threads, no I/O beyond loading)."""

    def __init__(self, config: EngineConfig, kernel_choice: KernelChoice | None = None) -> None:
        """``kernel_choice`` overrides what ``config.kernels`` resolves to (to compare one part's kernels)."""
        self.config = config
        self._image_config = None  # the image preprocessing settings, read at the first request with images
        self._seen_images = None  # encoded images already preprocessed (engine.vision.prompt_images.SeenImages)
        self._image_worker = None  # the thread images are preprocessed on (engine.vision.image_worker), once needed
        self._images_lock = threading.Lock()  # the three above are made once, on whichever thread asks first
        self.device = resolve_device(config.device)
        self.model_config = engine_model_config(config)
        check_family_support(config, self.model_config)
        _prepare_host(config, self.device)
        self.dtype = resolve_dtype(config.dtype, self.model_config.torch_dtype, self.device)
        self.kernels = kernel_choice or KernelChoice.resolve(config.kernels, self.device.type)
        check_kernels(self.kernels)
        tokenizer_dir = config.tokenizer or (None if config.random_weights else config.model)
        self.tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else None
        check_vocabulary(self.tokenizer, self.model_config.vocab_size, tokenizer_dir)
        # Several ranks: this process is its replica's rank 0 (it schedules and samples); the replica's other
        # ranks follow its plans, and replicas sharing their experts step together.
        self.ranks = EngineRanks(config, self.device, self.model_config, self.dtype) \
            if config.engine_ranks > 1 or config.data_parallel_size > 1 else None
        rank = self._build_rank()
        self.model, self.runner, self.max_model_len = rank.model, rank.runner, rank.max_model_len
        self.dense_gemv_choices, self.lora, self.tiers = rank.dense_gemv_choices, rank.runner.lora, rank.runner.tiers
        self.scheduler = build_scheduler(config, rank)
        self.inputs = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.choice_groups = ChoiceGroups(share_prefill=rank.cache_config.enable_prefix_caching)
        # Requests ended because their adapter could not be read (output id -> why), until ``take_rejected``.
        self._rejected: dict[str, str] = {}
        self._ids = itertools.count()
        self._overlap, self._pipeline = self._step_drivers()
        self._in_flight: StepInFlight | None = None
        self._held_outputs: list[RequestOutput] = []  # of a pipelined step finished between two step() calls
        try:
            for name, path in config.lora_adapter_paths.items():  # the same path as adapters added while serving
                self.add_lora(name, path)
        except BaseException:
            self.close(abrupt=True)
            raise
        self._log_ready(rank.cache_config.num_blocks)

    def _build_rank(self) -> BuiltRank:
        """This process's rank (``engine.ranks.rank_builder``); on a failure the other ranks, which may be inside a
        collective, are ended without a word."""
        leader = Leader(self.tokenizer, self._eos_token_id, self.ranks.drivers if self.ranks is not None else None)
        try:
            return build_rank(self.config, self.model_config, self.kernels, self.dtype, self.device,
                              self.ranks.tp if self.ranks else SINGLE, self.ranks.stage if self.ranks else WHOLE, leader)
        except BaseException:
            if self.ranks is not None:
                self.ranks.abort()
            raise

    def _step_drivers(self) -> tuple[OverlappedRunner | None, PipelinedSteps | None]:
        """Overlapped steps: the host prepares step N+1 while the device runs step N (engine.worker.overlap).
        Every rank must see each plan before it runs, and data-parallel peers step in lockstep: those stay
        synchronous. A pipelined engine's steps overlap across its stages instead (engine.worker.pipeline_overlap)."""
        overlap = self.config.overlap_scheduling
        if overlap is None:  # speculative decoding needs each step's verified tokens before the next
            overlap = self.device.type in OVERLAP_BY_DEFAULT and self.config.speculative is None
        if overlap and (self.runner.plans.size > 1 or self.runner.steps_with_peers):
            if not self.runner.stage.pipelined:
                logger.info("overlapped scheduling is off: it needs a single-process engine")
            overlap = False
        pipeline = (PipelinedSteps(self.runner, self.config.distributed_timeout_s)
                    if self.config.overlaps_pipeline_steps else None)
        return (OverlappedRunner(self.runner) if overlap else None), pipeline

    def _log_ready(self, num_blocks: int) -> None:
        config, runner = self.config, self.runner
        overlap = self._overlap is not None or self._pipeline is not None
        logger.info(
            "engine ready: %s%s on %s/%s x%d ranks%s, %s attention, %d KV blocks of %d tokens, max_model_len %d, "
            "CUDA graphs %s, piecewise CUDA graphs %s, overlapped scheduling %s",
            self.model_config.architecture, " (RANDOM WEIGHTS)" if config.random_weights else "", self.device, self.dtype,
            config.engine_ranks, _replica_note(config),
            runner.attention_backend, num_blocks, config.block_size, self.max_model_len,
            runner.decode_graphs.sizes if runner.decode_graphs else "off",
            f"{pw.sizes} (captured in {pw.capture_s:.1f} s)" if (pw := runner.piecewise_graphs) else "off",
            ("on (pipeline stages)" if self._pipeline is not None else "on") if overlap else "off",
        )

    def close(self, abrupt: bool = False) -> None:
        """Stop the other ranks of a multi-process engine (a no-op for one process): tell them, or with ``abrupt``
        (after a failure, when they may be inside a collective) leave the group and end this node's ranks."""
        if self._image_worker is not None:
            self._image_worker.close()
        if self._overlap is not None:
            self._overlap.close()
        if self._pipeline is not None:
            try:
                if not abrupt:
                    self._finish_pipeline()
            except CollectiveError as e:  # a rank already gone: the others end when their connections close
                logger.warning("could not finish the step in flight: %s", e)
            finally:
                self._pipeline.close()
        if self.tiers is not None:
            self.tiers.close()  # the disk writes queued so far land
        if self.lora is not None:
            self.lora.close()
        ranks, self.ranks = self.ranks, None
        if ranks is not None:
            ranks.abort() if abrupt else ranks.close()

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
        sampling_params: SamplingParams,
        request_id: str | None = None,
        policy: RequestPolicy = DEFAULT_POLICY,
        images: Sequence[Any] = (),
    ) -> str:
        """Queue a request; raises ValueError (nothing queued) for a prompt that cannot be served.

        ``images`` (a model that reads them, ``ModelConfig.multimodal_config``): encoded bytes, PIL images or
        preprocessed ``ProcessedImage``s, one per run of image placeholder tokens in the prompt, in order (or what
        ``prompt_images`` made of them); the prompt holds each image's placeholders already expanded (one token per
        merged patch window).

        ``sampling_params.n`` > 1 queues n copies sharing the prompt's prefill (``engine.core.parallel_sampling``);
        their outputs carry ``request_id`` and their ``index``, and aborting ``request_id`` ends them all.
        ``policy``: how the scheduler treats it (priority class, tenant, preemption, ...), shared by the copies.
        """
        prompt_ids = self.prepare_prompt(prompt)
        prompt_images = images if images and all(isinstance(im, PromptImage) for im in images) \
            else self.prompt_images(prompt_ids, images, policy.cache_salt)
        room = self.max_model_len - len(prompt_ids)
        max_tokens = min(sampling_params.max_tokens or room, room)
        request_id = request_id if request_id is not None else str(next(self._ids))
        eos = self._eos_token_id
        if sampling_params.structured_output is not None:
            self._check_structured_output(sampling_params)
        if policy.lora_adapter is not None and (self.lora is None
                                                or not self.scheduler.lora.is_registered(policy.lora_adapter)):
            # Serving the base model under an adapter's name would be a silent wrong answer: refused, nothing queued.
            raise ValueError(f"lora_adapter {policy.lora_adapter!r} is not loaded in this engine "
                             f"(loaded: {self.list_loras() or 'none'})")
        if policy.lora_adapter is not None:  # the registration it runs under: a name added again later is another
            policy = msgspec.structs.replace(policy, lora_adapter=self.scheduler.lora.key(policy.lora_adapter))
        if request_id in self.choice_groups:
            raise ValueError(f"duplicate request id {request_id}")

        def make(rid: str, copy_params: SamplingParams, parent_id: str | None, index: int) -> Request:
            return Request(rid, prompt_ids, copy_params, max_tokens, eos_token_id=eos, policy=policy,
                           parent_id=parent_id, index=index, images=prompt_images)

        if sampling_params.n == 1:
            copies = [make(request_id, sampling_params, None, 0)]
            now = copies
        else:
            copies = [make(child_id(request_id, i), choice_params(sampling_params, i), request_id, i)
                      for i in range(sampling_params.n)]
            now = self.choice_groups.add(request_id, copies)
        if self.tiers is not None:  # every request carries its tenant's current share and class (live and Batch API)
            self.tiers.set_share(policy.tenant, policy.cache_share, policy.priority)
        for request in copies:
            self.output_processor.add_request(request)
        added = []
        try:
            for request in now:
                self.scheduler.add_request(request)
                added.append(request)
        except BaseException:  # all or nothing: a request the scheduler refused leaves no state behind
            for request in added:
                self.scheduler.abort(request.request_id)
            for request in copies:
                self.output_processor.discard(request.request_id)
            self.choice_groups.forget(request_id)
            raise
        return request_id

    def prompt_images(self, prompt_ids: list[int], images: Sequence[Any],
                      cache_salt: str | None = None) -> tuple[PromptImage, ...]:
        """A prompt's images matched with its placeholder runs (``engine.vision.prompt_images``), which
        ``add_request`` takes as they are (with a policy of the same ``cache_salt``); ValueError for images given
        to a text model, or images that do not fit the prompt. New images are preprocessed and hashed on the
        calling thread; encoded bytes this salt sent before are not preprocessed again here (only if the vision
        tower must run on them, then on the engine's image worker). A caller that steps the engine on the same
        thread uses ``prepare_images`` instead."""
        whole = self.model_config.multimodal_config
        if whole is None:
            if images:
                raise ValueError(f"images were given but {self.model_config.architecture} reads text only")
            return ()
        from engine.vision.prompt_images import attach_images  # Pillow: image models

        if images:  # a text prompt needs no image settings: only the check that it holds no placeholders
            self._image_setup()
        return attach_images(prompt_ids, list(images), int(whole.image_token_id), self._image_config,
                             seen=self._seen_images, salt=cache_salt, worker=self._image_worker)

    def prepare_images(self, prompt: str | list[int], images: Sequence[Any],
                       cache_salt: str | None = None) -> "Future[tuple[PromptImage, ...]]":
        """``prompt_images`` on the engine's image worker thread, for a caller that steps the engine (the engine
        process's loop): no image is decoded, preprocessed or hashed on its thread. The future's result is what
        ``add_request`` takes as is (with a policy of the same ``cache_salt``); its exception is the ValueError
        ``add_request`` would raise. Bytes seen before whose features the encoder cache does not hold now are
        preprocessed there too; those it holds stay lazy (evicted before the tower reads them, they are
        preprocessed on the same worker while the scheduler has the image wait: ``Scheduler.image_ready``)."""
        self._image_setup()
        return self._image_worker.submit(self._prepared_images, prompt, list(images), cache_salt)

    def _prepared_images(self, prompt: str | list[int], images: list[Any],
                         cache_salt: str | None) -> tuple[PromptImage, ...]:
        from engine.vision.prompt_images import pixels_of

        prompt_images = self.prompt_images(self.prepare_prompt(prompt), images, cache_salt)
        for image in prompt_images:  # a membership read: the loop may change the cache meanwhile (the gate covers it)
            if not self.model.image_cached(image.digest, cache_salt):
                pixels_of(image.pixels)
        return prompt_images

    def _image_setup(self) -> None:
        """The image settings, the seen images and the image worker, made at the first request with images."""
        with self._images_lock:
            if self._image_worker is not None:
                return
            from engine.vision.image_worker import ImageWorker
            from engine.vision.prompt_images import SeenImages, image_config_for

            whole = self.model_config.multimodal_config
            if whole is not None:
                self._image_config = image_config_for(self.config.model, whole.vision_config)
                self._seen_images = SeenImages()
            self._image_worker = ImageWorker()

    # ---- LoRA adapters ------------------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Register the PEFT LoRA adapter at ``path`` as ``name``; requests may name it from now on. Its directory
        is read and checked now (ValueError, one line: not a LoRA directory, rank above ``max_lora_rank``, a module
        this engine does not adapt); it is written into a device slot when a request needs it. Adding the same
        name and path again does nothing; a name registered now with another path is refused (remove it first).
        A name removed earlier may be added again from any directory: requests added from then on run under the
        directory read now, requests still running under the earlier one finish under it."""
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora (--enable-lora)")
        residency = self.scheduler.lora
        if not residency.check_new(name, path):
            return
        key = self.lora.hold(name, path)  # ValueError naming what is wrong; nothing registered (starts the reader)
        residency.register(name, path, key)

    def remove_lora(self, name: str) -> None:
        """Unregister adapter ``name``: new requests naming it are refused from now on; requests already added
        finish under it (as vLLM lets requests in flight finish), then its slot and host copy are freed.
        ValueError if it is not registered."""
        if self.lora is None:
            raise ValueError(f"lora adapter {name!r} is not registered (this engine serves no LoRA adapters)")
        self.scheduler.lora.remove(name)
        self.lora.forget(name)

    def list_loras(self) -> list[str]:
        """The registered adapters' names, in registration order."""
        return self.scheduler.lora.names() if self.lora is not None else []

    @property
    def _eos_token_id(self) -> int | None:
        return self.model_config.eos_token_ids[0] if self.model_config.eos_token_ids else None

    def _check_structured_output(self, sampling_params: SamplingParams) -> None:
        if self.runner.sampler.grammars is None:
            raise ValueError("structured output needs the checkpoint's tokenizer, and this engine has none")
        if sampling_params.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with structured output: a finished output ends with EOS")
        self.runner.sampler.grammars.prepare(sampling_params.structured_output)  # ValueError naming what the library refuses

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request (every copy of an ``n`` > 1 one); its last output, or None if it was not running."""
        if request_id in self.choice_groups:
            copies = self.choice_groups.members(request_id)
            for request in self.choice_groups.forget(request_id):  # never scheduled: nothing to free
                self.output_processor.discard(request.request_id)
            outputs = [self._abort_one(r.request_id) for r in copies]
            return next((o for o in outputs if o is not None), None)
        return self._abort_one(request_id)

    def release(self, request_id: str) -> bool:
        """Drop a request that has not started: still waiting, no token computed or generated (a preempted
        request has generated tokens and stays). True if dropped; False, with nothing changed, if it had
        started, is unknown, or has ``n`` > 1 copies (they start at different times)."""
        if request_id in self.choice_groups:
            return False
        request = self.scheduler.requests.get(request_id)
        if (request is None or request.status != RequestStatus.WAITING or request.num_computed_tokens
                or request.output_token_ids):
            return False
        self._abort_one(request_id)
        return True

    def _abort_one(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        return self.output_processor.abort(request) if request is not None else None

    def has_unfinished(self) -> bool:
        """Whether a request is unfinished, or a step is still in flight (overlapped scheduling)."""
        return (self.scheduler.has_unfinished() or self._in_flight is not None
                or (self._pipeline is not None and (self._pipeline.busy or bool(self._held_outputs))))

    def step_needed(self) -> bool:
        """Whether to call ``step()`` now: this engine has work or, for data-parallel engines sharing experts,
        any of them has (a collective: call it once per loop on every engine of the group)."""
        if self.ranks is not None:
            return self.ranks.any_busy(self.has_unfinished())
        return self.has_unfinished()

    # ---- one step -------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update: one iteration of continuous batching; returns what changed.

        With overlapped scheduling the outputs returned are those of the step launched by the previous call
        (this call launches the next one), so each request's outputs arrive one call later; the outputs
        themselves are the synchronous loop's."""
        failed = self._fail_unreadable_adapters() if self.lora is not None else []
        plan = self.scheduler.schedule()
        if plan.is_empty and self._in_flight is None and self.lora is not None and self.scheduler.num_lora_waiting:
            self.lora.host.wait_for_reads(LORA_READ_WAIT_S)  # nothing to run until an adapter is read
        if plan.is_empty and self._in_flight is None and self.scheduler.images_preparing:
            # nothing to run until an image's pixels are ready: those (urgent on the worker), not the
            # preparation of requests that arrived since
            self._image_worker.wait(IMAGE_WAIT_S, urgent=True)
        if self._pipeline is not None:
            outputs = self._step_pipelined(plan)
        else:
            outputs = self._run_synchronously(plan) if self._overlap is None else self._step_overlapped(plan)
        # Copies of an n > 1 request whose leader has now computed the prompt join the queue for the next step.
        for request in self.choice_groups.release():
            self.scheduler.add_request(request)
        outputs = failed + outputs
        for out in outputs:
            if out.finished and out.request_id in self.choice_groups and self.choice_groups.finished(out.request_id):
                self.choice_groups.forget(out.request_id)
        return outputs

    def _fail_unreadable_adapters(self) -> list[RequestOutput]:
        """End the requests waiting for an adapter whose read failed (its directory changed since it was added:
        gone, or its weights no longer finite), each with finish_reason 'error' and the reason as its stop_reason;
        nothing else is touched. A later request for the adapter reads it again."""
        outputs = []
        for (key, _), reason in self.lora.host.failures().items():
            why = f"model {registered_name(key)!r} cannot be served now: {reason}"
            for request in self.scheduler.fail_lora_waiting(key, why):
                self._rejected[request.output_id] = why
                out = self.output_processor.abort(request)
                if out is not None:
                    outputs.append(out)
        return outputs

    def take_rejected(self) -> dict[str, str]:
        """Requests (output ids) that ``step`` ended because their adapter could not be read, and why, since the
        last call: the engine process answers them as refused (naming ``model``), not as failed outputs."""
        rejected, self._rejected = self._rejected, {}
        return rejected

    def _run_synchronously(self, plan: SchedulerOutput) -> list[RequestOutput]:
        sampled = self.runner.execute(plan)
        updates = self.scheduler.update(plan, sampled.token_ids)
        return self.output_processor.process(updates, self.scheduler, sampled.logprobs, sampled.prompt_logprobs)

    def _step_overlapped(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """Launch ``plan`` (step N+1), then read the step in flight (N) and return its outputs: stop checks and
        detokenization run one step behind. A plan with a part that must see the step in flight's token first
        (``waits_for_step_in_flight``) is launched once that step is read; an empty plan launches nothing."""
        prev, self._in_flight = self._in_flight, None
        outputs: list[RequestOutput] = []
        if plan.is_empty or any(waits_for_step_in_flight(s) for s in plan.scheduled):
            outputs = self._resolve(prev) if prev is not None else []
            prev = None
            fill_placeholders(plan)
            if plan.is_empty:
                return merge_step_outputs(outputs + self._run_synchronously(plan))
        step = self._overlap.launch(plan, prev)
        if prev is not None:
            outputs = self._resolve(prev)
        self.scheduler.advance(plan)
        self._in_flight = step
        return outputs

    def _step_pipelined(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """Send ``plan`` (step N+1) into the pipeline's first stage; on the way the step in flight (N) comes back
        from the last stage, is sampled, and its outputs are returned (one call later, as overlapped). An empty
        plan with a step in flight finishes that step on every rank."""
        if plan.is_empty and not self._pipeline.busy:
            outputs, self._held_outputs = self._held_outputs, []
            return merge_step_outputs(outputs + self._run_synchronously(plan))
        outputs, self._held_outputs = self._held_outputs, []

        def resolve(prev: SchedulerOutput, sampled) -> None:
            updates = self.scheduler.resolve(prev, sampled.token_ids)
            outputs.extend(self.output_processor.process(updates, self.scheduler, sampled.logprobs,
                                                         sampled.prompt_logprobs))

        self._pipeline.step(plan, resolve)
        if not plan.is_empty:
            self.scheduler.advance(plan)
        return merge_step_outputs(outputs)

    def _finish_pipeline(self) -> None:
        """Finish the pipelined step in flight (its outputs come with the next ``step()``) and wait until every
        plan is sent: before another message on the plans' channel."""
        if self._pipeline.busy:
            self._held_outputs += self._step_pipelined(SchedulerOutput([], 0))
        self._pipeline.sender.drain()

    def _resolve(self, step: StepInFlight) -> list[RequestOutput]:
        sampled = self._overlap.collect(step)
        updates = self.scheduler.resolve(step.plan, sampled.token_ids)
        return self.output_processor.process(updates, self.scheduler, sampled.logprobs, sampled.prompt_logprobs)

    def stage_timings(self) -> list[StageTiming]:
        """How every rank of a pipelined engine spent its steps so far (each stage's busy and waiting time),
        in world rank order; a collective with every rank, between steps. Empty unless pipelined."""
        if not self.runner.stage.pipelined:
            return []
        if self._pipeline is not None:
            self._finish_pipeline()
        send_message(self.runner.plans, AskStageTimings())
        return self.runner.plans.all_gather_object(self.runner.stage.timing)

    def stats(self) -> SchedulerStats:
        """The scheduler's counters and the last step's host times; the expert load where a read is ready
        without waiting for the device (every step on the CPU; on CUDA a copy queued every
        ``EXPERT_LOAD_EVERY_CUDA`` steps, handed out once done: ``engine.eplb.expert_load``)."""
        stats = self.scheduler.stats()
        stats.step_schedule_ms = self.scheduler.last_step_ms
        stats.step_prepare_ms = self.runner.last_prepare_ms
        stats.step_execute_ms = self.runner.last_execute_ms
        if self.tiers is not None:
            stats.cache_tiers = [TierStats(tier, tenant, *counts) for tier, tenant, counts in self.tiers.counters.rows()]
            stats.host_tier_blocks = self.tiers.host.num_slots
        # On the CPU with overlapped steps this reads counters the worker may be adding to (a count at most
        # one step stale).
        if self.lora is not None:
            self._fill_lora_stats(stats)
        if self.model.takes_images:
            cache = self.model.encoder_cache
            stats.encoder_cache_hits, stats.encoder_cache_misses = cache.hits, cache.misses
            stats.encoder_cache_evictions, stats.encoder_cache_bytes = cache.evictions, cache.bytes_used
        stats.expert_load = self.runner.expert_load.poll(self.runner.num_steps)
        ep, balancer = self.model.tp.expert_parallel, self.runner.eplb
        if balancer is not None:
            balancer.fill_stats(stats, self.runner.group_steps)
        elif ep is not None and stats.expert_load:
            starts = ep.expert_starts(len(stats.expert_load[0]))
            per_layer = [[sum(layer[a:b]) for a, b in zip(starts, starts[1:])] for layer in stats.expert_load]
            stats.expert_load_by_rank = [sum(col) for col in zip(*per_layer)]
            stats.expert_imbalance = mean_imbalance(per_layer)
        return stats


    def _fill_lora_stats(self, stats: SchedulerStats) -> None:
        residency, host = self.scheduler.lora, self.lora.host
        stats.lora_registered = len(residency.names())
        stats.lora_resident = len(residency.slots)
        stats.lora_waiting_requests = self.scheduler.num_lora_waiting
        stats.lora_slot_loads, stats.lora_slot_evictions = residency.slot_loads, residency.slot_evictions
        stats.lora_host_hits, stats.lora_host_misses = host.hits, host.misses
        stats.lora_host_evictions, stats.lora_sync_reads = host.evictions, host.sync_reads
        stats.lora_read_seconds, stats.lora_slot_load_seconds = host.read_seconds, self.lora.slot_load_seconds


__all__ = ["LLMEngine", "CheckpointError"]
