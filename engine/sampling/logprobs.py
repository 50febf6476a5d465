"""Log-probabilities of chosen tokens and the most likely ones, for many rows at once.

Legend: R rows that report logprobs, V vocabulary, K the largest top count asked for in the step.
"""

import torch

from engine.core.logprobs import Logprobs


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_counts: list[int]) -> list[Logprobs]:
    """One position per row: the log-softmax of ``logits`` [R, V] (raw model logits) at ``token_ids`` [R], and
    each row's ``top_counts[r]`` most likely tokens, most likely first. Reads the device once."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    chosen = logp.gather(1, token_ids[:, None])[:, 0]  # [R]
    k = max(top_counts, default=0)
    if k:
        top_vals, top_idx = logp.topk(k, dim=-1)  # [R, K], sorted descending
        values = torch.cat([chosen[:, None], top_vals], dim=1).tolist()  # [R, 1 + K]
        ids = torch.cat([token_ids[:, None], top_idx], dim=1).tolist()
    else:
        values = chosen[:, None].tolist()
        ids = token_ids[:, None].tolist()
    return [Logprobs([row_ids[0]], [row_vals[0]], [row_ids[1:1 + n]], [row_vals[1:1 + n]])
            for row_ids, row_vals, n in zip(ids, values, top_counts)]


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, top_counts: list[int], sizes: list[int]) -> list[Logprobs]:
    """Prompt tokens' logprobs for several requests: ``logits`` [Q, V] (row q scores ``targets[q]``), the rows of
    request i being the next ``sizes[i]`` of them with ``top_counts[i]`` top tokens each."""
    rows = gather_logprobs(logits, targets, [k for k, n in zip(top_counts, sizes) for _ in range(n)])
    out, at = [], 0
    for n in sizes:
        part = rows[at:at + n]
        at += n
        out.append(Logprobs([r.token_ids[0] for r in part], [r.logprobs[0] for r in part],
                            [r.top_ids[0] for r in part], [r.top_logprobs[0] for r in part]))
    return out
