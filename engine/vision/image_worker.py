"""The thread an engine's images are decoded, preprocessed and hashed on, beside its step loop.

A 448x448 PNG takes about 25 ms of CPU to decode, resize, patch and hash on the 2-core test host: on the thread
that steps the engine, that is time no step runs, and every running stream's next token is late by as much.
Pillow's decoding and resizing, torch's kernels and hashlib's BLAKE2b over a large buffer release the GIL, so on
this thread the work costs the loop little more than a core it may share.

One thread per engine, started at its first image. Two kinds of job: the preparation of a request that has just
arrived, and the pixels a request already scheduled needs now (``urgent``: its chunk has reached an image whose
pixels were left lazy, ``engine.vision.prompt_images.LazyPixels``). Urgent jobs run before every job not yet
started, so a running request's steps never wait for the preparation of requests that arrived after it (a burst
of new images would otherwise hold its pixels back by 25 ms each); each kind runs in the order it was asked for.
The job running is not interrupted: an urgent one waits for it at most. ``wait`` tells when everything asked so
far is done, or only the urgent jobs.
"""

import functools
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_Job = tuple[Future, Callable[..., Any], tuple]


class _Queue:
    """The jobs one thread runs: urgent first, each kind in order. The thread holds this, never the
    ``ImageWorker``, so a worker nobody holds is collected, and its thread ends."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.urgent: deque[_Job] = deque()
        self.later: deque[_Job] = deque()
        self.closed = False

    def put(self, job: _Job, urgent: bool) -> None:
        with self.changed:
            (self.urgent if urgent else self.later).append(job)
            self.changed.notify()

    def take(self) -> _Job | None:
        """The next job, waiting for one; None once closed."""
        with self.changed:
            self.changed.wait_for(lambda: self.closed or self.urgent or self.later)
            if self.closed:
                return None
            return (self.urgent or self.later).popleft()

    def close(self) -> list[Future]:
        """Stop taking jobs; the futures of those not started."""
        with self.changed:
            self.closed = True
            dropped = [job[0] for job in (*self.urgent, *self.later)]
            self.urgent.clear()
            self.later.clear()
            self.changed.notify()
        return dropped


def _serve(queue: _Queue) -> None:
    while (job := queue.take()) is not None:
        _run(*job)
        del job  # its future holds the result (a request's pixels): not kept while the thread waits


def _run(future: Future, fn: Callable[..., Any], args: tuple) -> None:
    if not future.set_running_or_notify_cancel():  # cancelled while queued (its request was dropped)
        return
    try:
        result = fn(*args)
    except BaseException as e:  # the job's error is its caller's, from the future, never the thread's end
        future.set_exception(e)
    else:
        future.set_result(result)


class ImageWorker:
    """A single worker thread (started lazily) for one engine's image preparation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: _Queue | None = None
        # Jobs submitted and not yet done (``wait``), all and urgent: counts, not the newest futures, which would
        # keep their results (a request's pixels) until the next image request came.
        self._idle = threading.Condition(self._lock)
        self._unfinished = 0
        self._urgent_unfinished = 0

    def submit(self, fn: Callable[..., Any], *args: Any, urgent: bool = False) -> Future:
        """Run ``fn(*args)`` on the worker thread; its future. ``urgent``: needed now (a scheduled request's
        pixels), run before every job not started yet."""
        future: Future = Future()
        with self._lock:
            if self._queue is None:
                self._queue = _Queue()
                weakref.finalize(self, self._queue.close)
                threading.Thread(target=_serve, args=(self._queue,), name="image-prep_0", daemon=True).start()
            self._unfinished += 1
            self._urgent_unfinished += urgent
            self._queue.put((future, fn, args), urgent)
        future.add_done_callback(functools.partial(self._done, urgent))  # done or cancelled
        return future

    def _done(self, urgent: bool, _: Future) -> None:
        with self._idle:
            self._unfinished -= 1
            self._urgent_unfinished -= urgent
            self._idle.notify_all()

    def wait(self, timeout: float, urgent: bool = False) -> None:
        """Return once every job submitted so far is done (``urgent``: every urgent one), or after ``timeout``
        seconds."""
        with self._idle:
            self._idle.wait_for(lambda: (self._urgent_unfinished if urgent else self._unfinished) == 0, timeout)

    def close(self) -> None:
        """Drop the jobs not started; the thread ends after the one running, if any (nobody waits for it)."""
        with self._lock:
            queue, self._queue = self._queue, None
        if queue is not None:
            for future in queue.close():  # outside the lock: cancelling runs ``_done``, which takes it
                future.cancel()
