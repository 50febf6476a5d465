"""Token sampling: penalties and logit_bias, grammar masks, greedy, temperature, top-k, top-p, min_p, per-request
seeds, logprobs."""

from dataclasses import dataclass

import torch

from engine.core.logprobs import Logprobs
from engine.core.request import Request
from engine.sampling.logprobs import gather_logprobs
from engine.sampling.penalties import apply_min_p, apply_penalties
from engine.structured_output.matchers import GrammarMatchers
from engine.worker.staging import stage_int64, to_device


@dataclass(slots=True)
class SamplerOutput:
    """A step's sampled token per row, and the logprobs of the rows whose request asked (else None)."""

    token_ids: list[int]
    logprobs: list[Logprobs | None]


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

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        # Set by the engine once it has a tokenizer: constrained requests need one.
        self.grammars: GrammarMatchers | None = None

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._request_generators.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.forget(request_ids)

    def _generator_for(self, request: Request, position: int) -> torch.Generator:
        """The request's generator, seeded for drawing its token at ``position``."""
        gen = self._request_generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            self._request_generators[request.request_id] = gen
        # A tuple of ints hashes the same in every process (no hash randomisation for ints).
        gen.manual_seed(hash((request.sampling_params.seed, position)) & (2**63 - 1))
        return gen

    @staticmethod
    def _suppress_stop_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
        # min_tokens: EOS and stop tokens are not allowed until that many tokens exist.
        rows: list[int] = []
        cols: list[int] = []
        for row, request in enumerate(requests):
            params = request.sampling_params
            if request.num_output_tokens < params.min_tokens:
                banned = list(params.stop_token_ids)
                if request.eos_token_id is not None and not params.ignore_eos:
                    banned.append(request.eos_token_id)
                rows += [row] * len(banned)
                cols += banned
        if rows:  # one scatter for the whole batch
            index = to_device([rows, cols], torch.int64, logits.device)  # [2, n]
            logits.index_put_((index[0], index[1]), logits.new_full((), float("-inf")))  # a fill, not a copy

    def __call__(self, logits: torch.Tensor, requests: list[Request], offsets: list[int] | None = None) -> SamplerOutput:
        """logits [N, V] float32, one row per request -> N token ids (and logprobs where asked).

        ``offsets`` (speculative decoding): row i draws the token at position ``requests[i].num_tokens +
        offsets[i]`` (default 0); a request is repeated over its rows and asks for nothing that depends on
        the tokens before each row (``engine.core.speculation.may_speculate``).
        A step where no request asks for penalties, logit_bias, min_p or logprobs runs none of their code.
        """
        params = [r.sampling_params for r in requests]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if lp_rows:  # the raw logits, before anything below adjusts them in place
            (rows,) = stage_int64([lp_rows], logits.device)
            raw = logits.index_select(0, rows)  # [R, V]
        apply_penalties(logits, requests)
        self._suppress_stop_tokens(logits, requests)
        if self.grammars is not None:
            self.grammars.apply(logits, requests)
        sampled = self._sample(logits, requests, offsets)  # [N] on the device
        tokens = sampled.tolist()  # the step's one host sync
        chosen = sampled
        if self.grammars is not None:
            accepted = self.grammars.accept(requests, tokens)
            if accepted != tokens:  # a token the grammar refused became EOS: report the EOS's logprob
                chosen = to_device(accepted, torch.int64, logits.device)
            tokens = accepted
        logprobs: list[Logprobs | None] = [None] * len(requests)
        if lp_rows:  # only steps with a request that asks pay this read
            found = gather_logprobs(raw, chosen.index_select(0, rows), [params[i].logprobs for i in lp_rows])
            for i, lp in zip(lp_rows, found):
                logprobs[i] = lp
        return SamplerOutput(tokens, logprobs)

    def sample_on_device(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """logits [N, V] -> token ids [N] left on the device, with no host sync (overlapped steps).

        Only for requests that need no host work on their token: no grammar, no logprobs, no penalties
        (those read the token history, whose last token may still be on the device).
        """
        self._suppress_stop_tokens(logits, requests)
        return self._sample(logits, requests)

    def _sample(self, logits: torch.Tensor, requests: list[Request], offsets: list[int] | None = None) -> torch.Tensor:
        """logits [N, V] (adjusted) -> sampled token ids [N] on the device."""
        params = [r.sampling_params for r in requests]
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
        for row, request in enumerate(requests):
            if request.sampling_params.seed is not None:
                position = request.num_tokens + (offsets[row] if offsets else 0)
                noise[row].exponential_(generator=self._generator_for(request, position))
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
