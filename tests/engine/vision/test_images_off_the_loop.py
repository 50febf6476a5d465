"""No image is decoded, preprocessed or hashed on the thread that steps the engine: the engine process's loop
(``engine.serving.engine_loop``, run here on a thread of its own over real pipes) holds a request with images while
the engine's image worker prepares them and steps its other requests meanwhile; a held request can be aborted or
released; the tokens equal transformers' on the same pictures. Bytes seen before whose features the encoder cache
dropped are preprocessed on the worker too while the scheduler has the image wait (the offline engine stepped on
this thread). Every preprocessing and every digest is recorded with the thread it ran on."""

import io
import os
import random
import threading
import time
from multiprocessing import Pipe

import pytest
import torch

import engine.vision.prompt_images as prompt_images_module
from engine import LLM
from engine.core.config import EngineConfig
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.serving.engine_loop import EngineLoop
from engine.serving.protocol import (
    AbortRequest, AddRequest, Ready, Released, ReleaseRequest, RequestRejected, Shutdown, StepOutputs, encoder,
    from_engine_decoder,
)
from engine.vision.encoder_cache import EncoderCache
from engine.vision.prompt_images import LazyPixels
from engine.vision.qwen_image_processing import process_image
from tests.engine.vision.qwen3_vl_checkpoint import IMAGE_CONFIG, hf_greedy, random_image, text_ids, with_images

pytestmark = pytest.mark.timeout(180)
LOOP_THREAD = "test-engine-loop"
WAIT_S = 60.0  # any one reply: far above a step of this tiny model


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _picture(seed: int):
    """(the test's rng, a random picture preprocessed as the engine does, its PNG bytes) from ``seed``."""
    rng = random.Random(seed)
    pic = random_image(torch.Generator().manual_seed(seed), rng.randint(12, 40), rng.randint(12, 40))
    return rng, process_image(pic, IMAGE_CONFIG), _png(pic)


def _offline(path: str) -> LLM:
    """The offline engine, stepped on the test's thread."""
    return LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=48, block_size=4, max_num_batched_tokens=32)


@pytest.fixture
def image_threads(monkeypatch) -> list[tuple[str, str]]:
    """(what, thread name) of every image preprocessing and digest from now on."""
    seen: list[tuple[str, str]] = []
    processed, digest = prompt_images_module._processed, prompt_images_module.digest

    def recording_processed(*args):
        seen.append(("preprocess", threading.current_thread().name))
        return processed(*args)

    def recording_digest(*args):
        seen.append(("digest", threading.current_thread().name))
        return digest(*args)

    monkeypatch.setattr(prompt_images_module, "_processed", recording_processed)
    monkeypatch.setattr(prompt_images_module, "digest", recording_digest)
    return seen


class _LoopOnAThread:
    """An ``EngineLoop`` over real pipes, run on a thread named ``LOOP_THREAD``; the test is the gateway."""

    def __init__(self, engine: LLMEngine, config: EngineConfig) -> None:
        requests_in, self._requests = Pipe(duplex=False)
        self._replies, replies_out = Pipe(duplex=False)
        loop = EngineLoop(engine, config, None, replies_out)
        self.thread = threading.Thread(target=loop.run, args=(requests_in,), name=LOOP_THREAD, daemon=True)
        self.thread.start()
        self.tokens: dict[str, list[int]] = {}  # each request's tokens so far
        self.finished: set[str] = set()
        self.others: list = []  # the replies that are not step outputs, in order
        assert isinstance(self._next(), Ready)

    def send(self, msg) -> None:
        self._requests.send_bytes(encoder.encode(msg))

    def _next(self):
        assert self._replies.poll(WAIT_S), "the engine loop said nothing"
        return from_engine_decoder.decode(self._replies.recv_bytes())

    def until(self, done) -> None:
        """Read replies until ``done()``."""
        while not done():
            msg = self._next()
            if not isinstance(msg, StepOutputs):
                self.others.append(msg)
                continue
            for out in msg.outputs:
                self.tokens.setdefault(out.request_id, []).extend(out.token_ids)
                if out.finished:
                    self.finished.add(out.request_id)

    def reply(self, kind):
        """The first reply of type ``kind`` (read until one comes)."""
        self.until(lambda: any(isinstance(m, kind) for m in self.others))
        return next(m for m in self.others if isinstance(m, kind))

    def stop(self) -> None:
        self.send(Shutdown())
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()


