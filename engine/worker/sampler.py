"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds."""

import torch

from engine.core.request import Request
from engine.structured_output.matchers import GrammarMatchers
from engine.worker.staging import to_device


class Sampler:
    """Samples one token per row of logits.

    Random draws use the exponential-race trick (argmax of p / Exp(1) noise is
    a sample from p). A request with a ``seed`` draws its noise from its own
    generator, so its tokens do not depend on what else is in the batch.
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

    def _generator_for(self, request: Request) -> torch.Generator:
        gen = self._request_generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(request.sampling_params.seed)
            self._request_generators[request.request_id] = gen
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

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """logits [N, V] float32, one row per request -> N token ids."""
        tokens = self._sample(logits, requests)
        if self.grammars is not None:
            tokens = self.grammars.accept(requests, tokens)
        return tokens

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        self._suppress_stop_tokens(logits, requests)
        if self.grammars is not None:
            self.grammars.apply(logits, requests)
        params = [r.sampling_params for r in requests]
        greedy = logits.argmax(dim=-1)  # [N]
        if all(p.is_greedy for p in params):
            return greedy.tolist()

        temps = to_device([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32, logits.device)
        logits = logits / temps[:, None]  # [N, V]
        vocab = logits.shape[-1]
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_ps = [p.top_p for p in params]
        if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
            logits = _apply_top_k_top_p(logits, top_ks, top_ps)
        probs = torch.softmax(logits, dim=-1)  # [N, V]

        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for row, request in enumerate(requests):
            if request.sampling_params.seed is not None:
                noise[row].exponential_(generator=self._generator_for(request))
        sampled = (probs / noise).argmax(dim=-1)  # [N]
        is_greedy = to_device([p.is_greedy for p in params], torch.bool, logits.device)
        return torch.where(is_greedy, greedy, sampled).tolist()


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
