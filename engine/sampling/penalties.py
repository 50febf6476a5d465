"""Penalties and logit_bias for a whole step's logits at once.

Legend: N rows (requests that sample), V vocabulary, R rows whose request adjusts its logits, E entries.

Split in two so an overlapped step can build its inputs on the host when it is launched and apply them
where the step runs: ``penalty_inputs`` reads the requests' settings and token histories (host lists, one
staged copy); ``apply_penalty_inputs`` adjusts the logits on the device. Rows whose request asks for
nothing are neither copied nor touched.

A request whose last token is still on the device (an overlapped step, ``scheduler.PLACEHOLDER``) has that
token in its history as -1: the device resolves it from the step's input ids, the token the placeholder was
filled with, so its penalties count it exactly as the synchronous loop does.
"""

from dataclasses import dataclass

import torch

from engine.core.request import Request
from engine.device_batch.staging import stage_int64, to_device

_IN_FLIGHT = -1  # scheduler.PLACEHOLDER: a sampled token the host has not read yet


@dataclass(slots=True)
class PenaltyInputs:
    """One step's penalties and logit_bias, on the device."""

    row_index: torch.Tensor  # [R] row in N of each adjusting request
    out_rows: torch.Tensor  # [C] row in R of each generated token counted (frequency, presence)
    out_tokens: torch.Tensor  # [C] that token (-1: the token in flight)
    seen_rows: torch.Tensor  # [S] row in R of each distinct prompt or generated token (repetition)
    seen_tokens: torch.Tensor  # [S]
    repetition: torch.Tensor | None  # [R, 1]
    frequency: torch.Tensor | None  # [R, 1]
    presence: torch.Tensor | None  # [R, 1]
    bias: tuple[torch.Tensor, torch.Tensor] | None  # ([2, E] rows in N and tokens, [E] values)
    has_in_flight: bool  # a history holds a token still on the device


def penalty_inputs(requests: list[Request], vocab: int, device: torch.device) -> PenaltyInputs | None:
    """The device inputs of ``apply_penalty_inputs`` for ``requests`` (one per logits row); None if no request
    adjusts its logits. Reads the requests' histories now: call it before they move on."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.adjusts_logits]
    if not rows:
        return None
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
    row_index, out_r_d, out_t_d, seen_r_d, seen_t_d = stage_int64([rows, out_r, out_t, seen_r, seen_t], device)
    bias = None
    if bias_t:
        bias = (to_device([bias_r, bias_t], torch.int64, device), to_device(bias_v, torch.float32, device))

    def column(values: list[float], used: bool) -> torch.Tensor | None:
        return to_device(values, torch.float32, device)[:, None] if used else None

    return PenaltyInputs(
        row_index, out_r_d, out_t_d, seen_r_d, seen_t_d,
        repetition=column([p.repetition_penalty for p in params], bool(seen_t)),
        frequency=column([p.frequency_penalty for p in params], bool(out_t)),
        presence=column([p.presence_penalty for p in params], bool(out_t)),
        bias=bias,
        has_in_flight=_IN_FLIGHT in out_t or _IN_FLIGHT in seen_t,
    )


def apply_penalty_inputs(logits: torch.Tensor, inputs: PenaltyInputs, last_tokens: torch.Tensor | None = None) -> None:
    """Adjust ``logits`` [N, V] in place: repetition, frequency and presence penalties, then logit_bias.

    repetition_penalty (HF/vLLM): over prompt and generated tokens, a positive logit is divided by it and a
    negative one multiplied. frequency_penalty * count and presence_penalty * (count > 0) are subtracted,
    counting generated tokens only (OpenAI). logit_bias values are added last.
    ``last_tokens`` [N]: each row's last token (its input at the sampled position), needed when a history
    holds a token in flight.
    """
    out_t, seen_t = inputs.out_tokens, inputs.seen_tokens
    if inputs.has_in_flight:
        assert last_tokens is not None, "a token in flight is resolved from the step's input ids"
        in_row = last_tokens.index_select(0, inputs.row_index)  # [R]
        out_t = torch.where(out_t == _IN_FLIGHT, in_row.index_select(0, inputs.out_rows), out_t)
        seen_t = torch.where(seen_t == _IN_FLIGHT, in_row.index_select(0, inputs.seen_rows), seen_t)
    sub = logits.index_select(0, inputs.row_index)  # [R, V]
    if inputs.repetition is not None:
        seen_mask = torch.zeros_like(sub, dtype=torch.bool)
        # The value as a device tensor: a Python True would be copied from the host, a synchronizing copy on CUDA.
        seen_mask.index_put_((inputs.seen_rows, seen_t), seen_mask.new_ones(()).expand(seen_t.shape[0]))
        rep = inputs.repetition
        sub = torch.where(seen_mask, torch.where(sub > 0, sub / rep, sub * rep), sub)
    if inputs.frequency is not None:
        counts = torch.zeros_like(sub)  # [R, V]
        counts.index_put_((inputs.out_rows, out_t), counts.new_ones(()).expand(out_t.shape[0]), accumulate=True)
        sub = sub - inputs.frequency * counts - inputs.presence * (counts > 0).to(sub.dtype)
    logits.index_copy_(0, inputs.row_index, sub)
    if inputs.bias is not None:
        index, values = inputs.bias
        logits.index_put_((index[0], index[1]), values.to(logits.dtype), accumulate=True)


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