def test_the_engine_loop_steps_while_images_are_prepared_off_it(qwen3_vl_checkpoint, image_threads):
    path, model, seed = qwen3_vl_checkpoint
    rng = random.Random(seed + 7)
    gen = torch.Generator().manual_seed(seed + 7)
    pictures = [random_image(gen, rng.randint(12, 40), rng.randint(12, 40)) for _ in range(2)]
    processed = [process_image(p, IMAGE_CONFIG) for p in pictures]  # what the engine makes of the PNGs (lossless)
    prompt = with_images(rng, processed)
    text = text_ids(rng, rng.randint(5, 12))
    expected = hf_greedy(model, prompt, processed, 4)
    pngs = [_png(p) for p in pictures]
    config = EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, cpu_threads=1,
                          encoder_cache_gb=0.001)
    engine = LLMEngine(config)
    # the worker prepares nothing until the test lets it: the loop must step without those images meanwhile
    gate = threading.Event()
    engine._image_setup()
    worker = engine._image_worker
    engine.prepare_images = lambda prompt, images, salt: worker.submit(
        lambda: gate.wait(WAIT_S) and engine._prepared_images(prompt, list(images), salt))
    loop = _LoopOnAThread(engine, config)
    try:
        alice = RequestPolicy(tenant="alice", cache_salt="salt-of-alice")
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        loop.send(AddRequest("text", text, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)))
        for rid in ("image", "aborted", "released"):
            loop.send(AddRequest(rid, prompt, params, alice, images=pngs))
        loop.until(lambda: len(loop.tokens.get("text", ())) >= 8)
        assert "image" not in loop.tokens and "image" not in engine.scheduler.requests, "added before its images"
        loop.send(AbortRequest("aborted"))
        loop.send(ReleaseRequest("released"))
        assert loop.reply(Released) == Released("released", True)
        assert not image_threads, "preprocessed before the worker was let go"
        gate.set()
        loop.until(lambda: "image" in loop.finished)
        assert loop.tokens["image"] == expected, f"seed={seed}"
        assert len(loop.tokens["text"]) > 8, "the text request did not step on"
        worker.wait(WAIT_S)  # the dropped requests' images: never prepared
        assert "aborted" not in loop.tokens and "released" not in loop.tokens
        assert "aborted" not in engine.scheduler.requests and "released" not in engine.scheduler.requests
        # the same bytes again, same tenant: nothing is preprocessed again (the seen bytes' digest is known, the
        # encoder cache holds their features); another tenant's same bytes are preprocessed and hashed for it
        before = len(image_threads)
        loop.send(AddRequest("again", prompt, params, alice, images=pngs))
        loop.until(lambda: "again" in loop.finished)
        assert loop.tokens["again"] == expected and len(image_threads) == before
        loop.send(AddRequest("bob", prompt, params, RequestPolicy(tenant="bob", cache_salt="salt-of-bob"), images=pngs))
        loop.until(lambda: "bob" in loop.finished)
        assert loop.tokens["bob"] == expected and len(image_threads) == before + 4
        # bytes that are not an image refuse their request, naming the image, from the worker's answer
        loop.send(AddRequest("bad", prompt, params, alice, images=[pngs[0], b"GIF89a garbage"]))
        rejected = loop.reply(RequestRejected)
        assert rejected.request_id == "bad" and "image 1: not an image" in rejected.message, rejected
    finally:
        gate.set()
        loop.stop()
    assert {what for what, _ in image_threads} == {"preprocess", "digest"}
    assert all(name.startswith("image-prep") for _, name in image_threads), image_threads


