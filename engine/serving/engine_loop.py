"""The engine process's loop: every message the gateway sent, each to the handler of its type (``HANDLERS``),
then a step while there is work, and the step's outputs back.

Blocks on the requests' pipe when idle; an idle engine still says it is alive (``HEARTBEAT_S``), and a prefill or
decode engine says so from a thread of its own (``LIVENESS_S``).
"""

import logging
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import msgspec

from engine.core.config import EngineConfig
from engine.serving.grammar_builds import GrammarBuilds
from engine.serving.image_preparation import ImagePreparation
from engine.serving.protocol import (
    AbortRequest, AddLora, AddRequest, Alive, Fatal, KVSourceLost, KVWanted, LoraDone, PairKV, Ready, ReleaseRequest,
    Released, RemoveLora, RequestRejected, Shutdown, StepOutputs, ToEngine, encoder, to_engine_decoder,
)
from engine.serving.step_reports import StepReports

if TYPE_CHECKING:  # imported in the engine process only: the gateway imports this module without torch
    from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

PEER_POLL_S = 0.005  # how long an idle engine with data-parallel peers waits for a request before asking them
RANK_CHECK_S = 1.0  # how often an idle engine with ranks on this node checks that they are alive
# An idle engine says it is alive this often (statistics, no outputs): the gateway stops routing to a replica
# it has not heard from for a few seconds (a frozen process), long before its stall timeout declares it dead.
HEARTBEAT_S = 1.0
# A prefill or decode engine also says so from a thread of its own, this often, busy or not: the gateway takes
# a prefill engine silent for about a second as hung (a frozen process) and has its requests' prompts computed
# elsewhere (gateway.disaggregation), while a long step, during which the thread still speaks, is no silence.
LIVENESS_S = 0.25
BUILD_POLL_S = 0.005  # how often an idle engine looks whether a schema's matcher is built (or images prepared)


