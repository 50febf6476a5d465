"""One step through the pipeline stages: the plan cut into micro-batches, each stage running its layers on one
micro-batch while the stage after it runs the one before.

Every rank cuts the same plan the same way (``micro_batches``), so no stage is told the sizes it receives: a
micro-batch of T tokens arrives as (hidden, residual) [2, T, H], and the last stage sends back the final-norm
hidden rows that stage 0 samples [N, H].

```
stage 0:  mb0  mb1  mb2  mb3 ─────────────── wait ── LM head, sample
stage 1:  wait mb0  mb1  mb2  mb3 ─> rows of each mb back to stage 0 as it finishes
```

Legend: T tokens of a micro-batch, H hidden, N sampled (and prompt-scoring) rows.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.core.scheduler import PLACEHOLDER, ScheduledRequest
from engine.distributed.pipeline import PipelineStage


def has_placeholder(part: ScheduledRequest) -> bool:
    """Whether the part's input ends with a token of the step still in flight (overlapped pipelined steps)."""
    return bool(part.token_ids) and part.token_ids[-1] == PLACEHOLDER


def micro_batches(scheduled: list[ScheduledRequest], count: int) -> list[list[ScheduledRequest]]:
    """The step cut into ``count`` micro-batches of about equal tokens, in order: a part that crosses a boundary
    is cut into pieces (a prefill chunk in two chunks: the later piece's attention reads the earlier's KV, which
    each stage wrote one micro-batch before); only its last piece samples. Micro-batches may be empty (fewer
    tokens than micro-batches); they are skipped on every stage. A step with prompt logprobs or drafts is one
    micro-batch (their rows are per part).

    Parts whose input ends with a placeholder (decodes of overlapped steps) come after those micro-batches, in
    one more micro-batch of their own: the ones before need no token of the step in flight, so stage 0 runs
    them while the last stage finishes that step."""
    if _one_micro_batch(scheduled):
        return [list(scheduled)]
    waiting = [s for s in scheduled if has_placeholder(s)]
    scheduled = [s for s in scheduled if not has_placeholder(s)]
    total = sum(s.num_new_tokens for s in scheduled)
    size = -(-total // count)
    out: list[list[ScheduledRequest]] = [[] for _ in range(count)]
    index, room = 0, size
    for s in scheduled:
        done = 0
        while done < s.num_new_tokens:
            if room == 0:
                index, room = index + 1, size
            n = min(room, s.num_new_tokens - done)
            last = done + n == s.num_new_tokens
            out[index].append(s if done == 0 and last else ScheduledRequest(
                s.request, n, s.block_ids, s.sample and last, s.start + done, s.token_ids[done:done + n],
                window_block_ids=s.window_block_ids, state_slot=s.state_slot))
            done += n
            room -= n
    return out + [waiting] if waiting else out


@dataclass(slots=True)
class RowsBack:
    """Stage 0's receives of a step's final-norm hidden rows from the last stage, posted as the step's last
    micro-batch is sent; ``order``: the cut's sampling row of each scheduled sampling part (None: the same)."""

    receives: list[tuple["dist.Work", torch.Tensor]]
    empty: torch.Tensor  # [0, H]
    order: torch.Tensor | None

    def wait(self, stage: PipelineStage) -> torch.Tensor:
        """The rows [N, H] in scheduled order (the sampled rows, then the prompt-scoring rows)."""
        wait = time.perf_counter()
        for work, _ in self.receives:
            stage.wait(work, f"receive from stage {stage.num_stages - 1} (rank {stage.peer(stage.num_stages - 1)})")
        stage.timing.wait_s += time.perf_counter() - wait
        if not self.receives:
            return self.empty
        rows = torch.cat([t for _, t in self.receives])  # [N, H] in the cut's order
        return rows if self.order is None else rows.index_select(0, self.order)


def _sampling_order(scheduled: list[ScheduledRequest], device: torch.device) -> torch.Tensor | None:
    """For each scheduled sampling part, its row among the cut's sampled rows (``micro_batches`` moves the
    parts ending with a placeholder after the others); None when the cut keeps the scheduled order."""
    sampling = [s for s in scheduled if s.sample]
    cut = sorted(range(len(sampling)), key=lambda k: has_placeholder(sampling[k]))  # cut row j: part cut[j]
    if cut == list(range(len(sampling))):
        return None
    order = [0] * len(cut)
    for row, k in enumerate(cut):
        order[k] = row
    return torch.tensor(order, dtype=torch.int64, device=device)


def _one_micro_batch(scheduled: list[ScheduledRequest]) -> bool:
    return any(s.prompt_logprob_rows or s.draft_token_ids for s in scheduled)


@torch.inference_mode()
def run_stage(runner, scheduled: list[ScheduledRequest], stage: PipelineStage, count: int,
              fill: Callable[[list[ScheduledRequest]], None] | None = None) -> RowsBack | None:
    """This rank's part of a pipelined step; on stage 0 the receives of the final-norm hidden rows to sample
    (``RowsBack``), None on the other stages. Sends complete in the background: each stage waits for its
    previous step's sends at the end of this one (a gloo send completes once the peer has posted its receive).

    ``fill`` (stage 0, overlapped steps): called with each micro-batch holding a placeholder before it is
    embedded; it writes the step in flight's sampled tokens into the micro-batch's placeholders."""
    model, timing = runner.model, stage.timing
    hidden_size, dtype, device = model.config.hidden_size, runner.dtype, runner.device
    parts = micro_batches(scheduled, count)
    # Before ``fill`` writes the placeholders: which of them the cut moved.
    order = None if _one_micro_batch(scheduled) or not stage.is_first else _sampling_order(scheduled, device)
    timing.empty_micro_batches += sum(not mb for mb in parts)
    parts = [mb for mb in parts if mb]
    timing.steps += 1 if parts else 0
    sends, rows_back = [], []
    for mb in parts:
        if fill is not None and any(has_placeholder(p) for p in mb):
            fill(mb)
        start, cpu = time.perf_counter(), time.thread_time()
        batch = runner.prepare(mb)
        tokens = batch.input_ids.shape[0]
        if stage.is_first:
            x, residual = model.model.embed_tokens(batch.input_ids), None  # [T, H]
        else:
            wait, wait_cpu = time.perf_counter(), time.thread_time()
            carried = stage.recv((2, tokens, hidden_size), dtype, device, stage.stage - 1)  # [2, T, H]
            start += time.perf_counter() - wait
            cpu += time.thread_time() - wait_cpu
            timing.wait_s += time.perf_counter() - wait
            x, residual = carried[0], carried[1]
        x, residual = model.run_layers(x, residual, batch.positions, batch.meta)
        if stage.is_last:
            rows = batch.sample_rows
            if batch.prompt_rows.numel():
                rows = torch.cat([rows, batch.prompt_rows])
            if rows.numel():
                hidden = model.final_norm(x.index_select(0, rows), residual.index_select(0, rows))  # [N, H]
                sends.append((stage.send(hidden, 0), hidden))
        else:
            carried = torch.stack([x, residual])  # [2, T, H]
            sends.append((stage.send(carried, stage.stage + 1), carried))
        if stage.is_first:  # how many rows of this micro-batch the last stage sends back
            rows_back.append(batch.sample_rows.numel() + batch.prompt_rows.numel())
        timing.busy_s += time.perf_counter() - start
        timing.busy_cpu_s += time.thread_time() - cpu
    wait = time.perf_counter()
    for work, _ in stage.pending_sends:  # the tensors stayed referenced until sent
        stage.wait(work, "send to the next stage")
    timing.wait_s += time.perf_counter() - wait
    stage.pending_sends = sends
    if not stage.is_first:
        return None
    last = stage.num_stages - 1
    receives = [stage.irecv((n, hidden_size), dtype, device, last) for n in rows_back if n]
    return RowsBack(receives, torch.empty(0, hidden_size, dtype=dtype, device=device), order)
