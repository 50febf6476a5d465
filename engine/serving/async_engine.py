"""The async client of the engine process: what the gateway talks to."""

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

from engine.core.config import EngineConfig
from engine.core.outputs import RequestOutput
from engine.core.request_policy import DEFAULT_POLICY, RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.core.stats import SchedulerStats
from engine.serving.engine_process import run_engine_process
from engine.processes.process_start import start_process
from engine.serving.pipe_writer import PipeWriter
from engine.text.prompts import ChatInput, InputProcessor, Turn, chat_size
from engine.serving.protocol import (
    AbortRequest, AddLora, AddRequest, Alive, Fatal, KVSink, KVSource, KVSourceLost, KVWanted, LoraDone, PairKV, Ready,
    ReleaseRequest, Released, RemoveLora, RequestRejected, Shutdown, StepOutputs, FromEngine, encoder,
    from_engine_decoder,
)
from engine.text.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


SHUTDOWN_WRITE_S = 5.0  # how long a stopping engine's Shutdown may take to be written (a full pipe: a frozen one)


class EngineError(RuntimeError):
    """The engine process failed to start or died.

    ``retryable`` is False when the engine reported that a step failed: one of the requests it was
    running may have caused it, so sending them again could take the fresh engine down too.
    """

    def __init__(self, message: str, retryable: bool = True, detail: str | None = None) -> None:
        """``message`` is for clients (what happened, no internals); ``detail`` adds what the engine reported
        (exception text with peers' addresses, file paths), for the operator's log."""
        super().__init__(message)
        self.retryable = retryable
        self.detail = detail or message


