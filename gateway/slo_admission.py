"""Admission by service-level objective: a request's time to first token predicted from the prefill queued ahead
of it and the engine's measured step times; one its class's objective cannot be met is refused at once or
queued, as the class says (``tenants.policy.ClassInfo.slo_action``). Each finished request is judged against its
class's objectives (``judge``) for the ledger's and /metrics' goodput and attainment.

The queue ahead is the gateway's own count of the requests it admitted and that have not finished: those of the
request's class and of more urgent ones are ahead of it (the engine schedules a more urgent class first, and a
class's own requests in order). Two things can hold a request back, and the prediction is the longer:

* prefill: the prompt tokens ahead that have not had their first token, at a step budget of
  ``max_num_batched_tokens`` less one token for each sequence decoding;
* a sequence slot: with ``max_num_seqs`` sequences or more ahead, it waits for slots to free, each running
  sequence holding one for about its expected output (``max_tokens``, or the default reservation; half of it for
  one already decoding), slots freeing ``max_num_seqs`` at a time; with fewer ahead but every slot taken, a
  request of a class with a grace before preempting waits for one to free by itself, at most its grace.

The step time is a line fitted to the engine's recent steps, ``ms = a + b * tokens`` (schedule plus execute time
against the tokens it computed), read from the statistics each engine reports. What that leaves out (the time
between steps, the pipes, the gateway's own queue, a machine shared with other work) is learnt from the requests
themselves: each admitted request's first-token time against the one predicted for it, as a factor per priority
(a moving geometric mean, ``correction``) its predictions are multiplied by. Per priority, because what the queue
leaves out differs by class: a less urgent class also waits for the more urgent requests that arrive after it.
That factor learns only as first tokens come, which is late when a queue builds up; so the prediction also adds
how far the requests already waiting ahead are past the times predicted for them (``lateness_ms``). Until an
engine has reported a step there is nothing to predict from, and every request is admitted.

A request is refused when its prediction passes its refusal line, a multiple of the objective (``line``, one per
class and objective, ``Objective``; 1 to start with) set from the admitted requests' outcomes so that about
``CONFIDENCE`` of those admitted near it meet the objective. Under overload the queue grows until new requests
are refused, so the admitted ones sit at the line: with the line at the objective itself, a prediction right on
average has about half of them miss (a benchmark run at twice the capacity: 171 of 374 admitted standard requests
did), each taking the engine time of one that would have met, while a prediction too cautious refuses requests
that would have met. Each first token moves the line (``settle``): down by ``CORRECTION_WEIGHT * CONFIDENCE`` in
log for a miss, up by ``CORRECTION_WEIGHT * (1 - CONFIDENCE)`` for a request that met, so it rests where misses are
``1 - CONFIDENCE`` of them; each step is scaled by how near the line the request was admitted (expected / line
time), as a request admitted far inside it says little about where the line should be (an idle server's
requests do not raise it, a realtime request that missed because a burst stalled the machine hardly lowers it).
Between first tokens the line relaxes back to the objective (``LINE_HALF_LIFE_S``), so one that a stall lowered
below what an idle server takes, refusing every request and so admitting none to raise it, comes back. The line is
the class's, not its priority's: classes may share a priority with different objectives, and a tight class's
misses say nothing of where a looser one's line belongs (they would refuse its requests far within its objective).
It holds no tenant's data: one number per class, learnt from every tenant of the class.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from aiohttp import web

from engine.serving.client import EngineClient
from gateway.errors import APIError
from gateway.replica_router import replicas_of
from tenants.policy import ClassInfo

REFUSED_CODE = "slo_unattainable"
CORRECTION_WEIGHT = 0.1  # of each new request in the moving mean of actual / predicted first-token times
CORRECTION_RANGE = (0.25, 20.0)  # one request's ratio is clamped to this before it counts
CONFIDENCE = 0.95  # the share of a refusing class's admitted requests that are to meet its first-token objective
# Without first tokens to settle it, a refusal line relaxes back to the objective with this half-life: a line a
# stall lowered below an idle server's first token would refuse every request, and then nothing would raise it.
# Under load first tokens come many a second, and the drift between them is nothing.
LINE_HALF_LIFE_S = 60.0


class StepTimes:
    """``ms = a + b * tokens`` by least squares over the last ``window`` steps (a, b >= 0). Steps that all
    computed the same number of tokens say nothing of ``b``: then every step is taken to cost their mean."""

    def __init__(self, window: int = 64) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, tokens: int, ms: float) -> None:
        if tokens > 0 and ms >= 0:
            self.samples.append((tokens, ms))

    def line(self) -> tuple[float, float] | None:
        """(a, b), or None before any step."""
        n = len(self.samples)
        if n == 0:
            return None
        mean_t = sum(t for t, _ in self.samples) / n
        mean_ms = sum(ms for _, ms in self.samples) / n
        var_t = sum((t - mean_t) ** 2 for t, _ in self.samples)
        if var_t == 0:
            return mean_ms, 0.0
        b = sum((t - mean_t) * (ms - mean_ms) for t, ms in self.samples) / var_t
        if b <= 0:  # noise larger than the slope: no evidence that tokens cost time
            return mean_ms, 0.0
        a = mean_ms - b * mean_t
        if a < 0:  # the line through the origin that keeps the slope's fit
            return 0.0, sum(t * ms for t, ms in self.samples) / sum(t * t for t, _ in self.samples)
        return a, b


class Objective(NamedTuple):
    """What a refusal line belongs to: a class that refuses, with its time-to-first-token objective. A class whose
    objective is changed (``moegate admin class set``) starts a new line: the old multiple was learnt against
    another objective."""

    class_name: str
    ttft_ms: int


def refusal_objective(cls: ClassInfo) -> Objective | None:
    """The objective whose line refuses ``cls``'s requests; None for a class that refuses none (no time-to-first-
    token objective, or ``slo_action`` queue)."""
    if cls.ttft_slo_ms is None or cls.slo_action != "refuse":
        return None
    return Objective(cls.name, cls.ttft_slo_ms)


@dataclass(slots=True)
class Prediction:
    ttft_ms: float  # the request's predicted time to its first token
    drain_ms: float  # predicted time until the prefill queued ahead of it is done (its Retry-After)


class SloAdmission:
    """The queue ahead and the step times of the gateway's engine (all its replicas as one pool)."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self.steps = StepTimes()
        self.pending: dict[int, int] = {}  # priority -> prompt tokens admitted, first token not yet out
        self.decoding = 0  # admitted sequences past their first token, not finished
        self.open: set[Ticket] = set()  # admitted requests not finished
        self.correction: dict[int, float] = {}  # priority -> actual / predicted first-token times (geometric mean)
        self.line: dict[Objective, float] = {}  # the multiple of the objective a prediction may reach
        self._settled_at: dict[Objective, float] = {}  # when each line last moved (``line_of`` relaxes it)
        self._seen: dict[str, object] = {}  # replica name -> the stats it reported last (sampled once)

    def observe(self) -> None:
        """Sample each replica's latest step, if it is new since the last look."""
        for name, replica in replicas_of(self.engine):
            stats = replica.stats
            if stats is None or self._seen.get(name) is stats:
                continue
            self._seen[name] = stats
            self.steps.add(stats.step_prefill_tokens + stats.step_decode_tokens,
                           stats.step_schedule_ms + stats.step_execute_ms)

    def predict(self, priority: int, prompt_tokens: int, grace_ms: float | None = None) -> Prediction | None:
        """The first-token time of a request of ``priority`` with ``prompt_tokens`` to prefill, admitted now
        (times ``correction``, plus ``lateness_ms``); None before any step was measured. ``grace_ms``: its class's
        wait for room before it preempts (``ClassInfo.preempt_grace_ms``; None: it preempts at once)."""
        return self._corrected(priority, self.predict_uncorrected(priority, prompt_tokens, grace_ms))

    def _corrected(self, priority: int, raw: Prediction | None) -> Prediction | None:
        if raw is None:
            return None
        factor, late = self.correction.get(priority, 1.0), self.lateness_ms(priority)
        return Prediction(raw.ttft_ms * factor + late, raw.drain_ms * factor + late)

    def lateness_ms(self, priority: int) -> float:
        """How far the queue ahead of a request of ``priority`` is behind its predictions now: the most any
        admitted request of that class or a more urgent one, still waiting for its first token, has waited past
        the first-token time predicted when it was admitted. A request queues behind those, so it is at least
        that late too. ``correction`` learns the same from first tokens, but only once they come: this sees a
        queue building up at once, while the requests that would teach it are still waiting."""
        now, late = time.perf_counter(), 0.0
        for t in self.open:
            if t.priority <= priority and t.state == "prefill" and t.expected_ms is not None:
                late = max(late, (now - t.admitted_at) * 1e3 - t.expected_ms)
        return late

    def learn(self, priority: int, predicted_ms: float, actual_ms: float) -> None:
        """One request's first-token time against its uncorrected prediction, into its priority's ``correction``."""
        if predicted_ms <= 0:
            return
        low, high = CORRECTION_RANGE
        ratio = min(high, max(low, actual_ms / predicted_ms))
        self.correction[priority] = math.exp((1 - CORRECTION_WEIGHT) * math.log(self.correction.get(priority, 1.0))
                                             + CORRECTION_WEIGHT * math.log(ratio))

    def line_of(self, objective: Objective) -> float:
        """``objective``'s refusal line now: as last settled, relaxed toward 1 since (``LINE_HALF_LIFE_S``)."""
        line = self.line.get(objective, 1.0)
        if line == 1.0:
            return line
        idle_s = max(0.0, time.perf_counter() - self._settled_at.get(objective, time.perf_counter()))
        return math.exp(math.log(line) * 0.5 ** (idle_s / LINE_HALF_LIFE_S))

    def settle(self, objective: Objective, expected_ms: float, actual_ms: float) -> None:
        """One admitted request's first token (after ``actual_ms``; ``expected_ms`` at its admission) against its
        class's objective, into that objective's ``line`` (no other class's)."""
        line = self.line_of(objective)
        nearness = min(1.0, expected_ms / (line * objective.ttft_ms))
        step = CORRECTION_WEIGHT * ((1 - CONFIDENCE) if actual_ms <= objective.ttft_ms else -CONFIDENCE)
        self.line[objective] = line * math.exp(nearness * step)
        self._settled_at[objective] = time.perf_counter()

    def predict_uncorrected(self, priority: int, prompt_tokens: int,
                            grace_ms: float | None = None) -> Prediction | None:
        """``predict`` from the step times and the queue alone."""
        self.observe()
        line = self.steps.line()
        if line is None:
            return None
        a, b = line
        replicas = max(1, sum(1 for _, r in replicas_of(self.engine) if r.dead is None))
        config = self.engine.config
        budget, slots = config.max_num_batched_tokens, config.max_num_seqs * replicas
        ahead = sum(tokens for p, tokens in self.pending.items() if p <= priority) / replicas
        decode = min(self.decoding / replicas, budget - 1)  # each step's tokens for requests past their prefill
        room = budget - decode

        def time_to_prefill(tokens: float) -> float:
            steps = max(1, math.ceil(tokens / room))
            return steps * a + b * (tokens + steps * decode)

        # Sequences ahead, and the steps each is expected to hold its slot.
        seqs, holding = 0, 0.0
        for t in self.open:
            if t.priority <= priority:
                seqs += t.sequences
                holding += t.sequences * (t.outputs if t.state == "prefill" else t.outputs / 2)
        wait, step_ms = 0.0, a + b * min(budget, slots)
        if seqs >= slots:
            rounds = math.ceil((seqs - slots + 1) / slots)  # slots free about max_num_seqs at a time
            wait = rounds * (holding / seqs) * step_ms
        elif grace_ms is not None:
            wait = self._room_wait(priority, slots, step_ms, grace_ms)
        drain = max(time_to_prefill(ahead) if ahead else 0.0, wait)
        return Prediction(max(time_to_prefill(ahead + prompt_tokens), wait + time_to_prefill(prompt_tokens)), drain)

    def _room_wait(self, priority: int, slots: int, step_ms: float, grace_ms: float) -> float:
        """With every slot taken, less urgent requests among them, a request that waits ``grace_ms`` before it
        preempts (the scheduler's ``RequestPolicy.preempt_grace_ms``) waits for a slot to free by itself, or
        for the grace. The requests of its class or more urgent ones still before their first token are taken
        to be waiting for slots (they take the ones that free first); the ``n`` others hold the slots, spread
        evenly through their outputs (``h`` more steps on average, so up to ``2h``): the ``k``-th of them ends
        after about ``2h k / (n + 1)`` steps, ``k`` counting the waiting ones and itself."""
        ahead, holders, holding = 0, 0, 0.0
        for t in self.open:
            if t.priority <= priority and t.state == "prefill":
                ahead += t.sequences
            else:
                holders += t.sequences
                holding += t.sequences * (t.outputs if t.state == "prefill" else t.outputs / 2)
        if holders + ahead < slots or holders == 0:
            return 0.0
        n = min(holders, slots)
        return min(grace_ms, 2 * (holding / holders) * min(ahead + 1, n) / (n + 1) * step_ms)

    def check(self, cls: ClassInfo, prompt_tokens: int) -> None:
        """503 ``slo_unattainable`` with Retry-After if ``cls`` refuses requests predicted past its refusal line
        (its ``line`` times its time to first token) and this one is; otherwise nothing (a class that queues admits
        it to wait)."""
        objective = refusal_objective(cls)
        if objective is None:
            return
        predicted = self.predict(cls.priority, prompt_tokens, cls.preempt_grace_ms)
        line = self.line_of(objective)
        if predicted is None or predicted.ttft_ms <= line * cls.ttft_slo_ms:
            return
        retry_s = max(1, math.ceil(predicted.drain_ms / 1e3))
        raise APIError(503, f"priority class {cls.name!r} cannot meet its time-to-first-token objective of "
                            f"{cls.ttft_slo_ms} ms now (predicted {predicted.ttft_ms:.0f} ms, admitted up to "
                            f"{line * cls.ttft_slo_ms:.0f} ms); retry after "
                            f"{retry_s} s", "server_error", code=REFUSED_CODE, headers={"Retry-After": str(retry_s)})

    def ticket(self, priority: int, prompt_tokens: int, sequences: int, outputs: int,
               grace_ms: float | None = None, refusing: Objective | None = None) -> Ticket:
        """Count an admitted request: its prompt as queued ahead of later ones until its first token, its
        ``sequences`` as holding a slot each for about ``outputs`` steps until it finishes (``grace_ms`` as for
        ``predict``); with its class's ``refusal_objective`` (``refusing``), its first token ``settle``s that
        refusal line."""
        predicted = self.predict_uncorrected(priority, prompt_tokens, grace_ms)
        expected = self._corrected(priority, predicted)
        self.pending[priority] = self.pending.get(priority, 0) + prompt_tokens
        ticket = Ticket(self, priority, prompt_tokens, sequences, outputs,
                        None if predicted is None else predicted.ttft_ms,
                        None if expected is None else expected.ttft_ms, refusing)
        self.open.add(ticket)
        return ticket


