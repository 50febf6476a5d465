"""Messages between the engine process and its async client (msgspec, over a local pipe).

Only what changed crosses: a request is sent once; each step sends the new
tokens and text of the requests it advanced.
"""

import msgspec

from engine.core.outputs import RequestOutput
from engine.core.request_policy import DEFAULT_POLICY, RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.core.stats import SchedulerStats


class AddRequest(msgspec.Struct, tag=True):
    """``prompt``: token ids, already checked by the sender (``engine.text.prompts``); the engine checks them again."""

    request_id: str
    prompt: list[int]
    sampling_params: SamplingParams
    policy: RequestPolicy = DEFAULT_POLICY
    # False: no delta per step, one at the end carrying the whole output (token ids and text). For
    # callers that only want the result (the Batch API): a batch of 32 then costs the gateway one
    # message a finished line instead of 32 wakeups a step.
    stream: bool = True


class AbortRequest(msgspec.Struct, tag=True):
    request_id: str


class ReleaseRequest(msgspec.Struct, tag=True):
    """Give the request back if it has not started (see ``LLMEngine.release``); answered by ``Released``.

    A router sends it to move a queued request to a replica with a free slot."""

    request_id: str


class Shutdown(msgspec.Struct, tag=True):
    pass


class StepOutputs(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]  # this step's output of each request it advanced (see engine.serving.step_reports)
    stats: SchedulerStats | None = None  # the engine's state after this step (or after an idle abort)


class RequestRejected(msgspec.Struct, tag=True):
    """The engine could not accept a request (bad prompt): the message is for the user."""

    request_id: str
    message: str


class Released(msgspec.Struct, tag=True):
    """The answer to ``ReleaseRequest``: True if the engine dropped the request (it sends nothing more for
    it), False if it had started or is unknown (it goes on as before)."""

    request_id: str
    released: bool


class Ready(msgspec.Struct, tag=True):
    model: str
    architecture: str
    max_model_len: int
    vocab_size: int
    has_tokenizer: bool


PROTOCOL_VERSION = 3  # of the messages between a gateway and a remote engine; raised when they change


class Hello(msgspec.Struct, tag=True):
    """What a remote engine (``moegate engine --listen``) says of itself as a gateway connects, before it builds
    anything: its place in a group of replicas that divide the experts and where that group meets. The gateway
    answers ``Attach`` to go on, or closes the connection (a place it cannot give this engine, or another
    ``protocol``: the messages of another moegate version)."""

    protocol: int
    data_parallel_rank: int
    data_parallel_size: int
    distributed_init_method: str | None


class Attach(msgspec.Struct, tag=True):
    """The gateway's answer to ``Hello``: start the engine for me."""


class Fatal(msgspec.Struct, tag=True):
    """The engine cannot go on (start-up failed, or a step raised); the process exits after sending it."""

    message: str


ToEngine = AddRequest | AbortRequest | ReleaseRequest | Shutdown
FromEngine = StepOutputs | RequestRejected | Released | Ready | Fatal

encoder = msgspec.msgpack.Encoder()
to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)
greeting_decoder = msgspec.msgpack.Decoder(Hello | Fatal)  # the first message of a remote engine's connection
attach_decoder = msgspec.msgpack.Decoder(Attach)
