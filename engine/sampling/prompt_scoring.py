"""Prompt logprobs: which prompt tokens a step scores, computed on the device and unpacked on the host.

Legend: Q scored prompt positions in the step, V vocabulary, K the largest top count asked for.
"""

from dataclasses import dataclass

import torch

from engine.core.logprob_outputs import Logprobs
from engine.core.scheduler import ScheduledRequest
from engine.sampling.logprob_tensors import group_positions, logprob_tensors, unpack_logprobs
from engine.device_batch.staging import stage_int64


@dataclass(slots=True)
class PromptScoring:
    """The prompt tokens one step scores, read from its plan on the host before the step runs."""

    request_ids: list[str]
    first_positions: list[int]  # each request's first scored position (position 0 is never scored)
    sizes: list[int]  # positions scored per request
    row_counts: list[int]  # top tokens reported at each of the Q positions
    targets: torch.Tensor  # [Q] int64 on the device: the token each scoring row is scored on

    def compute(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [Q, V] (row q scores ``targets[q]``) -> values and ids [Q, 1 + K] on the device (no read)."""
        return logprob_tensors(logits, self.targets, max(self.row_counts))

    def read(self, computed: tuple[torch.Tensor, torch.Tensor]) -> dict[str, tuple[int, Logprobs]]:
        """``unpack`` of ``compute``'s result, read from the device now (synchronous steps, after the sampler's
        read, so it waits for nothing more)."""
        values, ids = computed
        return self.unpack(values.tolist(), ids.tolist())

    def unpack(self, values: list[list[float]], ids: list[list[int]]) -> dict[str, tuple[int, Logprobs]]:
        """``compute``'s result read back -> request id -> (first position, its scored positions' logprobs)."""
        grouped = group_positions(unpack_logprobs(values, ids, self.row_counts), self.sizes)
        return {rid: (first, lp) for rid, first, lp in zip(self.request_ids, self.first_positions, grouped)}


def prompt_scoring(scheduled: list[ScheduledRequest], device: torch.device) -> PromptScoring | None:
    """The step's prompt scoring; None if no scheduled part scores prompt tokens. Each asking part's rows
    score the prompt tokens that follow them."""
    asking = [s for s in scheduled if s.prompt_logprob_rows]
    if not asking:
        return None
    targets = [t for s in asking for t in s.request.all_token_ids[s.start + 1:s.start + 1 + s.prompt_logprob_rows]]
    (targets_d,) = stage_int64([targets], device)
    return PromptScoring([s.request.request_id for s in asking], [s.start + 1 for s in asking],
                         [s.prompt_logprob_rows for s in asking],
                         [s.request.sampling_params.prompt_logprobs for s in asking for _ in range(s.prompt_logprob_rows)],
                         targets_d)