class EngineLoop:
    """One engine's loop over ``replies`` (``run`` reads the requests' pipe). ``handoff`` (a ``KVHandoff``): this
    engine prefills for, or decodes after, other engines; ``threads``: the serving threads' policy, if any."""

    def __init__(self, engine: "LLMEngine", config: EngineConfig, threads, replies: Connection, handoff=None) -> None:
        self.engine, self.config, self.threads, self.replies, self.handoff = engine, config, threads, replies, handoff
        self.reports = StepReports()
        self.builds = GrammarBuilds(engine.runner.sampler.grammars)  # requests waiting for their schema's matcher
        self.images = ImagePreparation(engine)  # requests waiting for their images, prepared off this loop
        self.idle_change = False  # an abort freed blocks while idle: report the new state without a step
        self.busy = False  # this engine, or one of its peers, stepped last time round
        self.stopped = False  # Shutdown came: the engine is closed
        # Data-parallel engines sharing experts step together: an idle one asks its peers every few ms. An engine
        # with ranks of its own on this node looks at them every second while idle, so one that died is replaced
        # before a request finds out.
        idle_wait = PEER_POLL_S if engine.runner.steps_with_peers else (RANK_CHECK_S if engine.ranks else HEARTBEAT_S)
        self.idle_wait = min(idle_wait, HEARTBEAT_S)
        self.liveness: _Liveness | None = None
        self.last_sent = time.monotonic()  # by this loop (the idle heartbeat carries statistics)

    def run(self, requests: Connection) -> None:
        """Say ``Ready``, then serve: returns on Shutdown (the engine closed) or after reporting a failure
        (``Fatal``)."""
        engine, config, handoff = self.engine, self.config, self.handoff
        mc = engine.model_config
        self.replies.send_bytes(encoder.encode(Ready(config.model, mc.architecture, engine.max_model_len,
                                                     mc.vocab_size, engine.tokenizer is not None, config.role,
                                                     config.block_size, handoff.address if handoff else None)))
        self.last_sent = time.monotonic()
        self.liveness = _Liveness(self.replies) if handoff is not None else None
        while True:
            # Drain every pending message; block for one only when there is nothing to step.
            while requests.poll(self._poll_timeout()):
                try:
                    msg = to_engine_decoder.decode(requests.recv_bytes())
                except msgspec.DecodeError as e:  # not a message of this version: say so and stop, never guess
                    self.send(Fatal(f"the engine received a message it does not understand ({e})"))
                    return
                HANDLERS[type(msg)](self, msg)
                if self.stopped:
                    return
            if not self._step():
                return

    def _poll_timeout(self) -> float:
        if self.busy or self.engine.has_unfinished() or self.idle_change:
            return 0
        if self.builds or self.images or (self.handoff and self.handoff.pending):
            return min(self.idle_wait, BUILD_POLL_S)
        return self.idle_wait

    def send(self, message) -> None:
        if self.liveness is not None:
            self.liveness.send(message)
        else:
            self.replies.send_bytes(encoder.encode(message))
        self.last_sent = time.monotonic()

    # ---- a handler per message (HANDLERS) ------------------------------------
    def _shutdown(self, msg: Shutdown) -> None:
        try:
            self.engine.close()  # an engine split over ranks tells them to stop, and they exit now
        except Exception as e:  # a rank already gone: the caller's abrupt close ends the rest
            logger.warning("could not stop the engine's ranks cleanly: %s", e)
        self.stopped = True

    def _abort(self, msg: AbortRequest) -> None:
        if self.handoff is not None and self.handoff.abort(msg.request_id):
            self.idle_change = True  # parked for its KV: its blocks are free again
        self.builds.drop(msg.request_id)
        self.images.drop(msg.request_id)
        self.reports.forget(msg.request_id)
        self.idle_change |= self.engine.abort(msg.request_id) is not None

    def _release(self, msg: ReleaseRequest) -> None:
        # one still waiting for its images has not started either
        released = self.images.release(msg.request_id) or self.engine.release(msg.request_id)
        if released:
            self.reports.forget(msg.request_id)
            self.idle_change = True
        self.send(Released(msg.request_id, released))

    def _add_lora(self, msg: AddLora) -> None:
        self.send(lora_change(msg.op_id, msg.name, lambda: self.engine.add_lora(msg.name, msg.path)))

    def _remove_lora(self, msg: RemoveLora) -> None:
        self.send(lora_change(msg.op_id, msg.name, lambda: self.engine.remove_lora(msg.name)))

    def _pair_kv(self, msg: PairKV) -> None:
        if self.handoff is not None:
            self.handoff.pair(msg)

    def _kv_source_lost(self, msg: KVSourceLost) -> None:
        if self.handoff is not None:
            self.handoff.source_lost(msg.request_id, self.add)

    def _add_request(self, msg: AddRequest) -> None:
        if msg.kv_source is not None and self.handoff is not None:
            wanted = self.handoff.park(msg)
            self.send(KVWanted(msg.request_id, wanted))
            if wanted:
                return  # it joins the scheduler when its blocks arrive (or their transfer fails)
        self.add(msg)

    # ---- requests and steps --------------------------------------------------
    def add(self, msg: AddRequest) -> None:
        """Add a request now, or once its images are prepared and its schema's matcher is built."""
        if not self.images.hold(msg):
            self._add_prepared(msg)

    def _add_prepared(self, msg: AddRequest) -> None:
        """Add a request whose images are ready, now or once its schema's matcher is built."""
        if not self.builds.hold(msg):
            self._add(msg)

    def _add(self, msg: AddRequest, error: BaseException | None = None) -> None:
        """Add one request to the engine, or answer why not (``error``: its images could not be prepared, or its
        grammar could not be built)."""
        images = self.images.images_of(msg)
        try:
            if error is not None:
                raise error
            self.engine.add_request(msg.prompt, msg.sampling_params, msg.request_id, msg.policy, images=images)
            self.reports.add(msg.request_id, msg.stream, msg.policy.background, msg.sampling_params.n)
            if msg.kv_sink is not None and self.handoff is not None:
                self.handoff.expect_sink(msg)
        except Exception as e:  # whatever one request brings fails that request, never the engine
            if not isinstance(e, ValueError):  # a bug: the type at the default level (the message may
                # quote the prompt), the whole traceback at debug
                logger.error("request %s could not be added: %s", msg.request_id, type(e).__name__)
                logger.debug("request %s could not be added", msg.request_id, exc_info=True)
            self.send(RequestRejected(msg.request_id, str(e)))

    def _step(self) -> bool:
        """Admit what became ready, then step if this engine or a peer has work (or report an idle change);
        False once a failure was reported (the loop ends)."""
        engine, handoff = self.engine, self.handoff
        for msg, error in self.images.ready():
            self._add(msg, error) if error is not None else self._add_prepared(msg)
        for msg, error in self.builds.ready():
            self._add(msg, error)
        if handoff is not None:
            self.idle_change |= handoff.poll(self.add)
        try:
            if (gone := engine.ranks and engine.ranks.exited_rank()) is not None:
                raise RuntimeError(gone)
            self.busy = engine.step_needed()
        except Exception as e:  # a rank or a peer engine is gone: the group restarts as a whole
            self.send(Fatal(f"{type(e).__name__}: {e}"))
            return False
        if not self.busy:
            if self.idle_change or time.monotonic() - self.last_sent >= HEARTBEAT_S:
                stats = engine.scheduler.stats()
                self.send(StepOutputs([], handoff.fill(stats) if handoff else stats))
                self.idle_change = False
            return True
        if self.threads is not None:
            self.threads.before_step(engine.scheduler.foreground_recent())
        try:
            outputs = engine.step()
        except Exception as e:  # not one request's fault: say why, and let the parent start a fresh engine
            logger.exception("engine step failed")
            self.send(Fatal(f"a step failed: {type(e).__name__}: {e}"))
            return False
        if rejected := engine.take_rejected():  # their adapter could not be read: refused, naming model
            outputs = [o for o in outputs if o.request_id not in rejected]
            for request_id, why in rejected.items():
                engine.abort(request_id)  # its other choices (n > 1), if any run
                self.reports.forget(request_id)
                self.send(RequestRejected(request_id, why, param="model", code="adapter_unavailable"))
        if handoff is not None:
            handoff.after_step(outputs)
        stats = handoff.fill(engine.stats()) if handoff else engine.stats()
        if (message := self.reports.after_step(outputs, stats, engine.has_unfinished())) is not None:
            self.send(message)
        return True


