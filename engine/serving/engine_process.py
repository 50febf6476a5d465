"""The engine's own process: receives requests over a pipe, steps the engine, sends deltas back."""

import gc
import logging
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from engine.core.config import EngineConfig
from engine.serving.grammar_builds import GrammarBuilds
from engine.processes.parent_watch import exit_with_parent
from engine.serving.protocol import (
    AbortRequest, AddLora, AddRequest, Alive, Fatal, KVSourceLost, KVWanted, LoraDone, PairKV, Ready, ReleaseRequest,
    Released, RemoveLora, RequestRejected, Shutdown, StepOutputs, encoder, to_engine_decoder,
)
from engine.serving.serving_threads import serving_threads
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
BUILD_POLL_S = 0.005  # how often an idle engine looks whether a schema's matcher is built


def run_engine_process(config: EngineConfig, requests: Connection, replies: Connection) -> None:
    """Entry point of the engine process: reads ``requests``, writes ``replies`` (one-way pipes).

    Blocks on ``requests`` when idle, steps while there is work.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    exit_with_parent()  # a gateway (or engine server) killed while this engine starts or steps takes it along
    # A terminal's Ctrl-C reaches every process of the group: the gateway drains its requests, then stops this one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from engine.llm_engine import LLMEngine

    try:
        threads = serving_threads(config)
        engine = LLMEngine(config)
        freeze_startup_heap()
        handoff = None
        if config.role != "both":  # a prefill or decode engine of a disaggregated deployment
            from engine.serving.kv_handoff import KVHandoff

            handoff = KVHandoff(engine, config)
    except Exception as e:  # reported to the parent, which prints one line and exits
        replies.send_bytes(encoder.encode(Fatal(f"{type(e).__name__}: {e}")))
        return
    try:
        _serve(engine, config, threads, requests, replies, handoff)
    finally:  # a failed step, a gone gateway: end this engine's other ranks now, not at their timeout
        if handoff is not None:
            handoff.close()
        engine.close(abrupt=True)
        gc.unfreeze()  # frozen objects are never finalized at exit (nanobind then reports leaks)


def freeze_startup_heap() -> None:
    """Collect what the engine's start threw away, then move everything left out of the garbage collector's reach.

    The engine process holds some 400,000 tracked objects once the model is built (torch, transformers, the
    model's modules); a full collection walks all of them, and one that fires inside a step holds that step
    (measured: ~580 ms for a full collection on a loaded 2-core machine, a 52 ms collection inside one decode
    step of the LoRA loading benchmark). Frozen, the collections that still run walk only what serving makes.
    As vLLM does after its engine starts; unfrozen when the engine ends.
    """
    gc.collect()
    gc.freeze()


def _serve(engine, config: EngineConfig, threads, requests: Connection, replies: Connection, handoff=None) -> None:
    """The engine loop: returns on Shutdown (the engine closed) or after reporting a failure (Fatal).

    ``handoff`` (a ``KVHandoff``): this engine prefills for, or decodes after, other engines."""
    mc = engine.model_config
    replies.send_bytes(encoder.encode(Ready(config.model, mc.architecture, engine.max_model_len, mc.vocab_size,
                                            engine.tokenizer is not None, config.role, config.block_size,
                                            handoff.address if handoff else None)))

    idle_change = False  # an abort freed blocks while idle: report the new state without a step
    reports = StepReports()
    # Data-parallel engines sharing experts step together: an idle one asks its peers every few ms. An engine
    # with ranks of its own on this node looks at them every second while idle, so one that died is replaced
    # before a request finds out.
    idle_wait = PEER_POLL_S if engine.runner.steps_with_peers else (RANK_CHECK_S if engine.ranks else HEARTBEAT_S)
    idle_wait = min(idle_wait, HEARTBEAT_S)
    last_sent = time.monotonic()  # by this loop (the idle heartbeat carries statistics)
    liveness = _Liveness(replies) if handoff is not None else None

    def send(message) -> None:
        nonlocal last_sent
        if liveness is not None:
            liveness.send(message)
        else:
            replies.send_bytes(encoder.encode(message))
        last_sent = time.monotonic()

    busy = False  # this engine, or one of its peers, stepped last time round
    builds = GrammarBuilds(engine.runner.sampler.grammars)  # requests waiting for their schema's matcher

    def add(msg: AddRequest) -> None:
        if not builds.hold(msg):
            _add(engine, msg, reports, send, handoff=handoff)

    def stats():
        return handoff.fill(engine.stats()) if handoff else engine.stats()

    while True:
        # Drain every pending message; block for one only when there is nothing to step.
        while requests.poll(0 if busy or engine.has_unfinished() or idle_change else
                            (min(idle_wait, BUILD_POLL_S) if builds or (handoff and handoff.pending) else idle_wait)):
            msg = to_engine_decoder.decode(requests.recv_bytes())
            if isinstance(msg, Shutdown):
                try:
                    engine.close()  # an engine split over ranks tells them to stop, and they exit now
                except Exception as e:  # a rank already gone: the caller's abrupt close ends the rest
                    logger.warning("could not stop the engine's ranks cleanly: %s", e)
                return
            if isinstance(msg, AbortRequest):
                if handoff is not None and handoff.abort(msg.request_id):
                    idle_change = True  # parked for its KV: its blocks are free again
                builds.drop(msg.request_id)
                reports.forget(msg.request_id)
                idle_change |= engine.abort(msg.request_id) is not None
            elif isinstance(msg, ReleaseRequest):
                released = engine.release(msg.request_id)
                if released:
                    reports.forget(msg.request_id)
                    idle_change = True
                send(Released(msg.request_id, released))
            elif isinstance(msg, (AddLora, RemoveLora)):
                send(_change_loras(engine, msg))
            elif isinstance(msg, PairKV):
                if handoff is not None:
                    handoff.pair(msg)
            elif isinstance(msg, KVSourceLost):
                if handoff is not None:
                    handoff.source_lost(msg.request_id, add)
            elif isinstance(msg, AddRequest):
                if msg.kv_source is not None and handoff is not None:
                    wanted = handoff.park(msg)
                    send(KVWanted(msg.request_id, wanted))
                    if wanted:
                        continue  # it joins the scheduler when its blocks arrive (or their transfer fails)
                add(msg)
        for msg, error in builds.ready():
            _add(engine, msg, reports, send, error, handoff)
        if handoff is not None:
            idle_change |= handoff.poll(add)
        try:
            if (gone := engine.ranks and engine.ranks.exited_rank()) is not None:
                raise RuntimeError(gone)
            busy = engine.step_needed()
        except Exception as e:  # a rank or a peer engine is gone: the group restarts as a whole
            send(Fatal(f"{type(e).__name__}: {e}"))
            return
        if not busy:
            if idle_change or time.monotonic() - last_sent >= HEARTBEAT_S:
                send(StepOutputs([], handoff.fill(engine.scheduler.stats()) if handoff else engine.scheduler.stats()))
                idle_change = False
            continue
        if threads is not None:
            threads.before_step(engine.scheduler.foreground_recent())
        try:
            outputs = engine.step()
        except Exception as e:  # not one request's fault: say why, and let the parent start a fresh engine
            logger.exception("engine step failed")
            send(Fatal(f"a step failed: {type(e).__name__}: {e}"))
            return
        if rejected := engine.take_rejected():  # their adapter could not be read: refused, naming model
            outputs = [o for o in outputs if o.request_id not in rejected]
            for request_id, why in rejected.items():
                engine.abort(request_id)  # its other choices (n > 1), if any run
                reports.forget(request_id)
                send(RequestRejected(request_id, why, param="model", code="adapter_unavailable"))
        if handoff is not None:
            handoff.after_step(outputs)
        message = reports.after_step(outputs, stats(), engine.has_unfinished())
        if message is not None:
            send(message)


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


def _change_loras(engine: "LLMEngine", msg: AddLora | RemoveLora) -> LoraDone:
    """Add or remove one adapter; what goes wrong is the answer's one line, never the engine's end."""
    try:
        if isinstance(msg, AddLora):
            engine.add_lora(msg.name, msg.path)
        else:
            engine.remove_lora(msg.name)
    except Exception as e:  # a bad directory (ValueError) or a bug: that change fails, the engine goes on
        if not isinstance(e, ValueError):
            logger.exception("adapter %r could not be changed", msg.name)
        return LoraDone(msg.op_id, " ".join(f"{e}".split()) or type(e).__name__)
    return LoraDone(msg.op_id)


def _add(engine, msg: AddRequest, reports: StepReports, send, error: BaseException | None = None,
         handoff=None) -> None:
    """Add one request to the engine, or answer why not (``error``: its grammar could not be built)."""
    try:
        if error is not None:
            raise error
        engine.add_request(msg.prompt, msg.sampling_params, msg.request_id, msg.policy, images=msg.images)
        reports.add(msg.request_id, msg.stream, msg.policy.background, msg.sampling_params.n)
        if msg.kv_sink is not None and handoff is not None:
            handoff.expect_sink(msg)
    except Exception as e:  # whatever one request brings fails that request, never the engine
        if not isinstance(e, ValueError):  # a bug: the type at the default level (the message may
            # quote the prompt), the whole traceback at debug
            logger.error("request %s could not be added: %s", msg.request_id, type(e).__name__)
            logger.debug("request %s could not be added", msg.request_id, exc_info=True)
        send(RequestRejected(msg.request_id, str(e)))
