"""Several choices in one response: ``n`` copies of each of one or more prompts.

Each prompt is one engine request (with ``SamplingParams.n`` copies, which share
its prefill); prompt ``p``'s copy ``i`` is choice ``p * n + i``. ``merged``
interleaves the prompts' engine streams as their outputs arrive; ``Choices``
keeps each choice's output so far and answers for the request as a whole
(finished, usage).
"""

import asyncio
from collections.abc import AsyncIterator

from engine.core.outputs import RequestOutput

MAX_CHOICES = 128  # prompts x n in one request


class Choices:
    """Each choice's output so far (merged where ``whole``), and the usage of them all.

    The attributes ``num_prompt_tokens``, ``num_output_tokens``, ``num_cached_tokens``, ``finish_reason``,
    ``finished`` mirror ``RequestOutput``'s for the request as a whole: the prompts are counted once
    each, however many copies ran, and the completion tokens of every choice.
    """

    def __init__(self, prompt_lengths: list[int], n: int, whole: bool) -> None:
        self.prompt_lengths, self.n, self.whole = prompt_lengths, n, whole
        self.outputs: list[RequestOutput | None] = [None] * (len(prompt_lengths) * n)

    def add(self, prompt_index: int, out: RequestOutput) -> int:
        """Record an engine output of prompt ``prompt_index``; returns its choice index."""
        index = prompt_index * self.n + out.index
        so_far = self.outputs[index]
        self.outputs[index] = out if so_far is None or not self.whole else so_far.merge(out)
        return index

    @property
    def started(self) -> bool:
        return any(o is not None for o in self.outputs)

    @property
    def finished(self) -> bool:
        return all(o is not None and o.finished for o in self.outputs)

    @property
    def failed(self) -> bool:
        """Some choice's output could not be produced (finish_reason 'error')."""
        return any(o is not None and o.finish_reason == "error" for o in self.outputs)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_lengths)

    @property
    def num_output_tokens(self) -> int:
        return sum(o.num_output_tokens for o in self.outputs if o is not None)

    @property
    def num_cached_tokens(self) -> int:
        # Each prompt's first copy: the others' hits on its blocks are the sharing, not the client's cache.
        firsts = self.outputs[::self.n]
        return sum(o.num_cached_tokens for o in firsts if o is not None)

    @property
    def finish_reason(self) -> str | None:
        """For the usage row: None until every choice has finished; then 'error' if one failed, else choice 0's."""
        if not self.finished:
            return None
        if self.failed:
            return "error"
        return self.outputs[0].finish_reason

    def usage(self) -> dict:
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_output_tokens,
                "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}


async def merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as outputs arrive; the first error raised ends them all.

    Closing this generator closes every stream (which aborts what has not finished).
    """
    if len(streams) == 1:  # the usual case: no tasks, no queue
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, stream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((p, out))
            queue.put_nowait((p, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait((p, e))

    tasks = [asyncio.create_task(pump(p, s)) for p, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            p, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield p, item
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for s in streams:
            await s.aclose()
