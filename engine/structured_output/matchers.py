"""One grammar matcher per constrained request, and the batch's token mask applied to the logits.

The sampler calls ``mask`` (on the host) and ``apply_mask`` (on the device) before it picks tokens, and
``accept`` with the tokens it picked. Masks are filled on the host (llguidance walks its parser there) into
one preallocated int32 bitmask, copied to the device without waiting and expanded there, so constraining
adds no host sync to a step, and a step whose requests have no grammar does nothing here at all.
"""

import logging
from dataclasses import dataclass

import llguidance
# The bitmask is a NumPy array shared with torch, not llguidance.torch's tensor: importing llguidance.torch decorates
# a kernel we do not use with torch.compile, which loads torch._dynamo (~1.8 s on every engine and rank process start).
import llguidance.numpy
import torch

from engine.core.request import Request
from engine.core.structured_output_spec import StructuredOutput
from engine.structured_output.byte_budget_cache import ByteBudgetCache
from engine.structured_output.grammar import client_message, grammar_of, limits
from engine.structured_output.vocabulary import grammar_tokenizer
from engine.device_batch.staging import to_device

logger = logging.getLogger(__name__)
# Untouched matchers kept per schema (cache_key), the most recently used ones, by their estimated bytes. The
# library does not report a matcher's memory; measured, it is about 40 times its grammar's text (a 300-property
# schema's: 0.7 MB), plus a base, so the estimate takes 64 times and 64 kB.
PROTOTYPE_CACHE_BYTES = 64 * 1024 * 1024


def prototype_bytes(grammar: str) -> int:
    """The memory a compiled matcher of ``grammar`` is reckoned to hold."""
    return 64 * 1024 + 64 * len(grammar)


@dataclass(slots=True)
class GrammarMask:
    """A step's allowed tokens for its constrained rows, on the device."""

    rows: torch.Tensor  # [R] int64: the rows (of the step's logits) with a grammar
    words: torch.Tensor  # [R, W] int32: bit b of word w allows token 32 * w + b


class GrammarMatchers:
    """The matchers of the engine's constrained requests, by request id."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None, device: torch.device) -> None:
        # vocab_size is the model's (it may pad the tokenizer's): ids past the tokenizer are never allowed.
        self.tokenizer = grammar_tokenizer(tokenizer, vocab_size, eos_token_id)
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.device = device
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._prototypes: ByteBudgetCache[llguidance.LLMatcher] = ByteBudgetCache(PROTOTYPE_CACHE_BYTES)
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)  # [rows, ceil(V / 32)] int32
        self._bit = torch.arange(32, dtype=torch.int32, device=device)  # [32]

    def __len__(self) -> int:
        return len(self._matchers)

    def prepare(self, spec: StructuredOutput) -> None:
        """Build ``spec``'s grammar and a fresh matcher for it, when a request is queued rather than in a step:
        ValueError if it cannot be enforced. Each request then starts from a copy (~1 us, where making a
        matcher costs ~0.4 ms), so a burst of requests with one schema adds nothing to the step they join."""
        if self._prototypes.get(spec.cache_key) is None:
            self.keep(spec, self.build(spec))

    def prepared(self, spec: StructuredOutput) -> bool:
        """Whether ``spec``'s matcher is built (``prepare`` costs nothing now)."""
        return spec.cache_key in self._prototypes

    def build(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """``spec``'s matcher, built now: seconds for a large schema, with the GIL released, so the engine runs it
        on a worker thread (``engine.serving.grammar_builds``) and keeps it with ``keep``. ValueError, in words
        a client may read, if it cannot be enforced."""
        grammar = grammar_of(spec)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits())
        if matcher.is_error():  # what only this vocabulary shows
            raise ValueError(client_message(matcher.get_error()))
        return matcher

    def keep(self, spec: StructuredOutput, matcher: llguidance.LLMatcher) -> None:
        self._prototypes.put(spec.cache_key, matcher, prototype_bytes(grammar_of(spec)))

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    def _matcher_for(self, request: Request) -> llguidance.LLMatcher:
        matcher = self._matchers.get(request.request_id)
        if matcher is None:
            # Made when the request samples its first token; preemption keeps it (the request keeps its tokens).
            spec = request.sampling_params.structured_output
            prototype = self._prototypes.get(spec.cache_key)
            if prototype is None:  # built at admission; gone only if many other schemas came since
                prototype = self.build(spec)
                self.keep(spec, prototype)
            matcher = prototype.deep_copy()
            self._matchers[request.request_id] = matcher
        return matcher

    def mask(self, requests: list[Request]) -> GrammarMask | None:
        """The tokens each constrained row's grammar allows next, filled now on the host and on their way to
        the device (``apply_mask`` uses them); None if no row has a grammar. One row per request."""
        rows = [row for row, r in enumerate(requests) if r.sampling_params.structured_output is not None]
        if not rows:
            return None
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = llguidance.numpy.allocate_token_bitmask(len(rows), self.vocab_size)
        for i, row in enumerate(rows):
            llguidance.numpy.fill_next_token_bitmask(self._matcher_for(requests[row]), self._bitmask, i)
        bitmask = torch.from_numpy(self._bitmask[: len(rows)])  # [R, W] int32, W = ceil(V / 32): the same memory
        # A copy of the shared buffer, which the next step refills while this one may still run. On CUDA a
        # fresh pinned block: the caching host allocator keeps it until the copy to the device has run.
        words = torch.empty(bitmask.shape, dtype=bitmask.dtype, pin_memory=self.device.type == "cuda")
        words.copy_(bitmask)
        return GrammarMask(to_device(rows, torch.int64, self.device), words.to(self.device, non_blocking=True))

    def apply_mask(self, logits: torch.Tensor, mask: GrammarMask) -> None:
        """Set, in place, every token ``mask`` does not allow to -inf. logits [N, V] float32."""
        allowed = ((mask.words[:, :, None] >> self._bit) & 1).bool().flatten(1)[:, : logits.shape[1]]  # [R, V]
        logits[mask.rows] = logits[mask.rows].masked_fill(~allowed, float("-inf"))

    def accept(self, requests: list[Request], tokens: list[int]) -> list[int]:
        """Advance each constrained request's matcher by its sampled token; returns the tokens to keep.

        A token the grammar refuses (another setting banned every token it allowed: ``min_tokens`` once the
        output is complete; or the library cannot follow a grammar it compiled, past its items in a row) is
        replaced by EOS, ending the request there. Where the output so far is not yet
        complete for the grammar, that end is not a normal stop: the request is marked (``Request.output_invalid``)
        and the scheduler ends it with finish reason ``error``, never ``stop`` with text that breaks the format.
        """
        for row, request in enumerate(requests):
            if request.sampling_params.structured_output is None or request.is_finished:
                continue  # a request that ended while its step ran: its token is dropped, its matcher gone
            matcher = self._matcher_for(request)
            complete = matcher.is_accepting()  # ~0.1 us; after a refused token the matcher can no longer say
            if matcher.consume_token(tokens[row]):
                continue
            logger.warning("request %s: token %d breaks its grammar (%s); ending it, its output %s", request.request_id,
                           tokens[row], matcher.get_error(), "complete" if complete else "incomplete")
            request.output_invalid = not complete
            if self.eos_token_id is not None:
                tokens[row] = self.eos_token_id
        return tokens
