"""A chat request rendered to gpt-oss's prompt tokens by the ``openai-harmony`` package, in place of the
checkpoint's chat template.

OpenAI's roles map onto harmony's messages as gpt-oss's own template maps them: the system message (with the
request's reasoning effort and today's date), the client's system and developer messages as the developer
message's instructions, the tools as its ``functions`` namespace; earlier assistant turns as their reasoning
(``analysis``), preamble (``commentary``) or answer (``final``) and their calls (``commentary`` to
``functions.NAME``, JSON arguments); tool results as messages from ``functions.NAME`` to the assistant.
"""

import datetime
import json

from engine.text.chat_input import ChatInput, InvalidPrompt

EFFORTS = ("low", "medium", "high")
# chat_template_kwargs that gpt-oss's template reads and harmony's system message takes; enable_thinking (which
# switches thinking off in the templates that can) is taken and has no effect: gpt-oss always reasons.
TEMPLATE_KWARGS = ("reasoning_effort", "model_identity", "enable_thinking")


def _system(chat: ChatInput, effort: str | None):
    from openai_harmony import Message, ReasoningEffort, Role, SystemContent

    content = SystemContent.new().with_conversation_start_date(datetime.date.today().isoformat())
    if effort is not None:
        content = content.with_reasoning_effort(ReasoningEffort(effort.capitalize()))
    if chat.template_kwargs.get("model_identity") is not None:
        content = content.with_model_identity(str(chat.template_kwargs["model_identity"]))
    return Message.from_role_and_content(Role.SYSTEM, content)


def _developer(chat: ChatInput):
    """The client's instructions and tools as harmony's developer message (None if there are neither)."""
    from openai_harmony import DeveloperContent, Message, Role, ToolDescription

    instructions = "\n\n".join(m["content"] for m in chat.messages
                               if m["role"] in ("system", "developer") and m.get("content"))
    if not instructions and not chat.tools:
        return None
    content = DeveloperContent.new()
    if instructions:
        content = content.with_instructions(instructions)
    if chat.tools:
        content = content.with_function_tools([
            ToolDescription.new(t["function"]["name"], t["function"].get("description", ""),
                                parameters=t["function"].get("parameters")) for t in chat.tools])
    return Message.from_role_and_content(Role.DEVELOPER, content)


def _assistant(turn: dict) -> list:
    from openai_harmony import Message, Role

    out = []
    if turn.get("reasoning_content"):
        out.append(Message.from_role_and_content(Role.ASSISTANT, turn["reasoning_content"]).with_channel("analysis"))
    calls = turn.get("tool_calls") or []
    if turn.get("content"):  # beside calls it is a preamble, which harmony writes on the commentary channel
        channel = "commentary" if calls else "final"
        out.append(Message.from_role_and_content(Role.ASSISTANT, turn["content"]).with_channel(channel))
    for call in calls:
        arguments = call["function"]["arguments"]  # an object, or the text of a call cut short, as it was
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        out.append(Message.from_role_and_content(Role.ASSISTANT, text)
                   .with_channel("commentary").with_recipient(f"functions.{call['function']['name']}")
                   .with_content_type("<|constrain|>json"))
    return out


def conversation(chat: ChatInput, effort: str | None):
    """The request's harmony ``Conversation``; InvalidPrompt naming the field it cannot take."""
    from openai_harmony import Author, Conversation, Message, Role

    messages = [_system(chat, effort)]
    developer = _developer(chat)
    if developer is not None:
        messages.append(developer)
    call_names: dict[str, str] = {}  # tool_call_id -> the function it called
    for i, turn in enumerate(chat.messages):
        role = turn["role"]
        if role in ("system", "developer"):
            continue
        if role == "user":
            messages.append(Message.from_role_and_content(Role.USER, turn["content"]))
        elif role == "assistant":
            call_names.update({c["id"]: c["function"]["name"] for c in turn.get("tool_calls") or []})
            messages += _assistant(turn)
        else:  # tool
            name = call_names.get(turn["tool_call_id"]) or turn.get("name")
            if name is None:
                raise InvalidPrompt(f"messages[{i}].tool_call_id {turn['tool_call_id']!r} is not the id of an earlier "
                                    "assistant tool call; send the call's id", f"messages[{i}].tool_call_id")
            messages.append(Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), turn["content"])
                            .with_channel("commentary").with_recipient("assistant"))
    return Conversation.from_messages(messages)


def render(chat: ChatInput, encoding) -> list[int]:
    """The prompt token ids of ``chat`` (ending with the assistant's turn opened, unless the request said not to);
    InvalidPrompt naming the field it cannot take."""
    from openai_harmony import Role

    unknown = sorted(set(chat.template_kwargs) - set(TEMPLATE_KWARGS))
    if unknown:
        raise InvalidPrompt(f"chat_template_kwargs: gpt-oss's chat is rendered by openai-harmony, which takes only "
                            f"{', '.join(TEMPLATE_KWARGS)}; leave out {', '.join(unknown)}", "chat_template_kwargs")
    if chat.continue_final_message:
        raise InvalidPrompt("continue_final_message: harmony opens a new assistant message for every completion; "
                            "leave it out", "continue_final_message")
    effort = chat.reasoning_effort or chat.template_kwargs.get("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise InvalidPrompt(f"reasoning_effort must be one of {', '.join(EFFORTS)}; got {effort!r}", "reasoning_effort")
    convo = conversation(chat, effort)
    if chat.add_generation_prompt:
        return list(encoding.render_conversation_for_completion(convo, Role.ASSISTANT))
    return list(encoding.render_conversation(convo))
