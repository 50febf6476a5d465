"""The Responses API's ``background``, ``background_options`` and ``image``: typed as the openai client sends
them, and checked against what this server runs.

A response runs while its request is open: there are no background responses to poll (``background: true`` is
refused, pointing to the Batch API, which runs discounted offline work at the ``batch`` class's priority on idle
capacity). So ``background_options.completion_window`` ``"soonest"`` runs as without it, and ``"2h"``/``"8h"``,
which OpenAI's API takes only with ``background: true`` and no stream, are refused by that rule or with
``background``. Images are read whole at the model's own size: ``image.context_compression`` ``"auto"`` and
``"disabled"`` are taken (the effective policy, echoed, is ``"disabled"``) and ``"enabled"`` is refused.
"""

from typing import Annotated, Literal

import msgspec

from gateway.errors import APIError

MAX_CONTINUATION_ID = 512  # characters; OpenAI documents none, and a metadata value's bound is the same


class BackgroundOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    completion_window: Literal["soonest", "2h", "8h"] | None = None  # null: "soonest"
    # The client's opaque id for related background requests: checked, not used (none run in the background here).
    continuation_id: Annotated[str, msgspec.Meta(max_length=MAX_CONTINUATION_ID)] | None = None


class ImageOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    context_compression: Literal["auto", "enabled", "disabled"] | None = None  # null: "auto"


# What the response object echoes as its image policy when the request set one.
EFFECTIVE_IMAGE_OPTIONS = {"context_compression": "disabled"}

_BATCH_API = ("for discounted offline work on idle capacity use the Batch API (upload the requests with "
              "/v1/files, run them with POST /v1/batches, endpoint /v1/responses)")


def check_run_options(background: bool | None, options: BackgroundOptions | None, stream: bool | None,
                      image: ImageOptions | None) -> None:
    """400 naming the field for what this server does not run (see the module's docstring)."""
    window = options.completion_window if options is not None else None
    if window in ("2h", "8h") and (background is not True or stream):
        raise APIError(400, f"background_options.completion_window {window!r} needs background: true and stream "
                            "false or left out; this server runs no background responses, so send \"soonest\" "
                            f"(or leave it out) for a response now, or {_BATCH_API}",
                       param="background_options.completion_window")
    if background:
        raise APIError(400, "background: true is not offered by this server: a response runs while its request is "
                            f"open (stream it to see it as it is written); leave background out or false, or "
                            f"{_BATCH_API}", param="background", code="unsupported_parameter")
    if image is not None and image.context_compression == "enabled":
        raise APIError(400, "image.context_compression \"enabled\": this server offers no image context compression "
                            "(images are read whole, at the model's own size); send \"auto\" or \"disabled\", or "
                            "leave it out", param="image.context_compression", code="unsupported_parameter")
