"""Overlapped steps on the device side: launch step N+1 before step N's tokens are read.

Legend: T scheduled tokens, N requests that sample, F of them whose input token is the previous step's sample.

``launch`` builds the batch and the sampling inputs on the host (settings, penalties' token histories,
grammar masks, prompt-logprob targets) and queues the forward and the sampling; the sampled tokens stay
on the device, and the next step's batch takes its placeholder input ids (``scheduler.PLACEHOLDER``) from
them by one device-side gather, so no token makes a round trip through the host between steps. Logprobs
are computed where the step runs and read back with its tokens. ``collect`` reads a launched step's
tokens and logprobs, and advances grammars by its tokens.

Every request overlaps except one whose next step needs the host to have read its previous token
(``waits_for_step_in_flight``: a grammar, whose mask for the next token follows from the last one): a
plan holding one is launched once the step in flight is read, still without waiting for its own tokens.

On CUDA the queue is the stream: ``launch`` returns as soon as the kernels are queued, and the results are
copied to pinned host memory behind them (an event marks the copy), so reading step N waits for step N
only, never for step N+1 queued after it. On the CPU the "device" is a worker thread that runs each
launched step in turn: torch ops release the GIL, so the host schedules and prepares step N+1 while the
worker computes step N.
"""

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.core.scheduler import PLACEHOLDER, ScheduledRequest, SchedulerOutput
from engine.device_batch.flat_batch import FlatBatch
from engine.sampling.prompt_scoring import PromptScoring, prompt_scoring
from engine.worker.runner import ModelRunner
from engine.worker.state_cache import copy_states
from engine.worker.step_samples import StepSamples
from engine.sampling.sampler import DeviceSamples, StepSampling
from engine.device_batch.staging import stage_int64


def waits_for_step_in_flight(item: ScheduledRequest) -> bool:
    """Whether this part must wait until the step in flight is read before it is launched: its input token
    is still on the device and sampling its next one needs the host to have seen it (a grammar)."""
    return item.token_ids[-1] == PLACEHOLDER and item.request.sampling_params.structured_output is not None


def fill_placeholders(plan: SchedulerOutput) -> None:
    """Put the real tokens in a plan's placeholders once the step they stood for is resolved."""
    for item in plan.scheduled:
        if item.token_ids and item.token_ids[-1] == PLACEHOLDER:
            item.token_ids[-1] = item.request.all_token_ids[item.start + item.num_new_tokens - 1]


@dataclass(slots=True)
class _DeviceResults:
    """What a launched step leaves on the device for the host to read."""

    samples: DeviceSamples | None  # None: no request sampled
    prompt_values: torch.Tensor | None = None  # [Q, 1 + K] prompt logprobs (PromptScoring.compute)
    prompt_ids: torch.Tensor | None = None

    def to_read(self) -> list[torch.Tensor]:
        reads = self.samples.to_read() if self.samples is not None else []
        return reads + ([self.prompt_values, self.prompt_ids] if self.prompt_values is not None else [])


@dataclass(slots=True)
class StepInFlight:
    """A launched step: its plan, its sampling inputs, the row of each sampling request's token, and where
    its results will be."""

    plan: SchedulerOutput
    sampling: StepSampling | None  # None: no request samples
    scoring: PromptScoring | None  # prompt logprobs the step computes
    rows: dict[str, int]  # request id -> row in the step's sampled tokens
    results: "Future[_DeviceResults] | _DeviceResults | None" = None  # a worker's future (CPU), or on the device
    host_copies: list[torch.Tensor] | None = None  # pinned copies of the results' tensors (CUDA)
    copied: torch.cuda.Event | None = None  # recorded after those copies (CUDA)
    compute_ms: float = 0.0  # the worker's time running the step (CPU; on CUDA the host time launching it)

    def device_results(self) -> _DeviceResults:
        return self.results.result() if isinstance(self.results, Future) else self.results

    def device_tokens(self) -> torch.Tensor:
        return self.device_results().samples.tokens