class UnreadStreamError(EngineError):
    """A request ended because its caller stopped reading: ``max_unread_outputs`` outputs waited unread."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the stream was not read: {limit} outputs waited unread, so the request was ended; read "
                         "streams as they arrive", retryable=False)


# Outputs one request may have waiting for its caller. A caller that stops reading (a client that does not read
# its stream: the gateway's write to it waits) has its request aborted in the engine at this bound, so it costs
# neither unbounded gateway memory nor engine time. 256 outputs is seconds of output for a reader that merely lags.
MAX_UNREAD_OUTPUTS = 256


class RequestRejectedError(ValueError):
    """The engine refused a request; the message says why, for the user. ``param``: the request field at fault
    (None: the prompt); ``code``: the API's error code, if one applies."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class AsyncEngine:
    """Runs the engine in its own process and streams per-request deltas to asyncio callers.

    ``generate`` yields ``RequestOutput``s until the request finishes; cancelling the
    consumer (a client that went away) aborts the request in the engine.
    """

    # Prompts up to this many characters are tokenized on the event loop (well under a millisecond);
    # longer ones on a worker thread, so one huge prompt does not hold up every other stream.
    INLINE_PROMPT_CHARS = 2048

    def __init__(self, config: EngineConfig, process_main=run_engine_process,
                 process_env: dict[str, str] | None = None, stall_timeout_s: float | None = None,
                 max_unread_outputs: int = MAX_UNREAD_OUTPUTS) -> None:
        """``process_main(config, requests, replies)`` is the engine process's entry point (importable: the
        process is spawned); tests pass one that wraps ``run_engine_process`` to make a step fail.
        ``process_env``: environment variables set in the engine process only (a data-parallel replica's
        ``CUDA_VISIBLE_DEVICES``). ``stall_timeout_s``: an engine that sends nothing for this long while
        requests wait on it has stopped answering (hung, or a link that went silent): it is treated as
        dead (its process killed, its connection cut) so that the supervisor replaces it. The engine
        reports after every step, so this must exceed the longest step; None: never."""
        self.config = config
        self.stall_timeout_s = stall_timeout_s
        self.max_unread_outputs = max_unread_outputs  # see MAX_UNREAD_OUTPUTS
        self._unread_cut: set[str] = set()  # requests ended for that: the rest of their outputs is dropped
        self._last_progress = 0.0  # when the engine last sent anything, or work arrived at an idle engine
        self._last_heard = 0.0  # when the engine last sent anything (idle engines say so every second)
        self._stalled: str | None = None  # why the watchdog cut the engine off
        self._watchdog_task: asyncio.Task | None = None
        self._process_main = process_main
        self._process_env = process_env or {}
        self.info: Ready | None = None  # None while the engine process starts (or restarts)
        self.inputs: InputProcessor | None = None  # prompt preparation, in this process
        self._input_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="moegate-tokenize")
        self.stats: SchedulerStats | None = None  # the engine's latest step statistics
        self.messages_received = 0  # from the engine process (each woke this process twice)
        self._queues: dict[str, asyncio.Queue] = {}
        self._releases: dict[str, asyncio.Future] = {}  # request id -> the answer to its ReleaseRequest
        self._kv_wanted: dict[str, asyncio.Future] = {}  # request id -> a decode engine's KVWanted hashes
        self._lora_ops: dict[int, asyncio.Future] = {}  # AddLora / RemoveLora op id -> its LoraDone's error
        self._ids = itertools.count()
        self._process = None
        self._requests: PipeWriter | None = None  # our end of the pipe to the engine process
        self._replies = None  # our end of the pipe from it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._send_lock = threading.Lock()
        self.dead: str | None = None  # why the engine is down, for clients (set until a restart has finished)
        self.dead_detail: str | None = None  # the same with what the engine reported, for the operator's log
        self.failure: str | None = None  # what the engine process reported before it exited (a failed step)

    @property
    def pid(self) -> int | None:
        """The engine process's id while one is running (for operators' tools and fault tests)."""
        return self._process.pid if self._process is not None else None

    async def restart(self) -> Ready:
        """Start a fresh engine process after the old one died; requests in flight have already failed.

        ``dead`` stays set (new requests are refused, /health says down) until the new process is ready.
        """
        await self.shutdown()
        self.info = None
        self.stats = None
        ready = await self.start()
        self.dead = self.dead_detail = self.failure = self._stalled = None
        return ready

    async def start(self) -> Ready:
        self._loop = asyncio.get_running_loop()
        requests, replies = await self._open()
        with self._send_lock:
            self._requests = PipeWriter(requests, "moegate-engine-writer")
            self._replies = replies
        try:
            first = await self._loop.run_in_executor(None, self._recv, replies)
            if isinstance(first, Fatal) or first is None:
                raise EngineError(first.message if first else f"{self.describe()} exited during start-up")
            if self.inputs is None:  # the tokenizer is the same after a restart
                tokenizer_dir = self.config.tokenizer or (None if self.config.random_weights else self.config.model)
                tokenizer = (await self._loop.run_in_executor(None, load_tokenizer, tokenizer_dir)
                             if tokenizer_dir else None)
                self.inputs = InputProcessor(tokenizer, first.vocab_size, first.max_model_len)
            if self._replies is not replies:  # shut down meanwhile (another replica of its group failed to start)
                raise EngineError(f"{self.describe()} was stopped during start-up")
        except BaseException:  # failed, or cancelled (the gateway is stopping): end the engine now, not once it is
            self._cut_off(replies)  # up (an engine split over ranks may wait minutes for a missing one)
            await self.shutdown()
            raise
        threading.Thread(target=self._reader, args=(replies,), name="moegate-engine-reader", daemon=True).start()
        if self.stall_timeout_s is not None:
            # Referenced, or the loop could drop the task before it ends.
            self._watchdog_task = self._loop.create_task(self._watchdog(replies), name="moegate-engine-watchdog")
        self._last_heard = time.monotonic()
        self.info = first
        return first

    async def prepare(self, prompt: str | Sequence[int] | None = None,
                      messages: Sequence[Turn] | ChatInput | None = None, add_generation_prompt: bool = True) -> list[int]:
        """Checked prompt token ids for ``generate``; ``engine.text.prompts.InvalidPrompt`` (a 400) if it cannot be served."""
        if self.inputs is None:
            raise EngineError(self.dead or "the engine is starting")
        size = chat_size(messages) if messages is not None else len(prompt or "")
        if size <= self.INLINE_PROMPT_CHARS:
            return self.inputs.prepare(prompt, messages, add_generation_prompt)
        return await self._loop.run_in_executor(self._input_pool, self.inputs.prepare, prompt, messages,
                                                add_generation_prompt)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of token ids; ``InvalidPrompt`` (a 400 naming ``tokens``) for ids outside the vocabulary."""
        if self.inputs is None:
            raise EngineError(self.dead or "the engine is starting")
        if len(token_ids) <= self.INLINE_PROMPT_CHARS:
            return self.inputs.decode(token_ids)
        return await self._loop.run_in_executor(self._input_pool, self.inputs.decode, token_ids)

    def chat_template(self) -> str | None:
        """The checkpoint's chat template text (None without one, or before the engine has started)."""
        return self.inputs.chat_template if self.inputs is not None else None

    @staticmethod
    def _recv(conn: Connection):
        """The next message on ``conn``; None once it has closed."""
        try:
            return from_engine_decoder.decode(conn.recv_bytes())
        except (EOFError, OSError):
            return None

    def _reader(self, conn: Connection) -> None:
        """Dispatch what arrives on ``conn`` (this engine process's; a restart makes a new one and a new reader)."""
        while True:
            try:
                msg = from_engine_decoder.decode(conn.recv_bytes())
            except (EOFError, OSError):
                self._loop.call_soon_threadsafe(self._fail_all, conn)
                return
            self._loop.call_soon_threadsafe(self._dispatch, msg)

    async def _watchdog(self, conn) -> None:
        """Cut off an engine that stopped answering (see ``stall_timeout_s``); ends with this connection."""
        while conn is self._replies and not self.dead:
            await asyncio.sleep(min(1.0, self.stall_timeout_s / 4))
            silent = time.monotonic() - self._last_progress
            if self._queues and silent > self.stall_timeout_s and conn is self._replies and not self.dead:
                self._stalled = f"{self.describe()} stopped answering ({silent:.0f} s without a reply)"
                logger.error("%s; cutting it off", self._stalled)
                self._cut_off(conn)
                return

    def _cut_off(self, replies: Connection) -> None:
        """Make the reader of ``replies`` see its end (it then fails the waiting requests)."""
        if self._process is not None:
            self._process.kill()

    def silent_s(self) -> float:
        """Seconds since the running engine last sent anything (0 while it is not running)."""
        if self.info is None or self.dead:
            return 0.0
        return time.monotonic() - self._last_heard

    def _dispatch(self, msg: FromEngine) -> None:
        """Hand a message of the engine process to the handler of its type (``DISPATCH``), on the event loop."""
        self._last_heard = time.monotonic()
        self.messages_received += 1
        if not isinstance(msg, Alive):  # the process runs; whether its steps progress, the watchdog judges by the rest
            self._last_progress = self._last_heard
        DISPATCH[type(msg)](self, msg)

    def _on_step_outputs(self, msg: StepOutputs) -> None:
        if msg.stats is not None:
            self.stats = msg.stats
        for delta in msg.outputs:
            queue = self._queues.get(delta.request_id)
            if queue is not None and delta.request_id not in self._unread_cut:
                if queue.qsize() >= self.max_unread_outputs:
                    self._end_unread(delta.request_id, queue)
                else:
                    queue.put_nowait(delta)

    def _on_kv_wanted(self, msg: KVWanted) -> None:
        answer = self._kv_wanted.pop(msg.request_id, None)
        if answer is not None and not answer.done():
            answer.set_result(msg.block_hashes)

    def _on_released(self, msg: Released) -> None:
        answer = self._releases.pop(msg.request_id, None)
        if answer is not None and not answer.done():
            answer.set_result(msg.released)

    def _on_lora_done(self, msg: LoraDone) -> None:
        answer = self._lora_ops.pop(msg.op_id, None)
        if answer is not None and not answer.done():
            answer.set_result(msg.error)

    def _on_request_rejected(self, msg: RequestRejected) -> None:
        queue = self._queues.get(msg.request_id)
        if queue is not None:
            queue.put_nowait(RequestRejectedError(msg.message, msg.param, msg.code))

    def _on_fatal(self, msg: Fatal) -> None:
        self.failure = msg.message  # the process exits next; _fail_all tells the waiting requests why

    def _on_nothing_new(self, msg: Alive | Ready) -> None:
        """A liveness beat (counted as heard above), or a ``Ready`` once ``start`` has read the first one."""

    def _end_unread(self, request_id: str, queue: asyncio.Queue) -> None:
        """Abort a request whose caller stopped reading; the caller finds the reason after what it has not read."""
        self._unread_cut.add(request_id)
        queue.put_nowait(UnreadStreamError(self.max_unread_outputs))
        logger.warning("request %s: %d outputs unread; aborting it", request_id, self.max_unread_outputs)
        try:
            self._send(AbortRequest(request_id))
        except EngineError:  # the engine is gone: nothing runs any more
            pass

    def _fail_all(self, conn) -> None:
        if conn is not self._replies:
            return  # an orderly shutdown (or a restart) closed this pipe
        # Clients are told what happened, not where: the engine's address and report go to the log.
        if self._stalled:
            error = EngineError("the engine stopped answering", detail=self._stalled)
        elif self.failure:
            message = "the engine failed while running this request"
            error = EngineError(message, retryable=False, detail=f"{message} ({self.failure})")
        else:
            error = EngineError("the engine stopped", detail=f"{self.describe()} stopped")
        # The requests in flight are told their step failed; /health and later requests, that the engine did.
        self.dead = "the engine failed" if self.failure and not self._stalled else str(error)
        self.dead_detail = error.detail
        for queue in self._queues.values():
            queue.put_nowait(error)
        self._answer_releases()

    def cut_requests(self, why: str) -> int:
        """End every request in flight here with the error of an engine that stopped (``EngineError``, retryable:
        one that has produced no output may run elsewhere), its process left running; how many. For a replica
        leaving the fleet whose drain ran out of time (``gateway.replica_scaling``); ``why`` goes to the log."""
        error = EngineError("the engine stopped", detail=f"{self.describe()}: {why}")
        for queue in self._queues.values():
            queue.put_nowait(error)
        return len(self._queues)

    def _answer_releases(self) -> None:
        """An engine that is gone releases nothing: its requests fail (and fail over) through their streams; it
        wants no KV either."""
        releases, self._releases = self._releases, {}
        for answer in releases.values():
            if not answer.done():
                answer.set_result(False)
        wanted, self._kv_wanted = self._kv_wanted, {}
        for answer in wanted.values():
            if not answer.done():
                answer.set_result([])
        lora_ops, self._lora_ops = self._lora_ops, {}
        for answer in lora_ops.values():
            if not answer.done():
                answer.set_exception(EngineError("the engine stopped", detail=f"{self.describe()} stopped"))

    def kv_wanted(self, request_id: str) -> asyncio.Future:
        """The block hashes a decode engine will answer for ``request_id``'s ``KVSource`` (call before
        ``generate``); [] if it prefills the prompt itself or is gone."""
        answer = self._kv_wanted[request_id] = self._loop.create_future()
        return answer

    def pair_kv(self, pair_id: str, rank: int, address: str) -> None:
        """Join a prefill-decode pair's transfer group (``PairKV``); EngineError if the engine is gone."""
        self._send(PairKV(pair_id, rank, address))

    def kv_source_lost(self, request_id: str) -> None:
        """Tell a decode engine that the prefill engine computing this request's prompt is gone."""
        with contextlib.suppress(EngineError):
            self._send(KVSourceLost(request_id))

    def _send(self, msg) -> None:
        """Queue ``msg`` for the engine (written by the pipe's own thread: ``engine.serving.pipe_writer``); a
        write that fails means the engine is gone, which its replies' end tells the waiting requests."""
        with self._send_lock:
            if self._requests is None:
                raise EngineError("the engine is stopped", detail=f"{self.describe()} is stopped")
            self._requests.send(encoder.encode(msg))

    async def generate(
        self,
        prompt: list[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        policy: RequestPolicy = DEFAULT_POLICY,
        stream: bool = True,
        kv_source: KVSource | None = None,
        kv_sink: KVSink | None = None,
        images: Sequence[bytes] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's deltas; RequestRejectedError if the engine refuses it, EngineError if it died.

        ``sampling_params.n`` > 1: the outputs of its n choices (``RequestOutput.index``), interleaved as the
        engine produces them; the stream ends when every choice has finished.

        ``prompt``: token ids from ``prepare``. ``policy``: how the engine's scheduler treats it, sent as is.

        ``stream=False``: a single delta when the request finishes, with the whole output in it.

        ``kv_source`` / ``kv_sink``: disaggregated serving (``gateway.disaggregation``): a decode engine's
        request whose prompt KV comes from a prefill engine, or a prefill engine's request whose KV goes to one.

        ``images``: encoded images for a model that reads them, one per run of image placeholder tokens in the
        prompt (``LLMEngine.add_request``); one that is not an image, or does not fit, refuses the request.
        """
        if self.dead:
            raise EngineError(self.dead)
        request_id = request_id or f"req-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        if not self._queues:  # an idle engine's silence so far is not a stall
            self._last_progress = time.monotonic()
        self._queues[request_id] = queue
        finished = False
        unfinished = sampling_params.n  # choices still running: the request ends with the last of them
        try:
            self._send(AddRequest(request_id, prompt, sampling_params, policy, stream, kv_source, kv_sink,
                                  [bytes(image) for image in images]))
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                unfinished -= item.finished
                finished = unfinished == 0
                yield item
                if finished:
                    return
        finally:
            del self._queues[request_id]
            self._unread_cut.discard(request_id)
            if not finished and not self.dead:
                self._send(AbortRequest(request_id))

    async def release(self, request_id: str) -> bool:
        """Ask the engine to drop a request that has not started (``LLMEngine.release``); True if it did.

        After True the request's stream gets nothing more: close it (the abort it sends is ignored). After
        False the request goes on as before."""
        if self.dead or request_id not in self._queues:
            return False
        answer = self._releases.get(request_id)
        if answer is None:
            answer = self._releases[request_id] = self._loop.create_future()
            try:
                self._send(ReleaseRequest(request_id))
            except EngineError:
                self._releases.pop(request_id, None)
                return False
        return await answer

    async def add_lora(self, name: str, path: str) -> None:
        """Have the engine serve the LoRA adapter at ``path`` as ``name`` (the same pair again: nothing changes).
        ValueError with the engine's one line if it cannot (a malformed directory, a rank above its
        ``max_lora_rank``, an engine that cannot add adapters while it runs); EngineError if it is gone."""
        await self._lora_op(lambda op_id: AddLora(op_id, name, path))

    async def remove_lora(self, name: str) -> None:
        """Stop serving adapter ``name``; ValueError (one line) if the engine cannot, EngineError if it is gone."""
        await self._lora_op(lambda op_id: RemoveLora(op_id, name))

    async def _lora_op(self, message) -> None:
        if self.dead or self._loop is None:
            raise EngineError(self.dead or "the engine is starting")
        op_id = next(self._ids)
        answer = self._lora_ops[op_id] = self._loop.create_future()
        try:
            self._send(message(op_id))
        except EngineError:
            self._lora_ops.pop(op_id, None)
            raise
        error = await answer
        if error is not None:
            raise ValueError(error)

    async def shutdown(self) -> None:
        # Under the send lock: a message another thread is queueing goes before Shutdown, and none after it (a
        # later ``_send`` sees no pipe: EngineError).
        with self._send_lock:
            requests, replies = self._requests, self._replies
            if requests is None:
                return
            self._requests = self._replies = None  # the reader's EOF is now an orderly stop, not a death
            requests.send(encoder.encode(Shutdown()))
            requests.finish()
        self._answer_releases()
        # Written before the engine is waited for (or cut off); a frozen engine's pipe is left to its end.
        await self._loop.run_in_executor(None, requests.join, SHUTDOWN_WRITE_S)
        await self._close(replies)
        requests.close()  # now, or by the writer thread once its write in progress fails (the engine is gone)
        if replies is not requests.conn:  # one connection both ways (an engine elsewhere): closed by the writer
            replies.close()

    # -- the transport: a local engine process (subclasses reach an engine elsewhere) --

    def describe(self) -> str:
        """The engine, for messages."""
        return "the engine process"

    async def _open(self) -> tuple[Connection, Connection]:
        """Start the engine process; our ends of (the requests pipe, the replies pipe)."""
        # Two one-way pipes, not one duplex socket: on a Unix socket pair the engine reading our requests
        # wakes our reader thread blocked on the same socket (a wakeup per request read, ten per message
        # received, measured), and every wakeup takes a core the engine's threads were using.
        requests_in, requests_out = multiprocessing.Pipe(duplex=False)
        replies_in, replies_out = multiprocessing.Pipe(duplex=False)
        # No inherited threads or CUDA state (engine.processes.process_start).
        self._process = start_process(self._process_main, (self.config, requests_in, replies_out), "moegate-engine",
                                      self._process_env)
        requests_in.close()
        replies_out.close()  # so the reader sees EOF when the engine process dies
        return requests_out, replies_in

    async def _close(self, replies: Connection) -> None:
        """After Shutdown was sent: wait for the process to exit (10 s), then kill it."""
        process, self._process = self._process, None
        if process is None:
            return
        await self._loop.run_in_executor(None, process.join, 10)
        if process.is_alive():
            process.kill()
            await self._loop.run_in_executor(None, process.join, 5)


# The handler of each message the engine process sends (``FromEngine``): one per type, checked by the tests.
DISPATCH: dict[type, Callable[[AsyncEngine, FromEngine], None]] = {
    StepOutputs: AsyncEngine._on_step_outputs,
    KVWanted: AsyncEngine._on_kv_wanted,
    Released: AsyncEngine._on_released,
    LoraDone: AsyncEngine._on_lora_done,
    RequestRejected: AsyncEngine._on_request_rejected,
    Fatal: AsyncEngine._on_fatal,
    Alive: AsyncEngine._on_nothing_new,
    Ready: AsyncEngine._on_nothing_new,
}
