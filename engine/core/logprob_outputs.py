"""Log-probabilities of tokens, as the engine reports them (plain data, no torch).

Columnar: entry ``i`` of every list describes one position (a generated token,
or a prompt token when prompt logprobs were asked for). Values are the
log-softmax of the model's raw logits at that position, before temperature,
penalties, logit_bias or filters: the distribution the model assigns.
"""

import msgspec


class Logprobs(msgspec.Struct, array_like=True):
    """Per position: the token, its log-probability and the ``k`` most likely tokens (most likely first).

    ``logprobs[i]`` is None only for the first prompt token (nothing precedes it); its top lists are empty.
    ``tokens`` / ``top_tokens`` are the tokens' text, filled by the output processor (the engine's tokenizer).
    """

    token_ids: list[int] = []
    logprobs: list[float | None] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    tokens: list[str] = []
    top_tokens: list[list[str]] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, later: "Logprobs") -> "Logprobs":
        """This followed by ``later``'s positions, as a new object."""
        return Logprobs(self.token_ids + later.token_ids, self.logprobs + later.logprobs, self.top_ids + later.top_ids,
                        self.top_logprobs + later.top_logprobs, self.tokens + later.tokens,
                        self.top_tokens + later.top_tokens)


    def tail(self, skip: int) -> "Logprobs":
        """The positions after the first ``skip``."""
        return Logprobs(self.token_ids[skip:], self.logprobs[skip:], self.top_ids[skip:], self.top_logprobs[skip:],
                        self.tokens[skip:], self.top_tokens[skip:])


def merge_logprobs(first: Logprobs | None, later: Logprobs | None) -> Logprobs | None:
    if first is None or later is None:
        return first if later is None else later
    return first.extend(later)
