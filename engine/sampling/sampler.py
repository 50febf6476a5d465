"""Token sampling: penalties and logit_bias, grammar masks, greedy, temperature, top-k, top-p, min_p, per-request
seeds, logprobs."""

from dataclasses import dataclass

import torch

from engine.core.logprob_outputs import Logprobs
from engine.core.request import Request
from engine.sampling.logprob_tensors import gather_logprob_tensors, unpack_logprobs
from engine.sampling.penalties import PenaltyInputs, apply_min_p, apply_penalty_inputs, penalty_inputs
from engine.structured_output.matchers import GrammarMask, GrammarMatchers
from engine.device_batch.staging import stage_int64, to_device


@dataclass(slots=True)
class SamplerOutput:
    """A step's sampled token per row, and the logprobs of the rows whose request asked (else None)."""

    token_ids: list[int]
    logprobs: list[Logprobs | None]


class SamplingView:
    """What sampling reads of a request, copied when its step is built: an overlapped step samples while the
    host moves the request on (its next placeholder, its stop checks)."""

    __slots__ = ("request_id", "sampling_params", "num_output_tokens", "eos_token_id", "num_tokens")

    def __init__(self, request: Request, offset: int = 0) -> None:
        self.request_id = request.request_id
        self.sampling_params = request.sampling_params
        self.num_output_tokens = request.num_output_tokens
        self.eos_token_id = request.eos_token_id
        self.num_tokens = request.num_tokens + offset  # the position of the token it samples (seeded draws use it)


@dataclass(slots=True)
class StepSampling:
    """A step's sampling inputs, built on the host by ``Sampler.prepare`` before the step runs."""

    views: list[SamplingView]  # one per logits row
    penalties: PenaltyInputs | None
    grammar: GrammarMask | None
    logprob_rows: list[int]  # the rows whose request reports logprobs (R of them)
    logprob_rows_d: torch.Tensor | None  # [R] the same, on the device
    logprob_counts: list[int]  # top tokens each of those rows reports


@dataclass(slots=True)
class DeviceSamples:
    """A step's samples, still on the device: ``Sampler.finish`` turns them, read back, into a ``SamplerOutput``."""

    tokens: torch.Tensor  # [N] int64
    logprob_values: torch.Tensor | None = None  # [R, 1 + K] float32: the chosen token's, then the top K
    logprob_ids: torch.Tensor | None = None  # [R, 1 + K] int64
    eos_logprobs: torch.Tensor | None = None  # [R, 1] float32: EOS's, for a token a grammar replaces by EOS

    def to_read(self) -> list[torch.Tensor]:
        """The tensors the host reads back, in ``Sampler.finish``'s order."""
        reads = [self.tokens]
        if self.logprob_values is not None:
            reads += [self.logprob_values, self.logprob_ids]
        if self.eos_logprobs is not None:
            reads.append(self.eos_logprobs)
        return reads


