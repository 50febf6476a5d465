"""The engine's own process: receives requests over a pipe, steps the engine, sends deltas back."""

import logging
import time
from multiprocessing.connection import Connection

from engine.config import EngineConfig
from engine.protocol import (
    AbortRequest, AddRequest, Delta, Fatal, Ready, RequestRejected, Shutdown, StepOutputs,
    encoder, to_engine_decoder,
)
from engine.sampling_params import SamplingParams
from engine.serving_threads import serving_threads

logger = logging.getLogger(__name__)


def _sampling_params(spec) -> SamplingParams:
    return SamplingParams(
        temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k, seed=spec.seed,
        max_tokens=spec.max_tokens, min_tokens=spec.min_tokens, stop=list(spec.stop),
        stop_token_ids=list(spec.stop_token_ids), ignore_eos=spec.ignore_eos,
        skip_special_tokens=spec.skip_special_tokens,
    )


def run_engine_process(config: EngineConfig, conn: Connection) -> None:
    """Entry point of the engine process. Blocks on the pipe when idle, steps while there is work."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    from engine.llm_engine import LLMEngine

    try:
        threads = serving_threads(config)
        engine = LLMEngine(config)
    except Exception as e:  # reported to the parent, which prints one line and exits
        conn.send_bytes(encoder.encode(Fatal(f"{type(e).__name__}: {e}")))
        return
    mc = engine.model_config
    conn.send_bytes(encoder.encode(Ready(config.model, mc.architecture, engine.max_model_len, mc.vocab_size, engine.tokenizer is not None)))

    idle_change = False  # an abort freed blocks while idle: report the new state without a step
    quiet: set[str] = set()  # requests that want only their final output (AddRequest.stream False)
    reports = StatsReports()
    while True:
        # Drain every pending message; block for one only when there is nothing to step.
        while conn.poll(0 if engine.has_unfinished() or idle_change else None):
            msg = to_engine_decoder.decode(conn.recv_bytes())
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, AbortRequest):
                quiet.discard(msg.request_id)
                idle_change |= engine.abort(msg.request_id) is not None
            elif isinstance(msg, AddRequest):
                try:
                    prompt = engine.apply_chat_template(msg.messages) if msg.messages is not None else msg.prompt
                    engine.add_request(
                        prompt, _sampling_params(msg.sampling), msg.request_id, cache_salt=msg.cache_salt,
                        priority=msg.priority, tenant=msg.tenant, weight=msg.weight, preemptible=msg.preemptible,
                        background=msg.background,
                    )
                    if not msg.stream:
                        quiet.add(msg.request_id)
                except ValueError as e:
                    conn.send_bytes(encoder.encode(RequestRejected(msg.request_id, str(e))))
        if not engine.has_unfinished():
            if idle_change:
                conn.send_bytes(encoder.encode(StepOutputs([], engine.scheduler.stats())))
                idle_change = False
            continue
        if threads is not None:
            threads.before_step(engine.scheduler.foreground_recent())
        outputs = engine.step()
        deltas, stats = _deltas(outputs, quiet), engine.last_stats
        if deltas or reports.due(stats, engine.has_unfinished()):
            conn.send_bytes(encoder.encode(StepOutputs(deltas, stats)))
            reports.sent(stats)


class StatsReports:
    """When a step with no delta to send still sends its statistics to the gateway.

    Every message wakes two of the gateway's threads (the pipe reader, then the event loop). A
    Batch API line or any ``stream=False`` request has a delta only when it finishes, so with such
    work a message per step would be nearly all statistics, on the cores the engine's own threads
    need (on a 2-core machine, about 70 wakeups a second for a batch of 16-token lines). The
    gateway reads the statistics for its metrics and for the batch runner's "live work waiting?"
    check, so they go out at once when the waiting counts change or the engine falls idle, and at
    least every ``interval_s`` otherwise.
    """

    def __init__(self, interval_s: float = 0.05, clock=time.monotonic) -> None:
        self.interval_s, self.clock = interval_s, clock
        self._last_at = float("-inf")
        self._last_waiting: dict[int, int] | None = None

    def due(self, stats, busy: bool) -> bool:
        if stats is None:
            return False
        return (not busy or stats.num_waiting_by_rank != self._last_waiting
                or self.clock() - self._last_at >= self.interval_s)

    def sent(self, stats) -> None:
        self._last_at = self.clock()
        if stats is not None:
            self._last_waiting = stats.num_waiting_by_rank


def _deltas(outputs, quiet: set[str]) -> list[Delta]:
    """This step's deltas; a quiet request gets none until it finishes, then one with its whole output."""
    deltas = []
    for o in outputs:
        if o.request_id not in quiet:
            deltas.append(Delta(o.request_id, o.new_token_ids, o.new_text, o.finished, o.finish_reason,
                                o.num_prompt_tokens, o.num_cached_tokens, len(o.token_ids), o.queue_time_s))
        elif o.finished:
            quiet.discard(o.request_id)
            deltas.append(Delta(o.request_id, o.token_ids, o.text, True, o.finish_reason, o.num_prompt_tokens,
                                o.num_cached_tokens, len(o.token_ids), o.queue_time_s))
    return deltas
