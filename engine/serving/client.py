"""The one interface the gateway uses to talk to an engine (``AsyncEngine`` implements it; test doubles too)."""

from collections.abc import AsyncIterator, Sequence
from typing import Protocol, runtime_checkable

from engine.core.config import EngineConfig
from engine.core.outputs import RequestOutput
from engine.core.request_policy import DEFAULT_POLICY, RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.core.stats import SchedulerStats
from engine.serving.protocol import Ready


class EngineClient(Protocol):
    """An engine as the gateway sees it.

    ``info`` is set once the engine said Ready (None while starting or restarting); ``dead`` holds why it
    stopped, in words for clients (None while it runs), ``dead_detail`` the same with what the engine reported
    (exception text, peers' addresses) for the log; ``stats`` is the engine's latest statistics (None before
    its first step).
    """

    config: EngineConfig
    info: Ready | None
    dead: str | None
    dead_detail: str | None
    stats: SchedulerStats | None

    def silent_s(self) -> float:
        """Seconds since the running engine last sent anything (it speaks at least every second while it runs
        normally); 0 while it is not running."""
        ...

    async def start(self) -> Ready: ...

    async def restart(self) -> Ready: ...

    async def shutdown(self) -> None: ...

    async def prepare(self, prompt: str | list[int] | None = None, messages: Sequence | None = None,
                      add_generation_prompt: bool = True) -> list[int]:
        """The checked prompt token ids of a text or token prompt, or of chat ``messages``."""
        ...

    def chat_template(self) -> str | None:
        """The checkpoint's chat template text (None without one): picks the tool-call and reasoning parsers."""
        ...

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of token ids (``InvalidPrompt`` for ids outside the vocabulary)."""
        ...

    def generate(self, prompt: list[int], sampling_params: SamplingParams, request_id: str | None = None,
                 policy: RequestPolicy = DEFAULT_POLICY, stream: bool = True,
                 images: Sequence[bytes] = ()) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs until it finishes; closing the stream aborts the request.

        ``policy`` goes to the engine's scheduler unchanged. ``stream=False``: one output when the request
        finishes, with the whole generation in it. ``images``: encoded images for a model that reads them, one
        per run of image placeholder tokens in ``prompt`` (the gateway passes it only when there are some)."""
        ...

    async def release(self, request_id: str) -> bool:
        """Drop the request if it has not started (waiting, nothing computed or generated); True if dropped,
        after which its stream gets nothing more. A router moves such requests to a replica with room."""
        ...


@runtime_checkable
class CheckedBeforeStart(Protocol):
    """An engine with something to check before any replica of its gateway starts (a remote engine: its place in
    the gateway's group, without attaching it); a gateway with several replicas checks them all first."""

    async def preflight(self) -> None:
        """EngineError if the engine is wrong for this gateway or cannot be reached."""
        ...
