"""Messages between the engine process and its async client (msgspec, over a local pipe).

Only what changed crosses: a request is sent once; each step sends the new
tokens and text of the requests it advanced.
"""

import msgspec

from engine.core.stats import SchedulerStats


class SamplingSpec(msgspec.Struct, omit_defaults=True):
    """SamplingParams as plain data (validated again into SamplingParams in the engine)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True


class AddRequest(msgspec.Struct, tag=True):
    """``prompt``: token ids, already checked by the sender (``engine.text.prompts``); the engine checks them again."""

    request_id: str
    prompt: list[int]
    sampling: SamplingSpec
    cache_salt: str | None = None
    priority: int = 1
    tenant: str = "default"
    weight: float = 1.0
    preemptible: bool = True
    may_preempt: bool = True  # may take the place of preemptible work of a worse rank
    background: bool = False
    # False: no delta per step, one at the end carrying the whole output (token ids and text). For
    # callers that only want the result (the Batch API): a batch of 32 then costs the gateway one
    # message a finished line instead of 32 wakeups a step.
    stream: bool = True


class AbortRequest(msgspec.Struct, tag=True):
    request_id: str


class Shutdown(msgspec.Struct, tag=True):
    pass


class Delta(msgspec.Struct):
    """One request's progress in one step."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    queue_time_s: float | None = None  # in the engine's waiting queue before first scheduled


class StepOutputs(msgspec.Struct, tag=True):
    deltas: list[Delta]
    stats: SchedulerStats | None = None  # the engine's state after this step (or after an idle abort)


class RequestRejected(msgspec.Struct, tag=True):
    """The engine could not accept a request (bad prompt): the message is for the user."""

    request_id: str
    message: str


class Ready(msgspec.Struct, tag=True):
    model: str
    architecture: str
    max_model_len: int
    vocab_size: int
    has_tokenizer: bool


class Fatal(msgspec.Struct, tag=True):
    """The engine cannot go on (start-up failed, or a step raised); the process exits after sending it."""

    message: str


ToEngine = AddRequest | AbortRequest | Shutdown
FromEngine = StepOutputs | RequestRejected | Ready | Fatal

encoder = msgspec.msgpack.Encoder()
to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)
