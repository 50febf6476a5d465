"""Stream obfuscation (OpenAI's ``stream_options.include_obfuscation``): each streamed event's JSON carries an
``obfuscation`` field of random letters and digits that pads it to a multiple of ``PAD_TO`` bytes, so the sizes of
encrypted events no longer tell an observer of the connection how long each generated piece of text was (a
token-length side channel). Off unless the request asks for it: it costs bandwidth on every event."""

import random
import string

import msgspec

PAD_TO = 64  # bytes: an event's JSON length is rounded up to a multiple of this
_FIELD = len(b',"obfuscation":""')
_ALPHABET = string.ascii_letters + string.digits
_rng = random.SystemRandom()


def encode_event(event: dict, obfuscate: bool) -> bytes:
    """``event`` as JSON; with ``obfuscate`` padded by its ``obfuscation`` field to a multiple of ``PAD_TO``
    bytes (the field added last, so the rest of the event is unchanged)."""
    data = msgspec.json.encode(event)
    if not obfuscate:
        return data
    pad = -(len(data) + _FIELD) % PAD_TO
    return msgspec.json.encode({**event, "obfuscation": "".join(_rng.choices(_ALPHABET, k=pad))})
