"""A test double for ``engine.AsyncEngine`` that answers at once, for measuring the gateway alone.

It implements the interface the gateway uses (``engine.serving.client.EngineClient``) and
produces ``num_tokens`` one-character deltas per request with no model
behind them. Used only by the gateway overhead benchmark and a gateway test; never by the
product.
"""

from collections.abc import AsyncIterator
from engine.core.config import EngineConfig
from engine.core.outputs import RequestOutput
from engine.serving.protocol import Ready


class InstantEngine:
    def __init__(self, num_tokens: int = 8, max_model_len: int = 4096) -> None:
        self.config = EngineConfig(model="instant")
        self.num_tokens = num_tokens
        self.info: Ready | None = None
        self.stats = None
        self.dead: str | None = None
        self.dead_detail: str | None = None
        self._max_model_len = max_model_len

    async def start(self) -> Ready:
        self.info = Ready("instant", "InstantEngine", self._max_model_len, 32000, has_tokenizer=True)
        return self.info

    async def restart(self) -> Ready:
        return await self.start()

    def silent_s(self) -> float:
        return 0.0  # answers at once, always

    async def shutdown(self) -> None:
        pass

    def chat_template(self) -> str | None:
        return None  # no checkpoint: the default parsers

    async def prepare(self, prompt=None, messages=None) -> list[int]:
        """About one token per 4 characters of text, as a stand-in for a tokenizer."""
        if messages is not None:
            return [65] * max(1, sum(len(m.content) for m in messages) // 4 + 4 * len(messages))
        return list(prompt) if isinstance(prompt, list) else [65] * max(1, len(prompt) // 4)

    async def generate(self, prompt, sampling_params, request_id=None, policy=None, stream=True) -> AsyncIterator[RequestOutput]:
        prompt_tokens = len(prompt)
        wanted = min(self.num_tokens, sampling_params.max_tokens or self.num_tokens)
        for i in range(1, wanted + 1):
            done = i == wanted
            yield RequestOutput(request_id or "r", [65], "A", done, "length" if done else None, prompt_tokens, 0, i)
