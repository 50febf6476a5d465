"""Overlapped pipelined steps: stage 0 runs step N+1 while the last stage finishes step N, two steps in flight.

Rank 0 schedules step N+1 right after stage 0 has sent step N's last micro-batch, with the scheduler's
placeholders (``scheduler.PLACEHOLDER``) standing for step N's tokens, and hands the plan to a sending thread
(a gloo broadcast returns only once every rank has posted its receive, and the last stage is still busy with
step N). Only stage 0 embeds token ids, so only its micro-batches wait for step N's tokens: the parts ending
with a placeholder (decodes) form a last micro-batch of their own (``pipeline_step.micro_batches``), and just
before stage 0 embeds it, it receives step N's rows from the last stage, computes their logits, rank 0 samples
them, and the tokens are written into the placeholders (sent to the stage's other tensor-parallel ranks). A
step with no placeholder finishes step N after its own micro-batches.

```
stage 0:  N+1: prefill mbs │ rows of N back, sample N, fill │ decodes ── N+2: prefill mbs ...
stage 1:  N: prefill mbs, decodes ─> rows back │ N+1: prefill mbs, decodes ...
```

Every stage-0 rank follows the same rule (``StageZeroSteps``), so their collectives (the LM head's gather, the
tokens' broadcast) pair up. An empty plan (rank 0 has nothing to schedule) still goes to every rank while a
step is in flight: it finishes that step.
"""

import queue
import threading
from collections.abc import Callable
from contextlib import contextmanager

import torch

from engine.core.scheduler import PLACEHOLDER, ScheduledRequest, SchedulerOutput
from engine.distributed.collectives import TensorParallel
from engine.distributed.groups import CollectiveError
from engine.worker.step_samples import StepSamples
from engine.worker.pipeline_step import RowsBack, has_placeholder, micro_batches, run_stage
from engine.worker.rank_messages import StepPlan, encode, send_message



_STOP = object()  # PlanSender's thread ends when it takes this


class PlanSender:
    """Broadcasts rank 0's plans to the other ranks from a thread of its own, in order, so that rank 0 goes on
    with stage 0's work while the later stages finish the step before. Every other message on the plans'
    channel waits for ``drain()`` first (the channel's collectives must not interleave)."""

    def __init__(self, plans: TensorParallel, timeout_s: float) -> None:
        self._plans, self._timeout_s = plans, timeout_s
        self._queue: queue.Queue = queue.Queue()
        self._sent = threading.Condition()
        self._queued = self._done = 0
        self._error: BaseException | None = None
        # A daemon: a thread blocked on a dead peer must not keep the process alive at exit.
        threading.Thread(target=self._loop, name="moegate-plans", daemon=True).start()

    def send(self, message: StepPlan) -> None:
        """Queue ``message`` for the broadcast; it is encoded now (the caller fills placeholders in its lists)."""
        self._raise_error()
        self._queued += 1
        self._queue.put(encode(message))

    def drain(self) -> None:
        """Wait until every plan handed over is sent; CollectiveError if one failed or the timeout passed."""
        with self._sent:
            if not self._sent.wait_for(lambda: self._done == self._queued, self._timeout_s):
                raise CollectiveError(f"rank 0: the plans' broadcast did not complete within {self._timeout_s:.0f} s")
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """End the thread once the plans handed over are sent (or failed)."""
        self._queue.put(_STOP)

    def _loop(self) -> None:
        while (data := self._queue.get()) is not _STOP:
            try:
                if self._error is None:
                    send_message(self._plans, data)
            except BaseException as e:  # the main thread raises it at its next send or drain
                self._error = e
            with self._sent:
                self._done += 1
                self._sent.notify_all()


