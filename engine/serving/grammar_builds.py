"""Grammar matchers built beside the engine loop, so a large schema never stalls a step.

Building a schema's matcher for the model's vocabulary can take seconds (the gateway bounds a schema's size, but
an offline caller or another client need not). An ``AddRequest`` whose schema has no matcher yet waits here
while one worker thread builds it (the grammar library releases the GIL meanwhile), and is added to the engine
once it is built; the engine steps for everybody else in the meantime. An abort of a waiting request drops it.
"""

from concurrent.futures import ThreadPoolExecutor

from engine.serving.held_requests import HeldRequests
from engine.serving.protocol import AddRequest


class GrammarBuilds:
    def __init__(self, grammars) -> None:
        self.grammars = grammars  # engine.structured_output.matchers.GrammarMatchers, or None without a tokenizer
        self._pool: ThreadPoolExecutor | None = None
        self._waiting = HeldRequests()

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def hold(self, msg: AddRequest) -> bool:
        """True if ``msg`` waits for its matcher (the caller adds it later, from ``ready``); False to add now."""
        spec = msg.sampling_params.structured_output
        if spec is None or self.grammars is None or self.grammars.prepared(spec):
            return False
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-build")
        self._waiting.hold(msg, self._pool.submit(self.grammars.build, spec))
        return True

    def drop(self, request_id: str) -> bool:
        return self._waiting.drop(request_id)

    def ready(self) -> list[tuple[AddRequest, BaseException | None]]:
        """The held requests whose build ended, in arrival order, each with the build's error (None: built, and
        now kept by the matchers, so adding the request costs nothing)."""
        done = []
        for msg, future in self._waiting.done():
            error = future.exception()
            if error is None:
                self.grammars.keep(msg.sampling_params.structured_output, future.result())
            done.append((msg, error))
        return done