def test_seen_bytes_the_cache_dropped_are_preprocessed_off_the_stepping_thread(qwen3_vl_checkpoint, image_threads):
    """The offline engine stepped on this thread: an image whose bytes were seen (lazy pixels) and whose features
    the encoder cache no longer holds waits a step for the worker, and is encoded as before."""
    path, model, seed = qwen3_vl_checkpoint
    rng, processed, data = _picture(seed + 8)
    prompts = [with_images(rng, [processed]) for _ in range(2)]
    expected = [hf_greedy(model, p, [processed], 4) for p in prompts]
    llm = _offline(path)
    alice = RequestPolicy(tenant="alice", cache_salt="salt-of-alice")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def run(prompt, images) -> list[int]:
        rid = llm.engine.add_request(prompt, params, policy=alice, images=images)
        tokens = []
        while llm.engine.has_unfinished():
            tokens += [t for out in llm.engine.step() if out.request_id == rid for t in out.token_ids]
        return tokens

    assert run(prompts[0], llm.engine.prepare_images(prompts[0], [data], alice.cache_salt).result()) == expected[0]
    llm.engine.model.encoder_cache = EncoderCache(1 << 20)  # the features gone
    lazy = llm.engine.prompt_images(prompts[1], [data], alice.cache_salt)
    assert isinstance(lazy[0].pixels, LazyPixels) and not lazy[0].pixels.loaded
    assert run(prompts[1], lazy) == expected[1], f"seed={seed}"
    assert lazy[0].pixels.loaded
    assert image_threads == [("preprocess", "image-prep_0"), ("digest", "image-prep_0"),
                             ("preprocess", "image-prep_0")]


def test_pixels_a_scheduled_request_needs_go_before_newcomers_preparation(qwen3_vl_checkpoint):
    """A request whose chunk reached an image with lazy pixels (seen bytes, features the encoder cache dropped)
    has them prepared before the preparation of requests that arrived after it, queued on the worker first: its
    steps do not wait for newcomers. The worker is held on a job while the newcomers queue and the scheduler asks
    for the pixels; once let go, each newcomer's preparation blocks until the test ends, so the request finishes
    only if its pixels went first."""
    path, model, seed = qwen3_vl_checkpoint
    rng, processed, data = _picture(seed + 11)
    prompt = with_images(rng, [processed])
    expected = hf_greedy(model, prompt, [processed], 4)
    llm = _offline(path)
    engine = llm.engine
    alice = RequestPolicy(tenant="alice", cache_salt="salt-of-alice")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.prepare_images(prompt, [data], alice.cache_salt).result(WAIT_S)  # the bytes are seen from now on
    lazy = engine.prompt_images(prompt, [data], alice.cache_salt)
    assert isinstance(lazy[0].pixels, LazyPixels) and not lazy[0].pixels.loaded  # the cache holds no features
    worker = engine._image_worker
    hold, held, newcomers_go = threading.Event(), threading.Event(), threading.Event()
    worker.submit(lambda: held.set() or hold.wait(WAIT_S))
    assert held.wait(WAIT_S)
    prepare = engine._prepared_images
    engine._prepared_images = lambda *args: newcomers_go.wait(WAIT_S) and prepare(*args)
    newcomers = [engine.prepare_images(prompt, [data], f"salt-of-newcomer-{i}") for i in range(2)]
    try:
        rid = engine.add_request(prompt, params, policy=alice, images=lazy)
        tokens = [t for out in engine.step() if out.request_id == rid for t in out.token_ids]
        assert engine.scheduler.images_preparing and not lazy[0].pixels.loaded  # its pixels are asked for
        hold.set()
        deadline = time.monotonic() + WAIT_S / 2
        while engine.has_unfinished() and time.monotonic() < deadline:
            tokens += [t for out in engine.step() if out.request_id == rid for t in out.token_ids]
        assert not engine.has_unfinished(), "the request's pixels waited behind newcomers' preparation"
        assert tokens == expected, f"seed={seed}"
        assert not any(f.done() for f in newcomers)  # still held: they were behind its pixels
    finally:
        hold.set()
        newcomers_go.set()
    assert all(len(f.result(WAIT_S)) == 1 for f in newcomers)


