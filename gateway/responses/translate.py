"""A Responses API request as the chat completion request it runs as.

The Responses API is served by the chat path (chat plan, tool-call and reasoning parsers, structured output,
admission, billing): ``chat_request`` maps ``instructions`` and the input items to chat messages, the flat
function tools and ``tool_choice`` to the chat shapes, ``text.format`` to ``response_format`` and
``max_output_tokens`` to ``max_completion_tokens``; OpenAI's hints keep their names (``text.verbosity`` is chat's
``verbosity``). ``responses_error`` renames the chat fields in an error
raised on the way back to the Responses API's own.
"""

import re

from gateway.errors import APIError
from gateway.openai_schema import (
    HINT_FIELDS, ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDefinition, ImagePart, ImageURL,
    NamedFunction, NamedToolChoice, SamplingFields, TextPart, Tool, ToolCallMessage,
)
from gateway.response_format import JSONSchemaFormat, JSONSchemaSpec
from gateway.responses.request import (
    FunctionCallItem, FunctionCallOutputItem, FunctionChoice, FunctionTool, InputImage, InputItem, InputText,
    JSONSchemaTextFormat, MessageItem, OutputText, ReasoningItem, ResponsesRequest,
)

# A chat field named in an error -> the Responses API field it came from.
_RENAMED = (("response_format", "text.format"), ("max_completion_tokens", "max_output_tokens"),
            ("max_tokens", "max_output_tokens"), (".function.parameters", ".parameters"))


def chat_request(req: ResponsesRequest, items: list[InputItem], tools: list[FunctionTool], earlier: int = 0,
                 places: list[str | None] | None = None) -> ChatCompletionRequest:
    """The chat completion request ``req`` runs as; ``items`` is the whole conversation (a stored one's
    ``earlier`` items, then this request's input), ``tools`` its decoded tools. ``places``, when given, gets each
    chat message's source (``input[k]``, ``instructions``, or ``previous_response_id`` for a stored conversation's
    items), for ``responses_error``."""
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    if places is not None:
        places += ["instructions"] * len(messages)
    messages += chat_messages(items, earlier, places)
    if not messages:
        raise APIError(400, "input has nothing to answer: give a message", param="input")
    fmt = req.text.format if req.text is not None else None
    if req.tool_choice == "required" or isinstance(req.tool_choice, FunctionChoice):
        # A forced call's output is the call, never text, so the text's format has nothing to apply to (agents
        # send both: the answer's format with every request, the forced call on the first).
        fmt = None
    if isinstance(fmt, JSONSchemaTextFormat):
        fmt = JSONSchemaFormat(json_schema=JSONSchemaSpec(name=fmt.name, schema=fmt.schema, strict=fmt.strict,
                                                          description=fmt.description))
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    chat_tools = [Tool(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)) for t in tools]
    return ChatCompletionRequest(
        model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens, temperature=req.temperature,
        top_p=req.top_p, stream=req.stream, user=req.user, response_format=fmt, tools=chat_tools or None,
        tool_choice=choice, parallel_tool_calls=req.parallel_tool_calls,
        chat_template_kwargs=_effort_kwargs(req.reasoning.effort if req.reasoning else None),
        verbosity=req.text.verbosity if req.text is not None else None,
        **{name: getattr(req, name) for name in (*SamplingFields.__struct_fields__, *HINT_FIELDS)})


def _effort_kwargs(effort: str | None) -> dict | None:
    """Effort "none" switches thinking off in the templates that can (the Qwen3 family); low, medium and high are
    gpt-oss's reasoning effort (read by openai-harmony); the templates that know neither ignore them."""
    if effort == "none":
        return {"enable_thinking": False}
    return {"reasoning_effort": effort} if effort in ("low", "medium", "high") else None


