"""The one path a generation request takes through the gateway: chat, completions, Responses and Batch lines.

``run`` drives its stages, always in this order:

1. **plan**: the body's sampling settings and, for chat, how it is rendered and read (``ChatPlan``);
2. **prompts**: a chat's images fetched where they are remote URLs the operator allows
   (``gateway/remote_images.py``), decoded and sized on a worker thread (``gateway/chat_images.py``), the prompts
   rendered and tokenized (each image's placeholder expanded to its token count), each checked against the
   model's length (a ``400`` naming the field);
3. **admission**: the caller's ``Admission.admit`` (the live API reserves the tenant's quota and counts the
   request against its class's overload cap; a Batch line was admitted with its batch) gives the policy the
   request runs under;
4. **schema**: a ``response_format``'s (or a forced tool call's) JSON schema compiled by the grammar library,
   a ``400`` if it cannot be enforced;
5. **policy**: the admitted policy with the body's ``priority`` as its ``order_in_class``, under the LoRA
   adapter the request named (loaded onto the engine here);
6. **streams**: one engine request per prompt, merged, read to a reply by the caller's ``respond``;
7. **settle**: the caller's ``Admission.settle``, once admitted, whatever happened after.

Stages 1-2 are cheap and catch a malformed request before it reserves anything. The schema compile comes after
admission on purpose: it can cost seconds of a core, so only a counted, rate-limited request pays for one (a
flood of heavy schemas is refused at ``429`` like any other flood), and a request whose schema is refused has
its reservation released at the settle.
"""

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import asyncio
import msgspec

from engine.core.outputs import RequestOutput
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.serving.client import EngineClient
from gateway.chat_images import DEFAULT_IMAGE_LIMITS, ImageLimits
from gateway.chat_plan import ChatPlan, ParserChoice
from gateway.completion import (
    apply_plan, chat_plan_of, order_in_class, output_view, prepare_prompts, read_images, start_streams,
)
from gateway.errors import APIError
from gateway.lora_adapters import AdapterCatalog
from gateway.remote_images import RemoteImagePolicy
from gateway.openai_schema import sampling_params_of
from gateway.schema_check import check_schema

