"""The image worker keeps nothing of a job once its caller took the result: a request's pixels (float32 patches,
megabytes an image) go when the request does, not when the next image request comes."""

import gc
import threading
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