class Sampler:
    """Samples one token per row of logits.

    Random draws use the exponential-race trick (argmax of p / Exp(1) noise is
    a sample from p). A request with a ``seed`` draws its noise from its own
    generator, seeded by (seed, position of the token drawn), so its tokens do not
    depend on what else is in the batch, on preemption, or on speculative decoding.

    Speculative decoding passes one row per query row of a speculating request
    (the same request repeated, ``offsets`` 0..K). Sampling each row as usual and
    keeping a draft where the row's sample equals it is rejection sampling for a
    point-mass draft: draft x is kept with probability p(x), and on a miss the
    row's sample is distributed as p without x, renormalised, which is what
    max(p - q, 0) normalised is when q is a point mass. With a seed, the emitted
    tokens are the ones decoding one token a step would have drawn.
    """

    def __init__(self, device: torch.device, seed: int, grammars: GrammarMatchers | None = None) -> None:
        """``grammars``: the structured-output matchers over the engine's tokenizer (None: no tokenizer, so
        constrained requests are refused)."""
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        self.grammars = grammars

    def forget(self, request_ids: list[str]) -> None:
        """Drop what the sampler keeps for ended requests: ``forget_generators`` and ``forget_grammars``."""
        self.forget_generators(request_ids)
        self.forget_grammars(request_ids)

    def forget_generators(self, request_ids: list[str]) -> None:
        """Drop ended requests' seeded generators (where steps run: a step in flight may still draw with one)."""
        for request_id in request_ids:
            self._request_generators.pop(request_id, None)

    def forget_grammars(self, request_ids: list[str]) -> None:
        """Drop ended requests' grammar matchers (on the host, which alone reads and advances them)."""
        if self.grammars is not None:
            self.grammars.forget(request_ids)

    def _generator_for(self, view: SamplingView, position: int) -> torch.Generator:
        """The request's generator, seeded for drawing its token at ``position``."""
        gen = self._request_generators.get(view.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            self._request_generators[view.request_id] = gen
        # A tuple of ints hashes the same in every process (no hash randomisation for ints).
        gen.manual_seed(hash((view.sampling_params.seed, position)) & (2**63 - 1))
        return gen

    @staticmethod
    def _suppress_stop_tokens(logits: torch.Tensor, views: list[SamplingView]) -> None:
        # min_tokens: EOS and stop tokens are not allowed until that many tokens exist.
        rows: list[int] = []
        cols: list[int] = []
        for row, view in enumerate(views):
            params = view.sampling_params
            if view.num_output_tokens < params.min_tokens:
                banned = list(params.stop_token_ids)
                if view.eos_token_id is not None and not params.ignore_eos:
                    banned.append(view.eos_token_id)
                rows += [row] * len(banned)
                cols += banned
        if rows:  # one scatter for the whole batch
            index = to_device([rows, cols], torch.int64, logits.device)  # [2, n]
            logits.index_put_((index[0], index[1]), logits.new_full((), float("-inf")))  # a fill, not a copy

    def __call__(self, logits: torch.Tensor, requests: list[Request], offsets: list[int] | None = None) -> SamplerOutput:
        """logits [N, V] float32, one row per request -> N token ids (and logprobs where asked); reads the device.

        ``offsets`` (speculative decoding): row i draws the token at position ``requests[i].num_tokens +
        offsets[i]`` (default 0); a request is repeated over its rows and asks for nothing that depends on
        the tokens before each row (``engine.core.speculation.may_speculate``).
        """
        step = self.prepare(requests, logits.shape[-1], offsets)
        samples = self.sample(logits, step)
        return self.finish(step, requests, [t.tolist() for t in samples.to_read()])  # the step's host sync

    def prepare(self, requests: list[Request], vocab: int, offsets: list[int] | None = None) -> StepSampling:
        """Read what sampling ``requests`` (one per logits row) needs of them, on the host: their settings,
        token histories (penalties) and grammar states (masks). Histories may hold a token in flight."""
        views = [SamplingView(r, offsets[i] if offsets else 0) for i, r in enumerate(requests)]
        lp_rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        return StepSampling(
            views,
            penalty_inputs(requests, vocab, self.device),
            self.grammars.mask(requests) if self.grammars is not None else None,
            lp_rows,
            stage_int64([lp_rows], self.device)[0] if lp_rows else None,
            [requests[i].sampling_params.logprobs for i in lp_rows],
        )

    def sample(self, logits: torch.Tensor, step: StepSampling, last_tokens: torch.Tensor | None = None) -> DeviceSamples:
        """logits [N, V] -> the step's samples, left on the device (no host sync). ``last_tokens`` [N]: each
        row's input token, which resolves a penalised history's token in flight. Adjusts ``logits`` in place.
        A step where no request asks for penalties, logit_bias, min_p or logprobs runs none of their code."""
        raw = None
        if step.logprob_rows:  # the raw logits, before anything below adjusts them in place
            raw = logits.index_select(0, step.logprob_rows_d)  # [R, V]
        if step.penalties is not None:
            apply_penalty_inputs(logits, step.penalties, last_tokens)
        self._suppress_stop_tokens(logits, step.views)
        if step.grammar is not None:
            self.grammars.apply_mask(logits, step.grammar)
        tokens = self._sample(logits, step.views)  # [N]
        if raw is None:
            return DeviceSamples(tokens)
        logp = torch.log_softmax(raw.float(), dim=-1)  # [R, V]
        values, ids = gather_logprob_tensors(logp, tokens.index_select(0, step.logprob_rows_d), max(step.logprob_counts))
        eos = None
        if step.grammar is not None and self.grammars.eos_token_id is not None:
            eos = logp[:, self.grammars.eos_token_id:self.grammars.eos_token_id + 1]  # [R, 1]
        return DeviceSamples(tokens, values, ids, eos)

    def finish(self, step: StepSampling, requests: list[Request], read: list[list]) -> SamplerOutput:
        """The host's part once a step's samples are read back (``read``: ``samples.to_read()`` as lists):
        grammars advance by the tokens (a token one refuses becomes EOS, reported with EOS's logprob), and
        logprobs are unpacked. The grammar of a request that ended while the step ran is left as it is (the
        scheduler drops that request's token)."""
        tokens = read[0]
        refused: set[int] = set()
        if step.grammar is not None:
            picked = list(tokens)
            tokens = self.grammars.accept(requests, tokens)
            refused = {i for i, (a, b) in enumerate(zip(picked, tokens)) if a != b}
        logprobs: list[Logprobs | None] = [None] * len(requests)
        if not step.logprob_rows:
            return SamplerOutput(tokens, logprobs)
        found = unpack_logprobs(read[1], read[2], step.logprob_counts)
        for j, i in enumerate(step.logprob_rows):
            logprobs[i] = found[j]
            if i in refused:  # the EOS that replaced the token (see GrammarMatchers.accept), with its logprob
                logprobs[i].token_ids[0], logprobs[i].logprobs[0] = tokens[i], read[3][j][0]
        return SamplerOutput(tokens, logprobs)

    def _sample(self, logits: torch.Tensor, views: list[SamplingView]) -> torch.Tensor:
        """logits [N, V] (adjusted) -> sampled token ids [N] on the device."""
        params = [v.sampling_params for v in views]
        greedy = logits.argmax(dim=-1)  # [N]
        if all(p.is_greedy for p in params):
            return greedy

        temps = to_device([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32, logits.device)
        logits = logits / temps[:, None]  # [N, V]
        vocab = logits.shape[-1]
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_ps = [p.top_p for p in params]
        if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
            logits = _apply_top_k_top_p(logits, top_ks, top_ps)
        probs = torch.softmax(logits, dim=-1)  # [N, V]
        if any(p.min_p > 0.0 for p in params):
            probs = apply_min_p(probs, [p.min_p for p in params])

        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for row, view in enumerate(views):
            if view.sampling_params.seed is not None:
                noise[row].exponential_(generator=self._generator_for(view, view.num_tokens))
        sampled = (probs / noise).argmax(dim=-1)  # [N]
        is_greedy = to_device([p.is_greedy for p in params], torch.bool, logits.device)
        return torch.where(is_greedy, greedy, sampled)


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    # logits [N, V]; returns a copy with filtered-out entries at -inf.
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [N, V]
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]  # [1, V]
    k = to_device(top_ks, torch.int64, logits.device)[:, None]  # [N, 1]
    remove = ranks >= k
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    p = to_device(top_ps, torch.float32, logits.device)[:, None]
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the tokens ranked above it already cover top_p; the top one always stays.
    covered_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(covered_before >= p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)
