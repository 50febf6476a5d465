"""Penalties and logit_bias for a whole step's logits at once.

Legend: N rows (requests that sample), V vocabulary, R rows whose request adjusts its logits, E entries.

Index tensors are built once per step from the requests' token histories (host lists, one staged copy);
rows whose request asks for nothing are neither copied nor touched.
"""

import torch

from engine.core.request import Request
from engine.worker.staging import stage_int64, to_device


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    """Adjust ``logits`` [N, V] in place: repetition, frequency and presence penalties, then logit_bias.

    repetition_penalty (HF/vLLM): over prompt and generated tokens, a positive logit is divided by it and a
    negative one multiplied. frequency_penalty * count and presence_penalty * (count > 0) are subtracted,
    counting generated tokens only (OpenAI). logit_bias values are added last.
    """
    rows = [i for i, r in enumerate(requests) if r.sampling_params.adjusts_logits]
    if not rows:
        return
    vocab = logits.shape[-1]
    picked = [requests[i] for i in rows]
    params = [r.sampling_params for r in picked]
    # Host lists of (row in R, token) pairs; token ids past the vocabulary (never sampled) are dropped.
    out_r, out_t, seen_r, seen_t, bias_r, bias_t, bias_v = [], [], [], [], [], [], []
    for j, (request, p) in enumerate(zip(picked, params)):
        if p.frequency_penalty or p.presence_penalty:
            out = [t for t in request.output_token_ids if t < vocab]
            out_r += [j] * len(out)
            out_t += out
        if p.repetition_penalty != 1.0:
            seen = [t for t in set(request.all_token_ids) if t < vocab]
            seen_r += [j] * len(seen)
            seen_t += seen
        if p.logit_bias:
            for t, b in p.logit_bias.items():
                if t < vocab:
                    bias_r.append(rows[j])
                    bias_t.append(t)
                    bias_v.append(b)
    device = logits.device
    row_index, out_r_d, out_t_d, seen_r_d, seen_t_d = stage_int64([rows, out_r, out_t, seen_r, seen_t], device)
    sub = logits.index_select(0, row_index)  # [R, V]
    if seen_t:
        rep = to_device([p.repetition_penalty for p in params], torch.float32, device)[:, None]  # [R, 1]
        seen_mask = torch.zeros_like(sub, dtype=torch.bool)
        seen_mask[seen_r_d, seen_t_d] = True
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen_mask, penalised, sub)
    if out_t:
        counts = torch.zeros_like(sub)  # [R, V]
        counts.index_put_((out_r_d, out_t_d), counts.new_ones(()).expand(len(out_t)), accumulate=True)
        freq = to_device([p.frequency_penalty for p in params], torch.float32, device)[:, None]  # [R, 1]
        pres = to_device([p.presence_penalty for p in params], torch.float32, device)[:, None]
        sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    logits.index_copy_(0, row_index, sub)
    if bias_t:
        index = to_device([bias_r, bias_t], torch.int64, device)  # [2, E]
        logits.index_put_((index[0], index[1]), to_device(bias_v, torch.float32, device).to(logits.dtype),
                          accumulate=True)


def apply_min_p(probs: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """probs [N, V] with tokens below ``min_p`` times their row's largest probability set to 0 (not renormalised:
    the exponential race samples from the unnormalised weights the same way). Only rows with min_p > 0 are read."""
    rows = [i for i, m in enumerate(min_ps) if m > 0.0]
    if not rows:
        return probs
    (index,) = stage_int64([rows], probs.device)
    sub = probs.index_select(0, index)  # [M, V]
    threshold = to_device([min_ps[i] for i in rows], torch.float32, probs.device)[:, None] * sub.amax(-1, keepdim=True)
    return probs.index_copy(0, index, sub.masked_fill(sub < threshold, 0.0))