class OverlappedRunner:
    """Launches steps on a ``ModelRunner`` without waiting for them; see the module docstring."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.device = runner.device
        self._worker = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="moegate-step")
                        if self.device.type == "cpu" else None)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    def launch(self, plan: SchedulerOutput, prev: StepInFlight | None) -> StepInFlight:
        """Build ``plan``'s batch and queue its forward and sampling after ``prev`` (the step whose samples
        its placeholders stand for); returns at once."""
        start = time.perf_counter()
        runner = self.runner
        runner.num_steps += 1
        runner.sampler.forget_grammars(plan.finished_ids)
        if runner.model.takes_images:  # features and part-way images of requests that ended
            runner.model.forget_images(plan.finished_ids)
        runner.encode_pieces(plan)  # before the batch: its image features may be the pieces' last
        batch = runner.prepare(plan.scheduled)
        sampling_parts = [s for s in plan.scheduled if s.sample]
        requests = [s.request for s in sampling_parts]
        sampling = runner.sampler.prepare(requests, runner.model.config.vocab_size) if requests else None
        step = StepInFlight(plan, sampling, prompt_scoring(plan.scheduled, self.device),
                            {r.request_id: k for k, r in enumerate(requests)})
        # Sampling rows whose input token is a placeholder, and that token's row in prev's samples.
        fill = [k for k, s in enumerate(sampling_parts) if s.token_ids[-1] == PLACEHOLDER]
        fill_d = src_d = None
        if fill:
            assert prev is not None, "a placeholder stands for a token of the step in flight"
            fill_d, src_d = stage_int64([fill, [prev.rows[requests[k].request_id] for k in fill]], self.device)
        runner.last_prepare_ms = (time.perf_counter() - start) * 1e3
        threads = torch.get_num_threads()

        def run() -> _DeviceResults:
            began = time.perf_counter()
            if torch.get_num_threads() != threads:  # a thread's own OpenMP setting: follow the engine's
                torch.set_num_threads(threads)
            with torch.inference_mode():
                results = self._run(step, batch, prev, fill_d, src_d)
            step.compute_ms = (time.perf_counter() - began) * 1e3
            return results

        if self._worker is not None:
            step.results = self._worker.submit(run)
        else:
            step.results = run()
            step.host_copies = []
            for tensor in step.results.to_read():
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
                step.host_copies.append(host)
            step.copied = torch.cuda.Event()
            step.copied.record()
        runner.last_execute_ms = (time.perf_counter() - start) * 1e3
        return step

    def _run(self, step: StepInFlight, batch: FlatBatch, prev: StepInFlight | None,
             fill_d: torch.Tensor | None, src_d: torch.Tensor | None) -> _DeviceResults:
        runner = self.runner
        runner.sampler.forget_generators(step.plan.finished_ids)
        runner.move_tier_blocks(step.plan)  # in the step's order: after the step before, before this forward
        if fill_d is not None:
            # input_ids [T]: each placeholder row takes prev's sampled token [F], on the device.
            rows = batch.sample_rows.index_select(0, fill_d)
            batch.input_ids.index_copy_(0, rows, prev.device_tokens().index_select(0, src_d))
        if runner.lora is not None:  # slot writes after the step before, then this step's adapter layout
            runner.lora.apply(step.plan.lora_loads)
            runner.lora.begin_step(step.plan.scheduled, batch.scheduled_ranges, batch.input_ids.shape[0], self.device)
        copy_states(runner.model, step.plan.state_loads, self.device)  # hits resume from their checkpoints
        try:
            hidden = runner.forward(batch)  # [T, H]
        finally:
            if runner.lora is not None:
                runner.lora.end_step()
        copy_states(runner.model, step.plan.state_saves, self.device)  # chunks that ended at a checkpoint
        logits = runner._logits(hidden, batch)  # [N + Q, V]
        results = _DeviceResults(None)
        num_sampling = len(step.rows)
        if step.scoring is not None:
            results.prompt_values, results.prompt_ids = step.scoring.compute(logits[num_sampling:])
        if step.sampling is not None:
            last_tokens = None  # [N] each row's input token, placeholders filled: a penalised history's last
            if step.sampling.penalties is not None and step.sampling.penalties.has_in_flight:
                last_tokens = batch.input_ids.index_select(0, batch.sample_rows)
            results.samples = runner.sampler.sample(logits[:num_sampling], step.sampling, last_tokens)
        return results

    def collect(self, step: StepInFlight) -> StepSamples:
        """The step's token per scheduled request (None where it did not sample) and its logprobs; waits for
        that step only. Grammars advance by its tokens here, on the host."""
        start = time.perf_counter()
        results = step.device_results()
        if step.copied is not None:
            step.copied.synchronize()
            read = [t.tolist() for t in step.host_copies]
        else:
            read = [t.tolist() for t in results.to_read()]
        out = StepSamples([None] * len(step.plan.scheduled))
        if step.sampling is not None:
            requests = [s.request for s in step.plan.scheduled if s.sample]
            sampled = self.runner.sampler.finish(step.sampling, requests, read)
            it = iter(zip(sampled.token_ids, sampled.logprobs))
            for i, s in enumerate(step.plan.scheduled):
                if s.sample:
                    out.token_ids[i], lp = next(it)
                    if lp is not None:
                        out.logprobs[s.request.request_id] = lp
        if step.scoring is not None:
            out.prompt_logprobs = step.scoring.unpack(read[-2], read[-1])
        self.runner.last_execute_ms += (time.perf_counter() - start) * 1e3
        return out
