"""What the engine reports per request, and the processor that builds it (text, stop strings)."""

import logging

import msgspec

from engine.core.logprob_outputs import Logprobs, merge_logprobs
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import RequestUpdate, Scheduler
from engine.text.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


class RequestOutput(msgspec.Struct):
    """One request's progress: the type that flows from the engine's step to the gateway and offline callers.

    ``token_ids`` and ``text`` are what this output carries: a step's output
    carries that step's new tokens and text; ``merge`` folds later outputs into
    an earlier one, so a merged output (what ``LLM.generate`` returns, and what a
    ``stream=False`` request receives) carries the whole generation.
    ``num_output_tokens`` always counts every token generated so far.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    stop_reason: int | str | None = None
    queue_time_s: float | None = None  # arrival to first scheduled (None while still waiting)
    index: int = 0  # which of the request's n choices this is (SamplingParams.n)
    logprobs: Logprobs | None = None  # of this output's tokens, when the request asked (SamplingParams.logprobs)
    prompt_logprobs: Logprobs | None = None  # of the prompt's tokens (SamplingParams.prompt_logprobs), in the first

    def merge(self, later: "RequestOutput") -> "RequestOutput":
        """This output followed by ``later`` (the same request's next output) as one."""
        assert later.request_id == self.request_id and later.index == self.index
        return RequestOutput(
            self.request_id, self.token_ids + later.token_ids, self.text + later.text, later.finished,
            later.finish_reason, later.num_prompt_tokens, later.num_cached_tokens, later.num_output_tokens,
            later.stop_reason, later.queue_time_s if later.queue_time_s is not None else self.queue_time_s,
            self.index,
            merge_logprobs(self.logprobs, later.logprobs), merge_logprobs(self.prompt_logprobs, later.prompt_logprobs),
        )


def merge_step_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per request and choice: a step that reports two for one (the step in flight's, then the
    one it ran synchronously) merges them, in order."""
    merged: dict[tuple[str, int], RequestOutput] = {}
    for out in outputs:
        key = (out.request_id, out.index)
        merged[key] = merged[key].merge(out) if key in merged else out
    return list(merged.values())


class _TextState:
    __slots__ = ("detok", "text", "emitted", "prompt_logprobs", "prompt_sent")

    def __init__(self, detok: IncrementalDetokenizer | None, prompt_logprobs: Logprobs | None = None) -> None:
        self.detok = detok
        self.text = ""
        self.emitted = 0  # characters already handed out as deltas
        self.prompt_logprobs = prompt_logprobs  # collected over the prompt's chunks, sent with the first output
        self.prompt_sent = False


class OutputProcessor:
    """Detokenizes, applies stop strings (ending the request in the scheduler) and builds outputs.

    While stop strings are set, the last ``len(longest stop) - 1`` characters are
    held back from deltas, so a streamed delta never shows part of a stop string.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _TextState] = {}
        self._token_texts: dict[int, str] = {}  # each token's own text, for logprobs (at most the vocabulary)

    def add_request(self, request: Request) -> None:
        detok = None
        if self.tokenizer is not None:
            params = request.sampling_params
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens,
                                           params.spaces_between_special_tokens)
        prompt_lp = None
        if request.sampling_params.prompt_logprobs is not None:  # the first prompt token has no logprob
            prompt_lp = Logprobs([request.prompt_token_ids[0]], [None], [[]], [[]])
        self._states[request.request_id] = _TextState(detok, prompt_lp)

    def discard(self, request_id: str) -> None:
        """Forget a request that never ran (the scheduler refused it)."""
        self._states.pop(request_id, None)

    def abort(self, request: Request) -> RequestOutput | None:
        state = self._states.pop(request.request_id, None)
        if state is None:
            return None
        return self._output(request, state, [], "")

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs show it (``token_id:N`` without a tokenizer)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = f"token_id:{token_id}" if self.tokenizer is None else self.tokenizer.decode([token_id])
            self._token_texts[token_id] = text
        return text

    def with_texts(self, lp: Logprobs) -> Logprobs:
        """``lp`` with its tokens' texts filled in."""
        lp.tokens = [self.token_text(t) for t in lp.token_ids]
        lp.top_tokens = [[self.token_text(t) for t in top] for top in lp.top_ids]
        return lp

    def _add_prompt_logprobs(self, prompt_logprobs: dict[str, tuple[int, Logprobs]]) -> None:
        for request_id, (position, lp) in prompt_logprobs.items():
            state = self._states.get(request_id)
            if state is None or state.prompt_logprobs is None or state.prompt_sent:
                continue
            have = len(state.prompt_logprobs)  # positions a preempted request's recompute scores again are dropped
            if position <= have < position + len(lp):
                state.prompt_logprobs = state.prompt_logprobs.extend(lp.tail(have - position))

    def process(self, updates: list[RequestUpdate], scheduler: Scheduler, logprobs: dict[str, Logprobs] | None = None,
                prompt_logprobs: dict[str, tuple[int, Logprobs]] | None = None) -> list[RequestOutput]:
        """Outputs for a step's updates; ``logprobs`` (by request id) of the tokens sampled for those that asked,
        ``prompt_logprobs`` (by request id: first position, logprobs) of prompt tokens scored this step."""
        if prompt_logprobs:
            self._add_prompt_logprobs(prompt_logprobs)
        outputs = []
        for update in updates:
            try:
                state = self._states.get(update.request.request_id)
                out = self._process_one(update, scheduler)
                lp = logprobs.get(update.request.request_id) if logprobs else None
                if lp is not None:
                    out.logprobs = self.with_texts(lp)
                if state is not None and state.prompt_logprobs is not None and not state.prompt_sent:
                    state.prompt_sent = True
                    out.prompt_logprobs = self.with_texts(state.prompt_logprobs)
                outputs.append(out)
            except Exception as e:  # this request's text failed (a tokenizer bug): end it alone, not the step
                request = update.request
                logger.error("request %s: output processing failed (%s); it ends with finish_reason 'error'",
                             request.request_id, type(e).__name__)
                scheduler.finish(request.request_id, RequestStatus.FINISHED_ERROR)
                request.status = RequestStatus.FINISHED_ERROR
                request.stop_reason = f"output processing failed: {type(e).__name__}"
                state = self._states.pop(request.request_id, None) or _TextState(None)
                outputs.append(self._output(request, state, update.new_token_ids, ""))
        return outputs

    def _process_one(self, update: RequestUpdate, scheduler: Scheduler) -> RequestOutput:
        request = update.request
        state = self._states[request.request_id]
        finished = update.finished
        stops = request.sampling_params.stop_strings
        new_ids = update.new_token_ids
        if state.detok is not None:
            # A token that ended the request by id (EOS, stop_token_ids) contributes no text, unless asked.
            ended_by_token = (finished and request.status == RequestStatus.FINISHED_STOPPED
                              and not request.sampling_params.include_stop_str_in_output)
            text_ids = new_ids[:-1] if ended_by_token else new_ids
            before = len(state.text)
            if stops and len(text_ids) > 1:  # a speculative step's tokens: cut where one completes a stop string
                kept = self._add_until_stop(stops, state, text_ids, before)
                if len(kept) < len(text_ids):  # what followed the stop (an EOS too) was never generated
                    request.truncate_output(request.num_output_tokens - (len(new_ids) - len(kept)))
                    new_ids = kept
            elif text_ids:
                state.text += state.detok.add(text_ids)
            if finished:
                state.text += state.detok.flush()  # a character held back before the end still counts
            if text_ids:
                if stops and self._apply_stop_strings(request, state, before):
                    scheduler.finish(request.request_id, RequestStatus.FINISHED_STOPPED)
                    request.status = RequestStatus.FINISHED_STOPPED  # also if it already ended by length
                    finished = True
        hold = 0 if finished or not stops else max(len(s) for s in stops) - 1
        upto = max(state.emitted, len(state.text) - hold)
        delta = state.text[state.emitted:upto]
        state.emitted = upto
        if finished:
            del self._states[request.request_id]
        return self._output(request, state, new_ids, delta)

    @staticmethod
    def _add_until_stop(stops: list[str], state: _TextState, token_ids: list[int], before: int) -> list[int]:
        """Add tokens' text one by one, up to the one that completes a stop string; returns the tokens added."""
        search_from = max(0, before - max(len(s) for s in stops) + 1)
        for i, token in enumerate(token_ids):
            state.text += state.detok.add([token])
            if any(state.text.find(s, search_from) >= 0 for s in stops):
                return token_ids[:i + 1]
        return token_ids

    @staticmethod
    def _apply_stop_strings(request: Request, state: _TextState, before: int) -> bool:
        longest = max(len(s) for s in request.sampling_params.stop_strings)
        search_from = max(0, before - longest + 1)
        hits = [(state.text.find(s, search_from), s) for s in request.sampling_params.stop_strings]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        keep = request.sampling_params.include_stop_str_in_output
        state.text = state.text[:index + len(stop) if keep else index]
        request.stop_reason = stop
        return True

    @staticmethod
    def _output(request: Request, state: _TextState, new_ids: list[int], delta: str) -> RequestOutput:
        return RequestOutput(
            request_id=request.output_id,
            index=request.index,
            token_ids=list(new_ids),
            text=delta,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_output_tokens=request.num_output_tokens,
            stop_reason=request.stop_reason,
            queue_time_s=None if request.first_scheduled_time is None
            else request.first_scheduled_time - request.arrival_time,
        )
