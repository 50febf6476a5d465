"""The engine's own process: builds the engine, then runs its loop (``engine_loop``): requests in over a pipe,
deltas back."""

import gc
import logging
import signal
from multiprocessing.connection import Connection

from engine.core.config import EngineConfig
from engine.processes.parent_watch import exit_with_parent
from engine.serving.engine_loop import EngineLoop
from engine.serving.protocol import Fatal, encoder
from engine.serving.serving_threads import serving_threads


def run_engine_process(config: EngineConfig, requests: Connection, replies: Connection) -> None:
    """Entry point of the engine process: reads ``requests``, writes ``replies`` (one-way pipes); the loop is
    ``EngineLoop``: it blocks on ``requests`` when idle, steps while there is work."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    exit_with_parent()  # a gateway (or engine server) killed while this engine starts or steps takes it along
    # A terminal's Ctrl-C reaches every process of the group: the gateway drains its requests, then stops this one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_engine(config, requests, replies)


def run_engine(config: EngineConfig, requests: Connection, replies: Connection) -> None:
    """Build the engine and run its loop until ``requests`` says Shutdown or closes, in whatever process calls it:
    the engine process (``run_engine_process``), or the Ray actor of an engine's rank 0
    (``engine.serving.ray_rank``); a start that fails is reported on ``replies`` (``Fatal``)."""
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
        EngineLoop(engine, config, threads, replies, handoff).run(requests)
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
