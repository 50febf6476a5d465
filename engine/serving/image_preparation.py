"""Requests' images prepared beside the engine loop, so decoding them never stalls a step.

The gateway decodes each image once to check and size it, then sends its encoded bytes (a PNG is a fraction of
the float32 patches it becomes, and the gateway runs without torch). The engine turns them into what the tower
reads: decoded again, resized, cut into patches, hashed (the digest keys the prefix and encoder caches): about
25 ms of CPU a 448x448 PNG on the 2-core test host (17 ms decoding to patches, 7.5 ms the digest), every running
stream's next token late by as much if the loop did it. An
``AddRequest`` with images waits here while the engine's image worker prepares them (``LLMEngine
.prepare_images``) and joins the engine once they are ready; the engine steps for everybody else meanwhile. An
abort or release of a waiting request drops it: not started, its images are never prepared (the requests queued
behind it on the worker are not delayed by a client that left); being prepared, the result is thrown away.
"""

from concurrent.futures import Future
from typing import TYPE_CHECKING

from engine.serving.held_requests import HeldRequests
from engine.serving.protocol import AddRequest

if TYPE_CHECKING:  # the engine process imports this module with the engine built
    from engine.llm_engine import LLMEngine


class ImagePreparation:
    def __init__(self, engine: "LLMEngine") -> None:
        self.engine = engine
        self._waiting = HeldRequests()
        self._prepared: dict[str, tuple] = {}  # request id -> its PromptImages, until ``images_of`` takes them

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def hold(self, msg: AddRequest) -> bool:
        """True if ``msg`` waits for its images (the caller adds it later, from ``ready``); False to add now."""
        if not msg.images:
            return False
        try:
            future = self.engine.prepare_images(msg.prompt, msg.images, msg.policy.cache_salt)
        except Exception as e:  # the worker could not be set up (a bad preprocessor config): this request fails,
            future = Future()  # from ``ready`` as any preparation's error, never the loop
            future.set_exception(e)
        self._waiting.hold(msg, future)
        return True

    def drop(self, request_id: str) -> None:
        """Forget a request (aborted): waiting for its images, or prepared and not yet taken."""
        self._waiting.drop(request_id)
        self._prepared.pop(request_id, None)

    def release(self, request_id: str) -> bool:
        """Forget a request still waiting for its images (it has not started); True if it was waiting. One whose
        images are prepared is past here (added, or held for its schema's matcher): the engine's to release."""
        return self._waiting.drop(request_id)

    def ready(self) -> list[tuple[AddRequest, BaseException | None]]:
        """The held requests whose images are done, in arrival order, each with the preparation's error (None:
        prepared, ``images_of`` hands them over)."""
        done = []
        for msg, future in self._waiting.done():
            error = future.exception()
            if error is None:
                self._prepared[msg.request_id] = future.result()
            done.append((msg, error))
        return done

    def images_of(self, msg: AddRequest):
        """What ``LLMEngine.add_request`` takes for ``msg``'s images: prepared here, else its bytes (none)."""
        return self._prepared.pop(msg.request_id, msg.images)
