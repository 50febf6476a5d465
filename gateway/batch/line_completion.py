"""A Batch API line run to its end through the gateway's request pipeline (``gateway/pipeline.py``), as the live
API would run it: the same plan, prompts, schema check, policy and engine streams. Its admission is its batch's
(the quota was counted when the batch was created), so the line's own admission only hands back its policy."""

from engine.core.request_policy import RequestPolicy
from engine.serving.client import EngineClient
from gateway import pipeline
from gateway.chat_plan import ParserChoice
from gateway.choices import Choices
from gateway.completion import collect
from gateway.large_replies import whole_body
from gateway.pipeline import Adapter, ImageLimitsOf, Outputs, Planned
from gateway.remote_images import RemoteImagePolicy
from gateway.response_bodies import completion_body


class BatchLineAdmission:
    """``pipeline.Admission`` for a batch line: admitted with its batch, under ``policy``; the settle closes its
    engine streams (aborting them if it was cancelled)."""

    def __init__(self, policy: RequestPolicy) -> None:
        self.policy = policy

    def check_open(self) -> None:
        """Nothing to check: the runner claims lines only while the engine is up."""

    async def admit(self, planned: Planned) -> RequestPolicy:
        return self.policy

    async def settle(self, outputs: Outputs | None, status: int) -> None:
        if outputs is not None:
            await outputs.aclose()


async def complete(engine: EngineClient, body, chat: bool, rid: str, created: int, model: str, fingerprint: str = "",
                   *, policy: RequestPolicy, adapter: Adapter | None = None, parsers: ParserChoice | None = None,
                   render=completion_body, remote_images: RemoteImagePolicy | None = None,
                   image_limits: ImageLimitsOf | None = None) -> tuple[dict, Choices]:
    """Run one request to the end and return (response body, its choices); APIError as the live API would.

    ``policy``: how the engine schedules it (its ``order_in_class`` is taken from the body's ``priority``);
    ``adapter``: the LoRA adapter it runs under (None: the base model).
    Closing (or cancelling) aborts the engine requests.
    ``parsers``: the server's tool-call / reasoning parser settings (auto-detected when not given).
    ``render``: the response body, from ``completion_body``'s arguments (the Responses API has its own).
    ``remote_images``: which remote image URLs are fetched (``gateway.remote_images``; None: none).
    ``image_limits``: the limits its images are read under (``gateway.image_policy``; None: the defaults).
    """

    async def respond(planned: Planned, outputs: Outputs) -> tuple[dict, Choices]:
        choices = Choices(planned.prompt_lengths, planned.sampling_params.n, whole=True)
        whole = await collect(outputs, chat, choices)
        return await whole_body(whole, lambda: render(rid, created, model, chat, whole, body, fingerprint,
                                                      planned.plan)), whole

    # Only the result is wanted: one message from the engine at the end, not one per token.
    return await pipeline.run(engine, body, chat, parsers or ParserChoice(), BatchLineAdmission(policy), rid,
                              respond, adapter=adapter, per_token=False, remote_images=remote_images,
                              image_limits=image_limits)
