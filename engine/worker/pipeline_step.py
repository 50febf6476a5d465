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

import torch

from engine.core.scheduler import ScheduledRequest
from engine.distributed.pipeline import PipelineStage


def micro_batches(scheduled: list[ScheduledRequest], count: int) -> list[list[ScheduledRequest]]:
    """The step cut into ``count`` micro-batches of about equal tokens, in order: a part that crosses a boundary
    is cut into pieces (a prefill chunk in two chunks: the later piece's attention reads the earlier's KV, which
    each stage wrote one micro-batch before); only its last piece samples. Micro-batches may be empty (fewer
    tokens than micro-batches); they are skipped on every stage. A step with prompt logprobs or drafts is one
    micro-batch (their rows are per part)."""
    if count == 1 or any(s.prompt_logprob_rows or s.draft_token_ids for s in scheduled):
        return [list(scheduled)]
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
                window_block_ids=s.window_block_ids))
            done += n
            room -= n
    return out


@torch.inference_mode()
def run_stage(runner, scheduled: list[ScheduledRequest], stage: PipelineStage, count: int) -> torch.Tensor | None:
    """This rank's part of a pipelined step; on stage 0 the final-norm hidden rows to sample [N, H] (the
    sampled rows, then the prompt-scoring rows, in scheduled order), None on the other stages."""
    model, timing = runner.model, stage.timing
    hidden_size, dtype, device = model.config.hidden_size, runner.dtype, runner.device
    parts = micro_batches(scheduled, count)
    timing.empty_micro_batches += sum(not mb for mb in parts)
    parts = [mb for mb in parts if mb]
    timing.steps += 1
    sends, rows_back = [], []
    for mb in parts:
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
    for work, _ in sends:  # the tensors stay referenced until sent
        stage.wait(work, "send to the next stage")
    timing.wait_s += time.perf_counter() - wait  # a send completes once the next stage has taken it
    if not stage.is_first:
        return None
    wait = time.perf_counter()
    back = [stage.recv((n, hidden_size), dtype, device, stage.num_stages - 1) for n in rows_back if n]
    timing.wait_s += time.perf_counter() - wait
    if not back:
        return torch.empty(0, hidden_size, dtype=dtype, device=device)
    return torch.cat(back)  # [N, H]
