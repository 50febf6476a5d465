"""SLO admission's arithmetic against plain references: the step-time line against numpy's least squares over
random steps, the first-token prediction against a step-by-step simulation of the queue, the refusal line against
the share of admitted requests it is to have meet their objective, and the verdicts."""

import math
import random
import statistics
from types import SimpleNamespace

import numpy as np
import pytest

from gateway.slo_admission import CONFIDENCE, Objective, SloAdmission, StepTimes, judge, refusal_objective
from tenants.policy import ClassInfo


@pytest.fixture(autouse=True)
def still_clock(monkeypatch):
    """The admission's clock stands still: a prediction made after a slow line of this test (a loaded machine)
    must not count that wall time as the queue's lateness (``lateness_ms``); the tests that need time to pass
    move a ticket's ``admitted_at`` instead."""
    monkeypatch.setattr("gateway.slo_admission.time", SimpleNamespace(perf_counter=lambda: 1000.0))


def test_step_line_is_least_squares():
    rng = random.Random()
    a, b = rng.uniform(1, 20), rng.uniform(0.01, 0.5)
    times = StepTimes(window=64)
    samples = [(rng.randrange(1, 512), 0.0) for _ in range(100)]
    samples = [(t, a + b * t + rng.uniform(-0.5, 0.5)) for t, _ in samples]
    for t, ms in samples:
        times.add(t, ms)
    kept = np.array(samples[-64:], dtype=np.float64)
    slope, intercept = np.polyfit(kept[:, 0], kept[:, 1], 1)
    assert times.line() == pytest.approx((intercept, slope), rel=1e-9)


def test_step_line_degenerate_cases():
    times = StepTimes()
    assert times.line() is None
    for ms in (4.0, 6.0):
        times.add(8, ms)  # one size only: every step costs the mean
    assert times.line() == (5.0, 0.0)
    falling = StepTimes()
    for t, ms in ((1, 9.0), (100, 5.0)):
        falling.add(t, ms)
    assert falling.line() == (7.0, 0.0)


def _simulate(a, b, budget, ahead, prompt, decoding) -> float:
    """Steps of a + b * tokens, each prefilling up to budget - decoding tokens of the queue, then the request's."""
    left, elapsed = ahead + prompt, 0.0
    while left > 0:
        chunk = min(left, budget - decoding)
        elapsed += a + b * (chunk + decoding)
        left -= chunk
    return elapsed


def _slo(a, b, budget, max_num_seqs=10**6):
    engine = SimpleNamespace(config=SimpleNamespace(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs), dead=None,
                             stats=SimpleNamespace(step_prefill_tokens=0, step_decode_tokens=0, step_schedule_ms=0,
                                                   step_execute_ms=0))
    slo = SloAdmission(engine)
    for t in (1, budget):
        slo.steps.add(t, a + b * t)
    slo._seen["0"] = engine.stats  # nothing new to sample
    return slo