# The handler of each message the gateway sends (``ToEngine``): one per type, checked by the tests.
HANDLERS: dict[type, Callable[[EngineLoop, ToEngine], None]] = {
    AddRequest: EngineLoop._add_request,
    AbortRequest: EngineLoop._abort,
    ReleaseRequest: EngineLoop._release,
    PairKV: EngineLoop._pair_kv,
    KVSourceLost: EngineLoop._kv_source_lost,
    AddLora: EngineLoop._add_lora,
    RemoveLora: EngineLoop._remove_lora,
    Shutdown: EngineLoop._shutdown,
}


def lora_change(op_id: int, name: str, change: Callable[[], None]) -> LoraDone:
    """The answer to adding or removing adapter ``name`` (``change`` does it): what goes wrong is the answer's one
    line, never the engine's end."""
    try:
        change()
    except Exception as e:  # a bad directory (ValueError) or a bug: that change fails, the engine goes on
        if not isinstance(e, ValueError):
            logger.exception("adapter %r could not be changed", name)
        return LoraDone(op_id, " ".join(f"{e}".split()) or type(e).__name__)
    return LoraDone(op_id)


class _Liveness:
    """A prefill or decode engine's sends, and its liveness thread (see ``LIVENESS_S``): an empty message
    whenever nothing went out for that long, busy or not; it ends with the pipe."""

    def __init__(self, replies: Connection) -> None:
        self.replies = replies
        self.lock = threading.Lock()  # one message on the pipe at a time
        self.last = time.monotonic()
        threading.Thread(target=self._run, name="moegate-liveness", daemon=True).start()

    def send(self, message) -> None:
        data = encoder.encode(message)
        with self.lock:
            self.replies.send_bytes(data)
            self.last = time.monotonic()

    def _run(self) -> None:
        while True:
            time.sleep(LIVENESS_S)
            if time.monotonic() - self.last >= LIVENESS_S:
                try:
                    self.send(Alive())
                except (OSError, ValueError):  # the pipe is closed: the engine is stopping
                    return