def test_aborted_and_released_requests_images_are_never_prepared(qwen3_vl_checkpoint):
    """Requests queued on the image worker behind another and then aborted (their client gone) or released (sent
    to another replica) are not prepared: their decoding would only delay the requests behind them. The worker is
    held on the first request until both are dropped."""
    path, model, seed = qwen3_vl_checkpoint
    rng = random.Random(seed + 9)
    gen = torch.Generator().manual_seed(seed + 9)
    pic = random_image(gen, rng.randint(12, 40), rng.randint(12, 40))
    processed = process_image(pic, IMAGE_CONFIG)
    prompt = with_images(rng, [processed])
    expected = hf_greedy(model, prompt, [processed], 4)
    config = EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, cpu_threads=1)
    engine = LLMEngine(config)
    gate, started = threading.Event(), []  # each preparation's cache salt (one a request), as it starts

    def prepare(prompt, images, salt):
        started.append(salt)
        gate.wait(WAIT_S)
        return engine._prepared_images(prompt, list(images), salt)

    engine._image_setup()
    worker = engine._image_worker
    engine.prepare_images = lambda prompt, images, salt: worker.submit(prepare, prompt, images, salt)
    loop = _LoopOnAThread(engine, config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for rid in ("first", "aborted", "released"):
            loop.send(AddRequest(rid, prompt, params, RequestPolicy(cache_salt=rid), images=[_png(pic)]))
        loop.send(AbortRequest("aborted"))
        loop.send(ReleaseRequest("released"))
        assert loop.reply(Released) == Released("released", True)  # the abort, sent before, is handled too
        gate.set()
        loop.until(lambda: "first" in loop.finished)
        worker.wait(WAIT_S)
        assert loop.tokens["first"] == expected, f"seed={seed}"
        assert started == ["first"]
    finally:
        gate.set()
        loop.stop()


def test_images_the_engine_cannot_prepare_at_all_refuse_their_request_not_the_engine(qwen3_vl_checkpoint, tmp_path):
    """A checkpoint whose preprocessor_config.json is cut short starts (nothing reads it before an image comes); the
    first request with images then fails to set up the image worker. That refuses the request, naming why, and the
    engine goes on serving: a text request after it still gets its tokens."""
    path, model, seed = qwen3_vl_checkpoint
    broken = tmp_path / "checkpoint"
    broken.mkdir()
    for name in os.listdir(path):
        if name != "preprocessor_config.json":
            os.symlink(os.path.join(path, name), broken / name)
    with open(os.path.join(path, "preprocessor_config.json")) as f:
        whole = f.read()
    (broken / "preprocessor_config.json").write_text(whole[: len(whole) // 2])  # a copy cut short
    rng = random.Random(seed + 10)
    gen = torch.Generator().manual_seed(seed + 10)
    pic = random_image(gen, rng.randint(12, 40), rng.randint(12, 40))
    prompt = with_images(rng, [process_image(pic, IMAGE_CONFIG)])
    text = text_ids(rng, rng.randint(5, 12))
    config = EngineConfig(model=str(broken), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4,
                          cpu_threads=1)
    loop = _LoopOnAThread(LLMEngine(config), config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        loop.send(AddRequest("image", prompt, params, images=[_png(pic)]))
        loop.send(AddRequest("text", text, params))
        rejected = loop.reply(RequestRejected)
        assert rejected.request_id == "image" and rejected.message, rejected
        loop.until(lambda: "text" in loop.finished)
        assert len(loop.tokens["text"]) == 4
    finally:
        loop.stop()