def test_prediction_matches_a_simulated_queue():
    rng = random.Random()
    for _ in range(20):
        a, b, budget = rng.uniform(1, 30), rng.uniform(0, 0.2), rng.choice([32, 256, 2048])
        slo = _slo(a, b, budget)
        tickets = [slo.ticket(rng.randrange(3), rng.randrange(1, 3000), 1, 16) for _ in range(rng.randrange(8))]
        for t in tickets[: len(tickets) // 2]:
            t.first_token()
        prompt, priority = rng.randrange(1, 2000), rng.randrange(3)
        ahead = sum(t.prompt_tokens for t in tickets if t.state == "prefill" and t.priority <= priority)
        decoding = sum(1 for t in tickets if t.state == "decoding")
        predicted = slo.predict_uncorrected(priority, prompt)  # first tokens above taught it a correction
        assert predicted.ttft_ms == pytest.approx(_simulate(a, b, budget, ahead, prompt, decoding), rel=1e-9)
        assert predicted.drain_ms == pytest.approx(_simulate(a, b, budget, ahead, 0, decoding) if ahead else 0)
        for t in tickets:
            t.close()
            t.close()  # idempotent
        assert sum(slo.pending.values()) == 0 and slo.decoding == 0 and not slo.open


def test_check_refuses_only_a_refusing_class_past_its_objective():
    slo = _slo(10.0, 0.0, 32)  # 10 ms a step, 32 tokens a step
    slo.ticket(0, 32 * 9, 1, 4)  # nine steps of realtime prefill queued
    refuse = ClassInfo("realtime", 0, 1.0, False, True, ttft_slo_ms=95, slo_action="refuse")
    with pytest.raises(Exception) as refused:
        slo.check(refuse, 1)  # ten steps: 100 ms > 95
    assert refused.value.status == 503 and refused.value.code == "slo_unattainable"
    assert refused.value.headers["Retry-After"] == "1"
    slo.check(ClassInfo("realtime", 0, 1.0, False, True, ttft_slo_ms=100, slo_action="refuse"), 1)  # 100 ms: met
    slo.check(ClassInfo("q", 0, 1.0, False, True, ttft_slo_ms=95, slo_action="queue"), 1)  # queues
    with pytest.raises(Exception):  # a less urgent class has realtime's queue ahead of it too
        slo.check(ClassInfo("batch", 2, 1.0, True, False, ttft_slo_ms=95, slo_action="refuse"), 1)
    assert math.isclose(slo.predict(5, 0).ttft_ms, 90.0)
    # A less urgent class's queue is not ahead of a more urgent one.
    calm = _slo(10.0, 0.0, 32)
    calm.ticket(2, 32 * 50, 1, 4)
    calm.check(ClassInfo("realtime", 0, 1.0, False, True, ttft_slo_ms=10, slo_action="refuse"), 32)


def _simulate_slots(slots: int, outputs: list[int], step_ms: float) -> float:
    """Requests of one-token prompts taking ``slots`` sequence slots in order, each holding its slot for its
    outputs' steps: the time until the slot of one more request opens."""
    free_at = [0.0] * slots  # when each slot frees
    for out in outputs:
        i = min(range(slots), key=free_at.__getitem__)
        free_at[i] += out * step_ms
    return min(free_at)


def test_prediction_waits_for_a_sequence_slot():
    rng = random.Random()
    for _ in range(10):
        slots, out, step = rng.randrange(2, 16), rng.randrange(2, 64), rng.uniform(5, 50)
        queued = rng.randrange(slots, 5 * slots)
        slo = _slo(step, 0.0, 4096, max_num_seqs=slots)
        for _ in range(queued):
            slo.ticket(0, 1, 1, out)
        predicted = slo.predict(0, 1)
        # Every request ahead just admitted with the same output: slots free max_num_seqs at a time, exactly.
        assert predicted.ttft_ms == pytest.approx(_simulate_slots(slots, [out] * queued, step) + step)
        assert predicted.drain_ms == pytest.approx(_simulate_slots(slots, [out] * queued, step))
        # A less urgent class's requests do not hold the slots of a more urgent one (it preempts them).
        assert slo.predict(-1, 1).ttft_ms == pytest.approx(step)


def test_correction_learns_what_the_steps_leave_out():
    slo = _slo(10.0, 0.0, 32)
    assert slo.predict(0, 1).ttft_ms == pytest.approx(10.0)
    ratios = [2.5 * (1.1 if i % 2 else 1 / 1.1) for i in range(200)]  # noisy around 2.5x
    for r in ratios:
        slo.learn(0, 10.0, 10.0 * r)
    assert slo.correction[0] == pytest.approx(2.5, rel=0.06)
    assert slo.predict(0, 1).ttft_ms == pytest.approx(10.0 * slo.correction[0])
    assert slo.predict(1, 1).ttft_ms == pytest.approx(10.0)  # another priority learns its own
    slo.learn(0, 10.0, 1e9)  # one outlier moves it by at most CORRECTION_WEIGHT of log(20 / 2.5)
    assert slo.correction[0] < 2.5 * 1.1 * (20 / 2.5) ** 0.1
    # A ticket teaches it its own first-token time against its uncorrected prediction.
    fresh = _slo(10.0, 0.0, 32)
    t = fresh.ticket(0, 1, 1, 4)
    assert t.predicted_ms == pytest.approx(10.0)
    t.admitted_at -= 0.05  # admitted 50 ms ago
    t.first_token()
    assert fresh.correction[0] == pytest.approx(math.exp(0.1 * math.log(5.0)), rel=0.05)


def test_judge():
    none = ClassInfo("s", 1, 1.0, True, True)
    both = ClassInfo("r", 0, 1.0, True, True, ttft_slo_ms=100, itl_slo_ms=20)
    assert judge(none, 200, 5.0, 1.0) is None
    assert judge(both, 200, 0.1, 0.02) is True
    assert judge(both, 200, 0.1001, 0.01) is False
    assert judge(both, 200, 0.05, 0.0201) is False
    assert judge(both, 200, 0.05, None) is True  # one token: no gaps to judge
    assert judge(both, 503, 0.01, 0.01) is False
    assert judge(both, 200, None, None) is False
    with pytest.raises(ValueError):
        ClassInfo("r", 0, 1.0, True, True, ttft_slo_ms=0)
    with pytest.raises(ValueError):
        ClassInfo("r", 0, 1.0, True, True, slo_action="drop")


def test_a_queue_behind_its_predictions_makes_later_ones_later():
    rng = random.Random()
    slo = _slo(10.0, 0.0, 32)
    assert slo.predict(1, 1).ttft_ms == pytest.approx(10.0)
    waiting = slo.ticket(1, 1, 1, 4)
    assert waiting.expected_ms == pytest.approx(10.0)
    late_s = rng.uniform(0.05, 0.5)
    waiting.admitted_at -= late_s + 0.010  # waited late_s past its expected 10 ms, no first token yet
    # Behind it (queued one token more): at least as late as it is.
    for priority in (1, 2):
        assert slo.predict(priority, 1).ttft_ms == pytest.approx(10.0 + late_s * 1e3, abs=5.0)
    assert slo.predict(0, 1).ttft_ms == pytest.approx(10.0)  # a more urgent class is not behind it
    waiting.first_token()  # its first token came: no longer waiting (the correction learnt it instead)
    assert slo.predict(1, 1).ttft_ms == pytest.approx(10.0 * slo.correction[1])
    on_time = slo.ticket(1, 1, 1, 4)
    assert slo.lateness_ms(1) == 0.0 and on_time.expected_ms > 10.0


def test_a_class_with_a_grace_waits_for_a_slot_less_urgent_requests_hold():
    """Every slot held by less urgent requests decoding, spread through their outputs: a request whose class waits
    a grace before preempting is predicted to wait for the expected end of the k-th of them (a Monte Carlo mean
    of the k-th shortest of n uniform remainders), at most its grace; without a grace, not at all."""
    rng = random.Random()
    for _ in range(5):
        slots, out, step = rng.randrange(4, 16), rng.randrange(8, 64), rng.uniform(5, 50)
        ahead = rng.randrange(0, slots // 2)
        draws = [sorted(rng.uniform(0, out) for _ in range(slots))[ahead] for _ in range(4000)]
        kth = sum(draws) / len(draws) * step  # the (ahead + 1)-th end among the slot holders
        slo = _slo(step, 0.0, 4096, max_num_seqs=slots)
        for _ in range(slots):
            slo.ticket(1, 1, 1, out).first_token()  # decoding: remaining uniform on [0, out] steps
        for _ in range(ahead):
            slo.ticket(0, 1, 1, out)  # urgent requests before their first token: they take the first free slots
        grace = rng.uniform(2, 4) * kth
        assert slo.predict(0, 1, grace).ttft_ms == pytest.approx(kth + step, rel=0.05)
        assert slo.predict(0, 1, 0.5 * kth).ttft_ms == pytest.approx(0.5 * kth + step)
        assert slo.predict(0, 1).ttft_ms == pytest.approx(step)
    # Slots to spare: nothing to wait for, grace or not.
    spare = _slo(10.0, 0.0, 4096, max_num_seqs=8)
    for _ in range(7):
        spare.ticket(1, 1, 1, 32).first_token()
    assert spare.predict(0, 1, 1e6).ttft_ms == pytest.approx(10.0)


def test_refusal_line_rests_where_confidence_of_the_admitted_meet():
    """Requests admitted right at the refusal line (a queue under overload), their first tokens scattered around
    the prediction (log-normal; a prediction biased either way): the line settles where CONFIDENCE of them meet
    the objective, the analytic ``line * median * exp(sigma * z) = 1``, above the objective itself when the
    prediction is too cautious."""
    rng = random.Random()
    z = statistics.NormalDist().inv_cdf(CONFIDENCE)
    for cautious in (True, False, True, False):
        slo = _slo(10.0, 0.0, 32)
        sigma, objective = rng.uniform(0.1, 0.3), rng.uniform(50, 5000)
        line = Objective("standard", objective)
        median = math.exp(rng.uniform(-0.9, -0.6) if cautious else rng.uniform(-0.2, 0.7))  # actual / predicted
        assert (-math.log(median) - sigma * z > 0) == cautious  # the line to find is past the objective
        logs, met = [], 0
        for i in range(20000):
            expected = slo.line.get(line, 1.0) * objective
            actual = expected * median * math.exp(rng.gauss(0.0, sigma))
            slo.settle(line, expected, actual)
            if i >= 5000:
                logs.append(math.log(slo.line[line]))
                met += actual <= objective
        assert met / len(logs) == pytest.approx(CONFIDENCE, abs=0.01)
        assert statistics.fmean(logs) == pytest.approx(-math.log(median) - sigma * z, abs=0.06)


def test_check_refuses_past_the_refusal_line_a_ticket_settles():
    """A ticket admitted at the line that misses lowers it: a request predicted within the objective but past the
    new line is refused. One admitted far inside the line moves it by that nearness only; a ticket without its
    class's objective (a class that queues) not at all."""
    slo = _slo(10.0, 0.0, 32)
    cls = ClassInfo("realtime", 0, 1.0, False, True, ttft_slo_ms=100, slo_action="refuse")
    objective = refusal_objective(cls)
    assert objective == Objective("realtime", 100)
    # nine steps of prefill queued: the tenth predicted at 100 ms
    ahead = [slo.ticket(0, 32, 1, 4, None, objective) for _ in range(9)]
    late = slo.ticket(0, 32, 1, 4, None, objective)
    assert late.expected_ms == pytest.approx(100)  # right at the line
    late.admitted_at -= 0.150  # its first token after 150 ms: missed
    late.first_token()
    assert slo.line[objective] == pytest.approx(math.exp(-0.1 * CONFIDENCE))
    ahead.pop().close()  # gone within its objective: settles nothing, a step less ahead
    predicted = slo.predict(0, 1).ttft_ms
    assert predicted == pytest.approx(90.0 * slo.correction[0])
    assert slo.line[objective] * 100 < predicted <= 100
    with pytest.raises(Exception) as refused:  # within the objective, past the lowered line
        slo.check(cls, 1)
    assert refused.value.code == "slo_unattainable"
    for t in ahead:
        t.close()
    before = slo.line[objective]
    near = slo.ticket(0, 1, 1, 4, None, objective)  # the queue gone: expected far inside its line
    near.first_token()  # met
    nearness = near.expected_ms / (before * 100)
    assert nearness < 0.2
    assert slo.line[objective] == pytest.approx(before * math.exp(nearness * 0.1 * (1 - CONFIDENCE)))
    queued = slo.ticket(0, 1, 1, 4)  # no objective given: settles nothing
    queued.admitted_at -= 10.0
    queued.first_token()
    assert slo.line == {objective: pytest.approx(before * math.exp(nearness * 0.1 * (1 - CONFIDENCE)))}


def test_a_line_lowered_by_a_stall_comes_back_once_nothing_settles_it(monkeypatch):
    """A stall (a machine shared with other work, a replica restarting) makes the requests queued at the line miss
    together, and each lowers it: past a few dozen it sits below what an idle server takes for one request, so
    every request is refused, none is admitted, and no first token ever raises it again. Without first tokens the
    line relaxes back to the objective: an idle hour later the same request is admitted."""
    now = [1000.0]
    monkeypatch.setattr("gateway.slo_admission.time", SimpleNamespace(perf_counter=lambda: now[0]))
    slo = _slo(10.0, 0.0, 32)
    objective = 100
    cls = ClassInfo("realtime", 0, 1.0, False, True, ttft_slo_ms=objective, slo_action="refuse")
    line = refusal_objective(cls)
    for _ in range(40):  # admitted at the line, each missed
        slo.settle(line, slo.line.get(line, 1.0) * objective, 3 * objective)
    idle = slo.predict(0, 1).ttft_ms  # one step: an idle server's first token, a tenth of the objective
    assert idle == pytest.approx(10.0)
    with pytest.raises(Exception) as refused:
        slo.check(cls, 1)  # right after the stall: refused (the line is below a step)
    assert refused.value.code == "slo_unattainable"
    now[0] += 3600.0  # an idle hour: nothing admitted, nothing settled
    slo.check(cls, 1)  # admitted: the line is back near the objective


def test_a_request_given_up_after_its_objective_passed_lowers_the_line_as_a_miss():
    """A client that leaves (its timeout, its user) after waiting past the objective, before the first token came,
    is a miss the line must count: under overload those are its clearest misses, and a line that only counted the
    first tokens that came would rise past where CONFIDENCE of the admitted meet. One that leaves within the
    objective says nothing (it might have met)."""
    slo = _slo(10.0, 0.0, 32)
    objective = Objective("realtime", 100)
    for _ in range(9):
        slo.ticket(0, 32, 1, 4, None, objective)
    early = slo.ticket(0, 32, 1, 4, None, objective)
    early.admitted_at -= 0.050  # gone after 50 ms, within the objective
    early.close()
    assert slo.line.get(objective, 1.0) == 1.0
    gone = slo.ticket(0, 32, 1, 4, None, objective)
    assert gone.expected_ms == pytest.approx(100)  # right at the line
    gone.admitted_at -= 0.150  # gone after 150 ms without a first token: missed
    gone.close()
    assert slo.line[objective] == pytest.approx(math.exp(-0.1 * CONFIDENCE))


def _miss_at_the_line(slo, cls) -> None:
    """One round of overload for ``cls``: its requests admitted until the queue ahead reaches its refusal line,
    each given up after its objective passed, without a first token (a miss that says nothing of the correction)."""
    tickets = []
    while True:
        predicted = slo.predict(cls.priority, 32)
        if predicted.ttft_ms > slo.line_of(refusal_objective(cls)) * cls.ttft_slo_ms:
            break
        tickets.append(slo.ticket(cls.priority, 32, 1, 4, cls.preempt_grace_ms, refusal_objective(cls)))
    for t in tickets:
        t.admitted_at -= 2 * cls.ttft_slo_ms / 1e3
        t.close()


def test_one_class_missing_does_not_lower_the_line_of_another_at_its_priority():
    """Two classes that refuse, at the same priority, with different objectives (classes may share a priority):
    the tight one's misses under overload lower its own refusal line, so a request of it predicted within its
    objective is refused; a request of the loose one, predicted as far within its own objective, is admitted."""
    rng = random.Random()
    priority = rng.randrange(3)
    slo = _slo(10.0, 0.0, 32)  # 10 ms a step of 32 prompt tokens, nothing learnt to correct it
    tight = ClassInfo("tight", priority, 1.0, False, True, ttft_slo_ms=rng.randint(100, 400), slo_action="refuse")
    loose = ClassInfo("loose", priority, 1.0, False, True, ttft_slo_ms=round(tight.ttft_slo_ms * rng.uniform(2, 6)),
                      slo_action="refuse")
    within = rng.uniform(0.7, 0.9)  # the requests checked: predicted at this share of their class's objective

    def prompt_of(cls) -> int:
        return 32 * math.floor(within * cls.ttft_slo_ms / 10)

    for _ in range(50):
        _miss_at_the_line(slo, tight)
    assert slo.predict(priority, prompt_of(tight)).ttft_ms <= within * tight.ttft_slo_ms
    with pytest.raises(Exception) as refused:
        slo.check(tight, prompt_of(tight))
    assert refused.value.code == "slo_unattainable"
    assert slo.predict(priority, prompt_of(loose)).ttft_ms <= within * loose.ttft_slo_ms
    slo.check(loose, prompt_of(loose))  # admitted: no request of its class has missed
    assert set(slo.line) == {refusal_objective(tight)}
    # the other way round: the loose class's misses leave the tight one's line where it was
    tight_line = slo.line_of(refusal_objective(tight))
    for _ in range(5):
        _miss_at_the_line(slo, loose)
    assert slo.line_of(refusal_objective(loose)) < 1.0
    assert slo.line_of(refusal_objective(tight)) == tight_line