class Ticket:
    """One admitted request's place in ``SloAdmission``'s counts: ``first_token`` moves it from prefill to
    decoding, ``close`` takes it out (both idempotent)."""

    __slots__ = ("slo", "priority", "prompt_tokens", "sequences", "outputs", "predicted_ms", "expected_ms",
                 "objective", "admitted_at", "state")

    def __init__(self, slo: SloAdmission, priority: int, prompt_tokens: int, sequences: int, outputs: int,
                 predicted_ms: float | None = None, expected_ms: float | None = None,
                 objective: Objective | None = None) -> None:
        self.slo, self.priority, self.prompt_tokens, self.sequences = slo, priority, prompt_tokens, sequences
        self.outputs = outputs  # expected output tokens of each sequence
        self.predicted_ms = predicted_ms  # its uncorrected first-token prediction (None: nothing measured yet)
        self.expected_ms = expected_ms  # the same, corrected: what admission expected (``lateness_ms``)
        self.objective = objective  # its class's refusal objective (None: it settles no refusal line)
        self.admitted_at = time.perf_counter()
        self.state = "prefill"

    def first_token(self) -> None:
        if self.state == "prefill":
            self.slo.pending[self.priority] -= self.prompt_tokens
            self.slo.decoding += self.sequences
            self.state = "decoding"
            waited_ms = (time.perf_counter() - self.admitted_at) * 1e3
            if self.predicted_ms is not None:
                self.slo.learn(self.priority, self.predicted_ms, waited_ms)
                if self.objective is not None:  # admitted by a prediction: its outcome says where the line is
                    self.slo.settle(self.objective, self.expected_ms, waited_ms)
            self.slo.observe()

    def close(self) -> None:
        if self.state == "prefill":
            self.slo.pending[self.priority] -= self.prompt_tokens
            waited_ms = (time.perf_counter() - self.admitted_at) * 1e3
            if (self.objective is not None and self.expected_ms is not None
                    and waited_ms > self.objective.ttft_ms):
                # no first token, and the objective already passed (its client gave up, or it failed): a miss, and
                # under overload the clearest ones; a line blind to them would rise past its CONFIDENCE
                self.slo.settle(self.objective, self.expected_ms, waited_ms)
        elif self.state == "decoding":
            self.slo.decoding -= self.sequences
        if self.state != "closed":
            self.slo.open.discard(self)
        self.state = "closed"


def judge(cls: ClassInfo, status: int, ttft_s: float | None, mean_itl_s: float | None) -> bool | None:
    """Whether a finished request met ``cls``'s objectives (None: the class has none). A request that failed,
    or never produced a token, missed them; a mean inter-token time is judged only with two tokens or more."""
    if not cls.has_objectives:
        return None
    if status != 200 or ttft_s is None:
        return False
    if cls.ttft_slo_ms is not None and ttft_s * 1e3 > cls.ttft_slo_ms:
        return False
    if cls.itl_slo_ms is not None and mean_itl_s is not None and mean_itl_s * 1e3 > cls.itl_slo_ms:
        return False
    return True


SLO = web.AppKey("slo_admission", SloAdmission)
