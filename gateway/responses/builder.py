"""A response object and its stream events, built from the chat output parser's pieces as the engine's text
arrives.

The same builder serves both modes: a streamed request writes each event as it is made; a whole one keeps
only the finished ``response``. Output items, in the order the model wrote them: ``reasoning`` (when the
served model's reasoning parser splits off its thinking), ``message`` (the text, one ``output_text`` part),
``function_call`` (one per parsed call). Events follow OpenAI's sequence: ``response.created``,
``response.in_progress``, then per item ``output_item.added``, its content part's ``added`` / deltas / ``done``
(function calls: ``function_call_arguments.delta`` / ``done``), ``output_item.done``, and last
``response.completed`` (``response.incomplete`` when cut at ``max_output_tokens``, ``response.failed`` when
the engine could not produce it); each event has the next ``sequence_number``.
"""

import json
import secrets
from collections.abc import Sequence

import msgspec

from gateway.chat_plan import ChatOutputParser
from gateway.responses.request import FunctionTool, ResponsesRequest
from gateway.responses.run_options import EFFECTIVE_IMAGE_OPTIONS
from gateway.tool_parsers import ToolCall


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def skeleton(req: ResponsesRequest, rid: str, created: int, model: str, tools: list[FunctionTool]) -> dict:
    """The response object before any output: the request's settings as OpenAI echoes them."""
    choice = req.tool_choice or "auto"
    text_format = req.text.format if req.text is not None and req.text.format is not None else None
    reasoning = req.reasoning
    return {
        "id": rid, "object": "response", "created_at": created, "status": "in_progress", "background": False,
        "error": None, "incomplete_details": None, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "max_tool_calls": None, "model": model, "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": reasoning.effort if reasoning else None, "summary": reasoning.summary if reasoning else None},
        "service_tier": "default", "store": req.store is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": msgspec.to_builtins(text_format) if text_format else {"type": "text"}, "verbosity": req.text.verbosity if req.text is not None and req.text.verbosity else "medium"},
        "tool_choice": choice if isinstance(choice, str) else msgspec.to_builtins(choice),
        "tools": [msgspec.to_builtins(t) for t in tools], "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled", "usage": None, "user": req.user, "metadata": req.metadata or {},
        **({"image": EFFECTIVE_IMAGE_OPTIONS} if req.image is not None else {}),
    }


def usage(input_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    """The response's usage; its reasoning tokens are filled in by ``ResponseBuilder.finish``."""
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


class ResponseBuilder:
    """Feed the engine's text step by step (``feed``), then ``finish``; each returns the events it made."""

    def __init__(self, response: dict, parser: ChatOutputParser) -> None:
        self.response = response
        self.parser = parser
        self.sequence = 0
        self._reasoning_share = 0.0  # output tokens spent on reasoning, as far as the steps' text tells
        self._open: dict | None = None  # the item being written (reasoning or message)
        self._held = ""  # leading whitespace, kept until it turns out to start a message

    @property
    def output(self) -> list[dict]:
        return self.response["output"]

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _snapshot(self) -> dict:
        return msgspec.json.decode(msgspec.json.encode(self.response))  # events keep the state they were made in

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def feed(self, text: str, token_ids: Sequence[int], last: bool, cut: bool = False) -> list[dict]:
        """One step's text and tokens; ``last``: the output ends here; ``cut``: it ends at the token limit (a
        call it was writing, whose arguments are not a whole JSON object, is ``incomplete``)."""
        num_tokens = len(token_ids)
        piece = self.parser.feed(text, token_ids)
        if last:
            piece += self.parser.finish()
        if piece.reasoning:  # a step's tokens are not tied to its characters: a mixed step counts its share
            self._reasoning_share += num_tokens * len(piece.reasoning) / (len(piece.reasoning) + len(piece.content))
        events = []
        if piece.reasoning:
            events += self._part("reasoning", piece.reasoning)
        if piece.content:
            events += self._text(piece.content)
        for call in piece.tool_calls:
            events += self._call(call, "incomplete" if cut and last and not _json_object(call.arguments)
                                 else "completed")
        return events

    def _text(self, text: str) -> list[dict]:
        if self._open is None or self._open["type"] != "message":
            if not (self._held + text).strip():
                self._held += text
                return []
            text, self._held = self._held + text, ""
        return self._part("message", text)

    def _part(self, kind: str, text: str) -> list[dict]:
        """``text`` added to the open item of ``kind`` (opened first, closing another)."""
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            if kind == "message":
                item = {"id": new_item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                item = {"id": new_item_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                        "content": []}
                part = {"type": "reasoning_text", "text": ""}
            events.append(self._event("response.output_item.added", output_index=len(self.output),
                                      item={**item, "content": []}))
            self._open = item
            self.output.append(item)
            item["content"].append(part)
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=len(self.output) - 1,
                                      content_index=0, part=dict(part)))
        item = self._open
        item["content"][0]["text"] += text
        where = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
        if not text:
            pass
        elif kind == "message":
            events.append(self._event("response.output_text.delta", **where, delta=text, logprobs=[]))
        else:
            events.append(self._event("response.reasoning_text.delta", **where, delta=text))
        return events

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": self.output.index(item), "content_index": 0}
        kind = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
        extra = {"logprobs": []} if item["type"] == "message" else {}
        item["status"] = status
        return [self._event(kind, **where, text=part["text"], **extra),
                self._event("response.content_part.done", **where, part=dict(part)),
                self._event("response.output_item.done", output_index=where["output_index"], item=self._copy(item))]

    def _call(self, call: ToolCall, status: str) -> list[dict]:
        events = self._close("completed")
        item = {"id": new_item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call.id,
                "name": call.name, "arguments": ""}
        index = len(self.output)
        events.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        self.output.append(item)
        item["arguments"], item["status"] = call.arguments, status
        events.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                  delta=call.arguments))
        events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=call.name, arguments=call.arguments))
        events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    @staticmethod
    def _copy(item: dict) -> dict:
        return {**item, "content": [dict(p) for p in item["content"]]}

    def finish(self, finish_reason: str | None, usage_: dict) -> list[dict]:
        """The last events, ending with the finished response; ``finish_reason`` is the engine's."""
        events = []
        if self._held and not any(i["type"] == "function_call" for i in self.output):
            events += self._part("message", self._held)  # an answer of whitespace is still the answer
        elif not self.output:
            events += self._part("message", "")  # nothing at all: an empty message, as a reply always has one
        cut = finish_reason == "length"
        events += self._close("incomplete" if cut else "completed")
        usage_["output_tokens_details"]["reasoning_tokens"] = round(self._reasoning_share)
        self.response["usage"] = usage_
        if finish_reason == "error":
            self.response["status"] = "failed"
            self.response["error"] = {"code": "server_error",
                                      "message": "the engine could not produce this response; it was not retried"}
            return events + [self._event("response.failed", response=self._snapshot())]
        if cut:
            self.response["status"] = "incomplete"
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
            return events + [self._event("response.incomplete", response=self._snapshot())]
        self.response["status"] = "completed"
        return events + [self._event("response.completed", response=self._snapshot())]
