"""Overlapped steps on the device side: launch step N+1 before step N's tokens are read.

Legend: T scheduled tokens, N requests that sample, F of them whose input token is the previous step's sample.

``launch`` builds the batch on the host and queues the forward and the sampling; the sampled tokens stay
on the device, and the next step's batch takes its placeholder input ids (``scheduler.PLACEHOLDER``) from
them by one device-side gather, so no token makes a round trip through the host between steps.
``collect`` reads a launched step's tokens.

On CUDA the queue is the stream: ``launch`` returns as soon as the kernels are queued, and the tokens are
copied to pinned host memory behind them (an event marks the copy), so reading step N waits for step N
only, never for step N+1 queued after it. On the CPU the "device" is a worker thread that runs each
launched step in turn: torch ops release the GIL, so the host schedules and prepares step N+1 while the
worker computes step N.
"""

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.core.request import Request
from engine.core.scheduler import PLACEHOLDER, SchedulerOutput
from engine.worker.batch_builder import FlatBatch
from engine.worker.runner import ModelRunner
from engine.worker.staging import stage_int64


def needs_host_between_steps(request: Request) -> bool:
    """Whether the host must see this request's token before its next step is built (the engine then runs
    that step synchronously): grammars advance per token, penalties read the token history, logprobs and
    prompt logprobs are read with the token, and ``n`` > 1 copies wait on their leader's computed prompt."""
    return request.sampling_params.needs_each_token_on_host or request.parent_id is not None


def fill_placeholders(plan: SchedulerOutput) -> None:
    """Put the real tokens in a plan's placeholders once the step they stood for is resolved (a plan that
    then runs synchronously)."""
    for item in plan.scheduled:
        if item.token_ids and item.token_ids[-1] == PLACEHOLDER:
            item.token_ids[-1] = item.request.all_token_ids[item.start + item.num_new_tokens - 1]


class _SamplingView:
    """What the sampler reads of a request, copied at launch: the host moves the request on (its next
    placeholder, its stop checks) while the worker thread samples."""

    __slots__ = ("request_id", "sampling_params", "num_output_tokens", "eos_token_id", "num_tokens")

    def __init__(self, request: Request) -> None:
        self.request_id = request.request_id
        self.sampling_params = request.sampling_params
        self.num_output_tokens = request.num_output_tokens
        self.eos_token_id = request.eos_token_id
        self.num_tokens = request.num_tokens  # the position of the token it samples (seeded draws use it)


@dataclass(slots=True)
class StepInFlight:
    """A launched step: its plan, the row of each sampling request's token, and where the tokens will be."""

    plan: SchedulerOutput
    rows: dict[str, int]  # request id -> row in the step's sampled tokens
    tokens: "Future[torch.Tensor] | torch.Tensor"  # [N] int64: a worker's future (CPU), or on the device (CUDA)
    host_tokens: torch.Tensor | None = None  # [N] pinned copy of ``tokens`` (CUDA)
    copied: torch.cuda.Event | None = None  # recorded after that copy (CUDA)
    compute_ms: float = 0.0  # the worker's time running the step (CPU; on CUDA the host time launching it)

    def device_tokens(self) -> torch.Tensor:
        return self.tokens.result() if isinstance(self.tokens, Future) else self.tokens


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
        batch = runner.prepare(plan.scheduled)
        sampling = [s for s in plan.scheduled if s.sample]
        views = [_SamplingView(s.request) for s in sampling]
        # Sampling rows whose input token is a placeholder, and that token's row in prev's samples.
        fill = [k for k, s in enumerate(sampling) if s.token_ids[-1] == PLACEHOLDER]
        fill_d = src_d = None
        if fill:
            assert prev is not None, "a placeholder stands for a token of the step in flight"
            fill_d, src_d = stage_int64([fill, [prev.rows[sampling[k].request.request_id] for k in fill]], self.device)
        runner.last_prepare_ms = (time.perf_counter() - start) * 1e3
        step = StepInFlight(plan, {s.request.request_id: k for k, s in enumerate(sampling)}, torch.empty(0))
        threads = torch.get_num_threads()

        def run() -> torch.Tensor:
            began = time.perf_counter()
            if torch.get_num_threads() != threads:  # a thread's own OpenMP setting: follow the engine's
                torch.set_num_threads(threads)
            with torch.inference_mode():
                tokens = self._run(plan, batch, views, prev, fill_d, src_d)
            step.compute_ms = (time.perf_counter() - began) * 1e3
            return tokens

        if self._worker is not None:
            step.tokens = self._worker.submit(run)
        else:
            step.tokens = run()
            step.host_tokens = torch.empty(step.tokens.shape, dtype=torch.int64, pin_memory=True)
            step.host_tokens.copy_(step.tokens, non_blocking=True)
            step.copied = torch.cuda.Event()
            step.copied.record()
        runner.last_execute_ms = (time.perf_counter() - start) * 1e3
        return step

    def _run(self, plan: SchedulerOutput, batch: FlatBatch, views: list[_SamplingView], prev: StepInFlight | None,
             fill_d: torch.Tensor | None, src_d: torch.Tensor | None) -> torch.Tensor:
        runner = self.runner
        runner.sampler.forget(plan.finished_ids)
        if fill_d is not None:
            # input_ids [T]: each placeholder row takes prev's sampled token [F], on the device.
            rows = batch.sample_rows.index_select(0, fill_d)
            batch.input_ids.index_copy_(0, rows, prev.device_tokens().index_select(0, src_d))
        hidden = runner.forward(batch)  # [T, H]
        logits = runner._logits(hidden, batch)  # [N, V]: overlapped steps have no prompt-logprob rows
        if logits is None:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return runner.sampler.sample_on_device(logits, views)  # [N]

    def collect(self, step: StepInFlight) -> list[int | None]:
        """The step's token per scheduled request (None where it did not sample); waits for that step only."""
        start = time.perf_counter()
        if step.copied is not None:
            step.copied.synchronize()
            sampled = step.host_tokens.tolist()
        else:
            sampled = step.device_tokens().tolist()
        self.runner.last_execute_ms += (time.perf_counter() - start) * 1e3
        it = iter(sampled)
        return [next(it) if s.sample else None for s in step.plan.scheduled]
