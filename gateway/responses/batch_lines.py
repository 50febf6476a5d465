"""Batch API lines for ``/v1/responses``: decoded and translated as the live route does, run as chat by the
batch runner, answered with the response object. A batch line is not stored (there is no later request in
the batch to continue it), so ``previous_response_id`` cannot be used in one."""

from gateway.choices import Choices
from gateway.errors import APIError
from gateway.openai_schema import ChatCompletionRequest
from gateway.responses.builder import ResponseBuilder, new_item_id, skeleton, usage
from gateway.responses.request import FunctionTool, ResponsesRequest, decode_request
from gateway.responses.translate import chat_request, responses_error

ENDPOINT = "/v1/responses"


def line_request(body: bytes, places: list[str | None] | None = None
                 ) -> tuple[ResponsesRequest, ChatCompletionRequest, list[FunctionTool]]:
    """(the line's request, the chat request it runs as, its tools); a 400 naming the field otherwise.
    ``places`` (when given) gets each chat message's input item, for ``responses_error``."""
    req, items, tools = decode_request(body)
    if req.previous_response_id is not None:
        raise APIError(400, "previous_response_id cannot be used in a batch (batch responses are not stored); send "
                            "the whole conversation as input", param="previous_response_id")
    try:
        return req, chat_request(req, items, tools, places=places), tools
    except APIError as err:
        raise responses_error(err) from None


def renderer(req: ResponsesRequest, tools: list[FunctionTool]):
    """``gateway.batch.line_completion.complete``'s ``render`` for this line: the whole output as a response object."""

    def render(rid: str, created: int, model: str, chat: bool, whole: Choices, body, fingerprint: str, plan) -> dict:
        response = skeleton(req, new_item_id("resp"), created, model, tools)
        response["store"] = False
        builder = ResponseBuilder(response, plan.output_parser())
        out = whole.outputs[0]
        builder.feed(out.text, out.token_ids, True, cut=out.finish_reason == "length")
        builder.finish(out.finish_reason, usage(whole.num_prompt_tokens, whole.num_cached_tokens,
                                                whole.num_output_tokens))
        return builder.response

    return render
