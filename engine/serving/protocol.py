"""Messages between the engine process and its async client (msgspec, over a local pipe).

Only what changed crosses: a request is sent once; each step sends the new
tokens and text of the requests it advanced.
"""

import msgspec

from engine.core.outputs import RequestOutput
from engine.core.request_policy import DEFAULT_POLICY, RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.core.stats import SchedulerStats


class KVSource(msgspec.Struct):
    """For a decode engine: this prompt's KV comes from the prefill engine of pair ``pair_id`` as transfer
    ``transfer_id``. The engine answers ``KVWanted`` with the blocks its own prefix cache lacks."""

    pair_id: str
    transfer_id: int


class KVSink(msgspec.Struct):
    """For a prefill engine: once the prompt is computed, send its blocks with these prefix hashes (in order) to
    the decode engine of pair ``pair_id`` as transfer ``transfer_id``."""

    pair_id: str
    transfer_id: int
    block_hashes: list[bytes]


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
    kv_source: KVSource | None = None  # a decode engine's request whose prompt KV another engine computes
    kv_sink: KVSink | None = None  # a prefill engine's request whose prompt KV goes to a decode engine
    # Encoded images (PNG, JPEG, WebP, GIF, ...), one per run of image placeholder tokens in ``prompt``, in order:
    # the engine decodes and preprocesses them off its step loop (``engine.serving.image_preparation``); only for a
    # model that reads images.
    images: list[bytes] = []


class AbortRequest(msgspec.Struct, tag=True):
    request_id: str


class ReleaseRequest(msgspec.Struct, tag=True):
    """Give the request back if it has not started (see ``LLMEngine.release``); answered by ``Released``.

    A router sends it to move a queued request to a replica with a free slot."""

    request_id: str


class PairKV(msgspec.Struct, tag=True):
    """Join the two-process group ``pair_id`` that moves KV blocks between a prefill and a decode engine: the
    decode engine is rank 0 (its ``Ready.kv_address`` hosts the group's store), the prefill engine rank 1."""

    pair_id: str
    rank: int
    address: str


class KVSourceLost(msgspec.Struct, tag=True):
    """The prefill engine computing this request's prompt is gone: prefill it here, now."""

    request_id: str


class AddLora(msgspec.Struct, tag=True):
    """Serve the LoRA adapter at ``path`` as ``name`` from now on (``LLMEngine.add_lora``: the same name and path
    again is a no-op); answered by ``LoraDone`` with the same ``op_id``."""

    op_id: int
    name: str
    path: str


class RemoveLora(msgspec.Struct, tag=True):
    """Stop serving adapter ``name`` (``LLMEngine.remove_lora``); answered by ``LoraDone``."""

    op_id: int
    name: str


class Shutdown(msgspec.Struct, tag=True):
    pass


class StepOutputs(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]  # this step's output of each request it advanced (see engine.serving.step_reports)
    stats: SchedulerStats | None = None  # the engine's state after this step (or after an idle abort)


class RequestRejected(msgspec.Struct, tag=True):
    """The engine could not accept a request (bad prompt), or could not serve the adapter it names (``param``
    "model"): the message is for the user."""

    request_id: str
    message: str
    param: str | None = None  # the request field at fault; None: the prompt
    code: str | None = None  # the API's error code, where one applies


class Released(msgspec.Struct, tag=True):
    """The answer to ``ReleaseRequest``: True if the engine dropped the request (it sends nothing more for
    it), False if it had started or is unknown (it goes on as before)."""

    request_id: str
    released: bool


class LoraDone(msgspec.Struct, tag=True):
    """The answer to ``AddLora`` / ``RemoveLora`` ``op_id``: ``error`` None if done, else one line saying why not
    (a malformed directory, an unknown name, an engine that serves no adapters)."""

    op_id: int
    error: str | None = None


class KVWanted(msgspec.Struct, tag=True):
    """A decode engine's answer to a request with a ``KVSource``: the prefix hashes of the prompt's blocks it
    lacks, in order (empty: it prefills the prompt itself, no transfer)."""

    request_id: str
    block_hashes: list[bytes]


class Ready(msgspec.Struct, tag=True):
    model: str
    architecture: str
    max_model_len: int
    vocab_size: int
    has_tokenizer: bool
    role: str = "both"  # EngineConfig.role
    block_size: int = 16
    kv_address: str | None = None  # a decode engine's HOST:PORT for its prefill engines (PairKV)


PROTOCOL_VERSION = 6  # of the messages between a gateway and a remote engine; raised when they change


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
    """The gateway's answer to ``Hello``: start the engine for me. ``deployment_id``: the gateway's deployment
    (``EngineConfig.deployment_id``), which the engine's disk tier keeps to."""

    deployment_id: str | None = None


class Alive(msgspec.Struct, tag=True):
    """A prefill or decode engine's liveness beat (``engine_loop.LIVENESS_S``), from a thread beside its loop:
    the process runs, though a step may not have ended (it says nothing about progress)."""


class Fatal(msgspec.Struct, tag=True):
    """The engine cannot go on (start-up failed, or a step raised); the process exits after sending it."""

    message: str


ToEngine = AddRequest | AbortRequest | ReleaseRequest | PairKV | KVSourceLost | AddLora | RemoveLora | Shutdown
FromEngine = StepOutputs | RequestRejected | Released | LoraDone | KVWanted | Ready | Fatal | Alive

encoder = msgspec.msgpack.Encoder()
to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)
greeting_decoder = msgspec.msgpack.Decoder(Hello | Fatal)  # the first message of a remote engine's connection
attach_decoder = msgspec.msgpack.Decoder(Attach)