Outputs = AsyncGenerator[tuple[int, RequestOutput], None]  # (prompt index, output), merged; closing aborts
ImageLimitsOf = Callable[[], Awaitable[ImageLimits]]  # a request's image limits, asked once it has images
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Planned:
    """A request after stages 1-2: its body, its sampling settings, its chat plan (None for completions) and its
    checked prompts as token ids (a chat request has one)."""

    body: Any
    chat: bool
    sampling_params: SamplingParams
    plan: ChatPlan | None
    prompts: list[list[int]]
    images: tuple[bytes, ...] = ()  # a chat's encoded images, checked (its prompt holds their placeholders)

    @property
    def prompt_lengths(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def sequences(self) -> int:
        """Engine sequences the request runs: each prompt ``n`` times."""
        return len(self.prompts) * self.sampling_params.n


@dataclass(frozen=True, slots=True)
class Adapter:
    """The LoRA adapter a request's ``model`` named (``AdapterCatalog.resolve``'s answer), loaded at stage 5."""

    catalog: AdapterCatalog
    name: str
    path: str


class Admission(Protocol):
    """What a caller of ``run`` decides: whether the request may start, under which policy, and how it ends."""

    def check_open(self) -> None:
        """Before the prompts are rendered: an APIError if the request cannot be served now (shutting down,
        engine down)."""
        ...

    async def admit(self, planned: Planned) -> RequestPolicy:
        """Reserve what the request may use (an APIError if refused: nothing to settle) and return the policy it
        runs under (its ``order_in_class`` and ``lora_adapter`` are set by ``run``)."""
        ...

    async def settle(self, outputs: Outputs | None, status: int) -> None:
        """After an admitted request, always: close ``outputs`` (None if no engine request was started; closing
        aborts what has not finished) and settle the reservation. ``status``: 200, the APIError's status, 499 if
        the client went away, else 500."""
        ...


async def plan(engine: EngineClient, body, chat: bool, parsers: ParserChoice,
               admission: Admission, remote_images: RemoteImagePolicy | None = None,
               image_limits: ImageLimitsOf | None = None) -> Planned:
    """Stages 1-2: the sampling settings, the chat plan, then (once ``admission`` says the server is open) the
    checked prompts; ``remote_images``: which remote image URLs are fetched (None: none); ``image_limits``: the
    limits the request's images are read under (the server's, tightened by its tenant's quota), asked only of a
    chat with images (None: ``DEFAULT_IMAGE_LIMITS``)."""
    vocab_size = engine.info.vocab_size if engine.info is not None else None
    sampling_params = sampling_params_of(body, vocab_size)
    chat_plan = None
    if chat:
        chat_plan = chat_plan_of(engine, body, parsers)
        apply_plan(sampling_params, chat_plan, body)
    admission.check_open()
    limits = DEFAULT_IMAGE_LIMITS
    if image_limits is not None and chat_plan is not None and chat_plan.images:
        limits = await image_limits()
    images = await read_images(engine, chat_plan, remote_images, limits)  # a 400 naming the image part
    prompts = await prepare_prompts(engine, body, chat, chat_plan, sampling_params, images)
    return Planned(body, chat, sampling_params, chat_plan, prompts, tuple(im.data for im in images))


async def check_planned_schema(planned: Planned) -> None:
    """Stage 4: a 400 naming the field if the request's schema cannot be enforced (``gateway/schema_check.py``)."""
    forced_call = planned.plan is not None and planned.plan.structured_output is not None
    await check_schema(planned.sampling_params.structured_output, planned.body, forced_call=forced_call)


async def request_policy(engine: EngineClient, admitted: RequestPolicy, body, adapter: Adapter | None) -> RequestPolicy:
    """Stage 5: the admitted policy with the body's ``priority`` as its place in its class, under ``adapter``
    (loaded onto every replica of ``engine`` first: a 400 naming ``model`` if it cannot be)."""
    lora_adapter = admitted.lora_adapter
    if adapter is not None:
        await adapter.catalog.serve_on(engine, adapter.name, adapter.path)
        lora_adapter = adapter.name
    return msgspec.structs.replace(admitted, order_in_class=order_in_class(body), lora_adapter=lora_adapter)


async def run(engine: EngineClient, body, chat: bool, parsers: ParserChoice, admission: Admission, rid: str,
              respond: Callable[[Planned, Outputs], Awaitable[T]], *, adapter: Adapter | None = None,
              per_token: bool = True, remote_images: RemoteImagePolicy | None = None,
              image_limits: ImageLimitsOf | None = None) -> T:
    """One request through every stage (see the module's docstring); ``respond``'s reply.

    ``rid`` names its engine requests (``rid-0``, ``rid-1``, ... for several prompts); ``per_token=False`` asks
    the engine for one output per request, at its end (only the result is wanted); ``remote_images``: which
    remote image URLs are fetched (``gateway.remote_images``; None: none). APIErrors as the API answers
    them; ``admission.settle`` runs once the request was admitted, even if it is cancelled.
    """
    planned = await plan(engine, body, chat, parsers, admission, remote_images, image_limits)
    admitted = await admission.admit(planned)
    status, outputs = 500, None
    try:
        await check_planned_schema(planned)
        policy = await request_policy(engine, admitted, body, adapter)
        outputs = start_streams(engine, planned.prompts, planned.sampling_params, rid, policy, output_view(body),
                                stream=per_token, images=planned.images)
        reply = await respond(planned, outputs)
        status = 200
        return reply
    except APIError as err:
        status = err.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499  # the client went away; closing the streams aborts the engine requests
        raise
    finally:
        await admission.settle(outputs, status)
