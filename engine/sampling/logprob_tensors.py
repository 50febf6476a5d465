"""Log-probabilities of chosen tokens and the most likely ones, for many rows at once.

Legend: R rows that report logprobs, V vocabulary, K the largest top count asked for in the step.

``logprob_tensors`` computes on the device without reading it (an overlapped step copies the result back
with its tokens); ``unpack_logprobs`` turns the rows read back into ``Logprobs``.
"""

import torch

from engine.core.logprob_outputs import Logprobs


def logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-softmax of ``logits`` [R, V] (raw model logits) at ``token_ids`` [R] and at each row's ``k`` most
    likely tokens, most likely first: values [R, 1 + K] float32 and ids [R, 1 + K] int64, on the device."""
    return gather_logprob_tensors(torch.log_softmax(logits.float(), dim=-1), token_ids, k)


def gather_logprob_tensors(logp: torch.Tensor, token_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``logprob_tensors`` from log-probabilities already computed: ``logp`` [R, V] float32."""
    chosen = logp.gather(1, token_ids[:, None])  # [R, 1]
    if not k:
        return chosen, token_ids[:, None]
    top_vals, top_idx = logp.topk(k, dim=-1)  # [R, K], sorted descending
    return torch.cat([chosen, top_vals], dim=1), torch.cat([token_ids[:, None], top_idx], dim=1)


def unpack_logprobs(values: list[list[float]], ids: list[list[int]], top_counts: list[int]) -> list[Logprobs]:
    """Rows of ``logprob_tensors`` read back (``.tolist()``) -> one ``Logprobs`` position per row, with
    ``top_counts[r]`` top tokens."""
    return [Logprobs([row_ids[0]], [row_vals[0]], [row_ids[1:1 + n]], [row_vals[1:1 + n]])
            for row_ids, row_vals, n in zip(ids, values, top_counts)]


def group_positions(rows: list[Logprobs], sizes: list[int]) -> list[Logprobs]:
    """One-position ``rows`` regrouped: request i's are the next ``sizes[i]`` of them, as one ``Logprobs``."""
    out, at = [], 0
    for n in sizes:
        part = rows[at:at + n]
        at += n
        out.append(Logprobs([r.token_ids[0] for r in part], [r.logprobs[0] for r in part],
                            [r.top_ids[0] for r in part], [r.top_logprobs[0] for r in part]))
    return out