def chat_messages(items: list[InputItem], earlier: int = 0, places: list[str | None] | None = None
                  ) -> list[ChatMessage]:
    """Input items -> chat turns. An assistant's message and the function calls after it are one assistant
    turn; a function call's output is a tool turn; a developer message is a system turn (the templates know
    no developer role); reasoning items are left out (templates drop earlier turns' reasoning). A message with
    ``input_image`` parts keeps its parts (text parts and the chat API's ``image_url`` ones, one for one).
    ``places`` (when given) gets each turn's item: ``input[k]`` for the request's own (after ``earlier`` stored
    ones), else ``previous_response_id``."""
    out: list[ChatMessage] = []
    for n, item in enumerate(items):
        before = len(out)
        where = f"input[{n - earlier}]" if n >= earlier else STORED
        _turn(item, out, where)
        if places is not None and len(out) > before:
            places.append(where)
    return out


def _turn(item: InputItem, out: list[ChatMessage], where: str) -> None:
    """``item`` (at ``where``) added to the chat turns ``out``: a turn of its own, or joined to the last."""
    if isinstance(item, ReasoningItem):
        return
    if isinstance(item, FunctionCallOutputItem):
        out.append(ChatMessage(role="tool", content=_text(item.output, f"{where}.output"), tool_call_id=item.call_id))
        return
    last = out[-1] if out and out[-1].role == "assistant" else None
    if isinstance(item, FunctionCallItem):
        call = ToolCallMessage(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
        if last is None:
            out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            last.tool_calls = [*(last.tool_calls or []), call]
        return
    role = "system" if item.role == "developer" else item.role
    if not isinstance(item.content, str) and any(isinstance(p, InputImage) for p in item.content):
        # Its own turn, its parts kept one for one, so an image's errors name its place (input[k].content[j]);
        # the chat plan refuses images outside user messages.
        out.append(ChatMessage(role=role, content=[_chat_part(p, f"{where}.content[{j}]")
                                                   for j, p in enumerate(item.content)]))
        return
    text = _text(item.content, f"{where}.content")
    if role == "assistant" and last is not None and not last.tool_calls and isinstance(last.content, (str, type(None))):
        last.content = text if last.content is None else last.content + text  # one turn, several messages
    else:
        out.append(ChatMessage(role=role, content=text))


def _chat_part(part, where: str) -> TextPart | ImagePart:
    if isinstance(part, InputImage):
        if part.file_id is not None or part.image_url is None:
            raise APIError(400, f"{where}: an input_image needs its image_url (a data: URL, or an http(s) URL of a "
                                "host this server fetches from); file_id is not taken", param=where)
        return ImagePart(image_url=ImageURL(url=part.image_url))
    return TextPart(text=part.text if isinstance(part, (InputText, OutputText)) else part.refusal)


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    for j, p in enumerate(content):
        if isinstance(p, InputImage):
            raise APIError(400, f"{where}[{j}]: input_image parts are taken in message items only (a function "
                                "call's output carries text)", param=f"{where}[{j}]")
    return "\n".join(p.text if isinstance(p, (InputText, OutputText)) else p.refusal for p in content)


_MESSAGE_PLACE = re.compile(r"messages\[(\d+)\]")
STORED = "previous_response_id"  # the place of a stored conversation's items (and of what is wrong in one)


def responses_error(err: APIError, places: list[str | None] | None = None) -> APIError:
    """``err`` with the chat fields it names renamed to the Responses API's: a chat message's place becomes its
    input item's where ``places`` (``chat_request``'s) knows it (``messages[2].content[1]`` ->
    ``input[1].content[1]``), ``instructions``, or ``previous_response_id`` for a message of the stored
    conversation (which the client did not send: it is told so, and how to go on), else ``input``."""
    found = _MESSAGE_PLACE.match(err.param or "")
    place = places[int(found[1])] if found is not None and places is not None and int(found[1]) < len(places) \
        else None
    if place == STORED:
        err.message = (err.message.replace(err.param, f"a message of the conversation stored under {STORED}")
                       + "; send the conversation as input instead, without what is refused")
        err.param = STORED
    elif place == "instructions":
        err.message = err.message.replace(err.param, "instructions")
        err.param = "instructions"
    elif place is not None:
        err.param = place + err.param[found.end():]
        err.message = err.message.replace(found[0], place)
    elif err.param is not None and err.param.startswith("messages"):
        err.param = "input"
    for chat, responses in _RENAMED:
        if err.param is not None and chat in err.param:
            err.param = err.param.replace(chat, responses)
            err.message = err.message.replace(chat, responses)
    return err
