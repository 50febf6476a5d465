"""The image worker keeps nothing of a job once its caller took the result: a request's pixels (float32 patches,
megabytes an image) go when the request does, not when the next image request comes. Jobs needed now (a scheduled
request's pixels) run before the preparation queued ahead of them, and a step can wait for those alone."""

import gc
import threading
import time
import weakref

import torch

from engine.vision.image_worker import ImageWorker


def test_a_finished_jobs_result_is_not_kept_by_the_worker():
    worker = ImageWorker()
    try:
        future = worker.submit(torch.zeros, 1024, 1176)  # a 448x448 image's patches
        pixels = future.result(60)
        kept = weakref.ref(pixels)
        del future, pixels
        gc.collect()
        assert kept() is None, "the worker holds the last request's pixels"
    finally:
        worker.close()


def test_wait_returns_once_every_job_so_far_is_done():
    worker = ImageWorker()
    gate = threading.Event()
    try:
        first = worker.submit(gate.wait, 60)
        second = worker.submit(lambda: "done")
        worker.wait(0.01)  # the first is held: wait gives up after its timeout
        assert not second.done()
        gate.set()
        worker.wait(60)
        assert first.done() and second.result() == "done"
    finally:
        gate.set()
        worker.close()


def test_jobs_needed_now_go_before_those_queued_earlier():
    """Pixels a scheduled request needs now (``urgent``) run before preparation queued ahead of them, in order
    among themselves; the job already running is not interrupted. The worker is held on a first job until all
    are queued, so the order is the queue's, not the submitters' timing."""
    worker = ImageWorker()
    gate, started, ran = threading.Event(), threading.Event(), []

    def hold() -> None:
        started.set()
        gate.wait(60)
        ran.append("held")

    try:
        worker.submit(hold)
        assert started.wait(60)
        later = [worker.submit(ran.append, f"prepare {i}") for i in range(3)]
        now = [worker.submit(ran.append, f"pixels {i}", urgent=True) for i in range(2)]
        gate.set()
        for future in later + now:
            future.result(60)
        assert ran == ["held", "pixels 0", "pixels 1", "prepare 0", "prepare 1", "prepare 2"]
    finally:
        gate.set()
        worker.close()


def test_waiting_for_the_urgent_jobs_does_not_wait_for_the_others():
    """``wait(urgent=True)``, what a step with nothing else to run waits for: the pixels it needs, not the
    preparation of requests behind them (that one is held until the test ends)."""
    worker = ImageWorker()
    gate, started = threading.Event(), threading.Event()

    def prepare() -> str:
        started.set()
        gate.wait(60)
        return "prepared"

    try:
        later = worker.submit(prepare)
        assert started.wait(60)
        now = worker.submit(lambda: "pixels", urgent=True)
        worker.wait(0.01, urgent=True)  # behind the running preparation: gives up after its timeout
        assert not now.done()
        gate.set()
        worker.wait(60, urgent=True)
        assert now.result(0) == "pixels"
        queued = worker.submit(lambda: "next")
        held = threading.Event()
        worker.submit(held.wait, 60)  # keeps the worker busy: wait(urgent) must not wait for it
        start = time.monotonic()
        worker.wait(30, urgent=True)
        assert time.monotonic() - start < 15, "wait(urgent=True) waited for jobs that are not urgent"
        held.set()
        worker.wait(60)
        assert later.result(0) == "prepared" and queued.result(0) == "next"
    finally:
        gate.set()
        worker.close()


def test_a_dropped_job_never_runs_and_close_drops_the_queued_ones():
    """A queued job cancelled (its request aborted) is skipped; ``close`` cancels what has not started, and a
    job submitted after it runs on a fresh thread."""
    worker = ImageWorker()
    gate, started, ran = threading.Event(), threading.Event(), []

    def hold() -> None:
        started.set()
        gate.wait(60)

    try:
        worker.submit(hold)
        assert started.wait(60)
        dropped = worker.submit(ran.append, "dropped")
        kept = worker.submit(ran.append, "kept", urgent=True)
        assert dropped.cancel()
        gate.set()
        kept.result(60)
        worker.wait(60)
        assert ran == ["kept"]
        gate.clear()
        started.clear()
        worker.submit(hold)
        assert started.wait(60)
        queued = [worker.submit(ran.append, "never"), worker.submit(ran.append, "never", urgent=True)]
        worker.close()
        assert all(f.cancelled() for f in queued)
        gate.set()
        assert worker.submit(lambda: "again").result(60) == "again"
        assert ran == ["kept"]
    finally:
        gate.set()
        worker.close()
