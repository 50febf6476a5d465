"""Requests the engine loop holds back while something they need is made beside it (a future each)."""

from concurrent.futures import Future

from engine.serving.protocol import AddRequest


class HeldRequests:
    """``AddRequest``s by request id, each with the future it waits for, in arrival order."""

    def __init__(self) -> None:
        self._waiting: dict[str, tuple[AddRequest, Future]] = {}

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def hold(self, msg: AddRequest, future: Future) -> None:
        self._waiting[msg.request_id] = (msg, future)

    def drop(self, request_id: str) -> bool:
        """Forget a held request (its future's result is thrown away; not started, it never starts: the worker
        goes on to the requests behind it); True if it was held."""
        held = self._waiting.pop(request_id, None)
        if held is not None:
            held[1].cancel()
        return held is not None

    def done(self) -> list[tuple[AddRequest, Future]]:
        """The held requests whose future is done, no longer held, in arrival order."""
        done = [(msg, future) for msg, future in self._waiting.values() if future.done()]
        for msg, _ in done:
            del self._waiting[msg.request_id]
        return done