class StageZeroSteps:
    """A stage-0 rank's overlapped pipelined steps: the step in flight's rows, finished (LM head) before the
    first micro-batch of the next step that holds a placeholder, or after that step's micro-batches.

    ``on_rows(logits)`` (rank 0): samples the step in flight from its logits [N + Q, V] (None: no row) and
    returns its token per request id; other ranks pass None and take the tokens from rank 0's broadcast."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.in_flight: RowsBack | None = None

    @property
    def busy(self) -> bool:
        return self.in_flight is not None

    @torch.inference_mode()
    def step(self, scheduled: list[ScheduledRequest],
             on_rows: Callable[[torch.Tensor | None], dict[str, int]] | None) -> None:
        """Run stage 0's part of the step ``scheduled`` (may be empty), finishing the step in flight on the way;
        this step is then in flight."""
        runner, stage = self.runner, self.runner.stage
        prev, self.in_flight = self.in_flight, None
        tokens: dict[str, int] | None = None

        def finish_prev() -> None:
            nonlocal prev, tokens
            hidden = prev.wait(stage)  # [N + Q, H]
            prev = None
            logits = runner.model.compute_logits(hidden) if hidden.numel() else None  # [N + Q, V]
            tokens = on_rows(logits) if on_rows is not None else {}

        def fill(mb: list[ScheduledRequest]) -> None:
            if prev is not None:
                finish_prev()
            holes = [p for p in mb if has_placeholder(p)]
            new = [tokens[p.request.request_id] for p in holes] if on_rows is not None else None
            if runner.model.tp.size > 1:  # the stage's other ranks embed the same tokens
                new = runner.model.tp.broadcast_object(new)
            for part, token in zip(holes, new):
                part.token_ids[-1] = token

        first = next((mb for mb in micro_batches(scheduled, runner.micro_batches) if mb), [])
        if prev is not None and first and not any(has_placeholder(p) for p in first):
            stage.timing.overlapped_steps += 1  # its first micro-batch runs while the step before is in flight
        rows = run_stage(runner, scheduled, stage, runner.micro_batches, fill)
        if prev is not None:
            finish_prev()
        self.in_flight = rows if scheduled else None


@contextmanager
def _without_own_placeholders(plan: SchedulerOutput):
    """The plan's sampling requests without the placeholder ``advance()`` appended for the token being sampled:
    sampling sees each request as the synchronous loop does (penalty histories, ``min_tokens``, the position a
    seeded draw uses); the placeholders are back afterwards, for ``resolve()`` to fill."""
    mine = [s.request for s in plan.scheduled if s.sample and s.request.num_tokens == s.start + s.num_new_tokens + 1
            and s.request.all_token_ids[-1] == PLACEHOLDER]
    for request in mine:
        request.output_token_ids.pop()
        request.all_token_ids.pop()
    try:
        yield
    finally:
        for request in mine:
            request.append_output_token(PLACEHOLDER)


class PipelinedSteps:
    """Rank 0's overlapped pipelined steps (see the module docstring): ``step`` runs stage 0's part of a plan
    and, on the way, samples and resolves the step in flight."""

    def __init__(self, runner, timeout_s: float) -> None:
        self.runner = runner
        self.sender = PlanSender(runner.plans, timeout_s)
        self.stage_zero: StageZeroSteps = runner.stage_zero  # model_setup made it (stage 0, overlapped steps)
        self.plan_in_flight: SchedulerOutput | None = None

    @property
    def busy(self) -> bool:
        return self.plan_in_flight is not None

    def step(self, plan: SchedulerOutput, resolve: Callable[[SchedulerOutput, StepSamples], None]) -> None:
        """Send ``plan`` (as a ``StepPlan``) to the other ranks and run stage 0's part of it; the step in
        flight is sampled (``runner.sample``) and handed to ``resolve`` before ``plan``'s first micro-batch
        holding a placeholder, or after its micro-batches. ``plan`` is then in flight (unless empty)."""
        runner = self.runner
        prev, self.plan_in_flight = self.plan_in_flight, None

        def on_rows(logits: torch.Tensor | None) -> dict[str, int]:
            with _without_own_placeholders(prev):
                sampled = runner.sample(prev, logits)
            runner.sampler.forget(plan.finished_ids)  # only now: the step in flight may have sampled them
            resolve(prev, sampled)
            return {s.request.request_id: t for s, t in zip(prev.scheduled, sampled.token_ids) if s.sample}

        if prev is None:
            runner.sampler.forget(plan.finished_ids)
        if not plan.is_empty:
            runner.num_steps += 1
        self.sender.send(StepPlan.of(plan))
        self.stage_zero.step(plan.scheduled, on_rows)
        self.plan_in_flight = None if plan.is_empty else plan

    def close(self) -> None:
        self.sender.close()
