"""The thread an engine's images are decoded, preprocessed and hashed on, beside its step loop.

A 448x448 PNG takes about 25 ms of CPU to decode, resize, patch and hash on the 2-core test host: on the thread
that steps the engine, that is time no step runs, and every running stream's next token is late by as much. Pillow's decoding and resizing, torch's kernels and hashlib's BLAKE2b over a large buffer release
the GIL, so on this thread the work costs the loop little more than a core it may share.

One thread per engine, started at its first image: images are prepared in the order they were asked for, and
``wait`` can tell when everything asked so far is done.
"""

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class ImageWorker:
    """A single worker thread (started lazily) for one engine's image preparation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        # Jobs submitted and not yet done (``wait``): a count, not the newest future, which would keep its result
        # (a request's pixels) until the next image request came.
        self._idle = threading.Condition(self._lock)
        self._unfinished = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on the worker thread; its future."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="image-prep")
            future = self._pool.submit(fn, *args)
            self._unfinished += 1
        future.add_done_callback(self._finished)  # done or cancelled; at once if done already
        return future

    def _finished(self, _: Future) -> None:
        with self._idle:
            self._unfinished -= 1
            self._idle.notify_all()

    def wait(self, timeout: float) -> None:
        """Return once every job submitted so far is done, or after ``timeout`` seconds."""
        with self._idle:
            self._idle.wait_for(lambda: self._unfinished == 0, timeout)

    def close(self) -> None:
        """Drop the jobs not started; the thread ends after the one running, if any (nobody waits for it)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
