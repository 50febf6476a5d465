"""A Responses API request as the chat completion request it runs as.

The Responses API is served by the chat path (chat plan, tool-call and reasoning parsers, structured output,
admission, billing): ``chat_request`` maps ``instructions`` and the input items to chat messages, the flat
function tools and ``tool_choice`` to the chat shapes, ``text.format`` to ``response_format`` and
``max_output_tokens`` to ``max_completion_tokens``. ``responses_error`` renames the chat fields in an error
raised on the way back to the Responses API's own.
"""

from gateway.errors import APIError
from gateway.openai_schema import (
    ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDefinition, NamedFunction, NamedToolChoice,
    SamplingFields, Tool, ToolCallMessage,
)
from gateway.response_format import JSONSchemaFormat, JSONSchemaSpec
from gateway.responses.request import (
    FunctionCallItem, FunctionCallOutputItem, FunctionChoice, FunctionTool, InputItem, InputText, JSONSchemaTextFormat,
    MessageItem, OutputText, ReasoningItem, ResponsesRequest,
)

# A chat field named in an error -> the Responses API field it came from.
_RENAMED = (("response_format", "text.format"), ("max_completion_tokens", "max_output_tokens"),
            ("max_tokens", "max_output_tokens"), (".function.parameters", ".parameters"))


def chat_request(req: ResponsesRequest, items: list[InputItem], tools: list[FunctionTool]) -> ChatCompletionRequest:
    """The chat completion request ``req`` runs as; ``items`` is the whole conversation (a stored one's items,
    then this request's input), ``tools`` its decoded tools."""
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    messages += chat_messages(items)
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
        **{name: getattr(req, name) for name in SamplingFields.__struct_fields__})


def _effort_kwargs(effort: str | None) -> dict | None:
    """Effort "none" switches thinking off in the templates that can (the Qwen3 family); low, medium and high are
    gpt-oss's reasoning effort (read by openai-harmony); the templates that know neither ignore them."""
    if effort == "none":
        return {"enable_thinking": False}
    return {"reasoning_effort": effort} if effort in ("low", "medium", "high") else None


def chat_messages(items: list[InputItem]) -> list[ChatMessage]:
    """Input items -> chat turns. An assistant's message and the function calls after it are one assistant
    turn; a function call's output is a tool turn; a developer message is a system turn (the templates know
    no developer role); reasoning items are left out (templates drop earlier turns' reasoning)."""
    out: list[ChatMessage] = []
    for item in items:
        if isinstance(item, ReasoningItem):
            continue
        if isinstance(item, FunctionCallOutputItem):
            out.append(ChatMessage(role="tool", content=_text(item.output), tool_call_id=item.call_id))
            continue
        last = out[-1] if out and out[-1].role == "assistant" else None
        if isinstance(item, FunctionCallItem):
            call = ToolCallMessage(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if last is None:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            else:
                last.tool_calls = [*(last.tool_calls or []), call]
            continue
        role = "system" if item.role == "developer" else item.role
        text = _text(item.content)
        if role == "assistant" and last is not None and not last.tool_calls:
            last.content = text if last.content is None else last.content + text  # one turn, several messages
        else:
            out.append(ChatMessage(role=role, content=text))
    return out


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(p.text if isinstance(p, (InputText, OutputText)) else p.refusal for p in content)


def responses_error(err: APIError) -> APIError:
    """``err`` with the chat fields it names renamed to the Responses API's (a chat message's place is not an
    input item's: ``messages[...]`` becomes ``input``)."""
    if err.param is not None and err.param.startswith("messages"):
        err.param = "input"
    for chat, responses in _RENAMED:
        if err.param is not None and chat in err.param:
            err.param = err.param.replace(chat, responses)
            err.message = err.message.replace(chat, responses)
    return err
