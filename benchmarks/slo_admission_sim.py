"""SLO admission (``gateway.slo_admission.SloAdmission``, the real class) on a simulated engine, in seconds and
without a machine's noise of its own: what the refusal line buys against refusing at the objective itself.

    python -m benchmarks.slo_admission_sim [--load 2.0] [--noise 0.2] [--seeds 6] [--seconds 20]

The engine: ``SLOTS`` sequence slots, a step budget of ``BUDGET`` tokens, steps of ``a + b * tokens`` ms times
log-normal noise (``--noise``: half per step, half a slow drift, as a shared machine's speed), a gap between
steps the step times leave out; strict priority (realtime's prefill first; a waiting realtime request preempts
the latest standard one once its grace has passed, or at once without objectives, the preempted request
computing its prompt and output again). As ``benchmarks/slo_admission.py``: the capacity from a closed loop of
``SLOTS`` streams, objectives 3x / 6x its median time to first token, Poisson arrivals at ``--load`` times the
capacity, 30% realtime, prompt 128, output 16; both classes judged by time to first token only. Three arms on the
same arrivals: no objectives, refusal at the objective (the line held at 1), refusal at the learnt line.
"""

import argparse
import math
import random
from collections import deque
from types import SimpleNamespace

import gateway.slo_admission as slo_admission
from tenants.policy import ClassInfo

SLOTS, BUDGET, STEP_A_MS, STEP_B_MS, GAP_MS = 16, 512, 4.0, 0.06, 1.0
PROMPT, OUTPUT, REALTIME_SHARE = 128, 16, 0.3
_clock_ms = [0.0]
slo_admission.time = SimpleNamespace(perf_counter=lambda: _clock_ms[0] / 1e3)  # the admission's clock: simulated


class _Request:
    def __init__(self, priority: int, arrived: float) -> None:
        self.priority, self.arrived, self.left, self.out = priority, arrived, PROMPT, OUTPUT
        self.first: float | None = None
        self.chunk, self.ticket = 0, None


def _run(arrivals, classes, arm: str, noise: float, seed: int, closed_ms: float | None = None):
    """(finished requests, refused ones). ``arm``: "none", "objective" or "line"; ``closed_ms``: a closed loop
    of SLOTS standard streams for that long instead of ``arrivals``."""
    rng = random.Random(seed)
    engine = SimpleNamespace(config=SimpleNamespace(max_num_batched_tokens=BUDGET, max_num_seqs=SLOTS), dead=None,
                             stats=None)
    slo = slo_admission.SloAdmission(engine)
    if arm == "objective":
        slo.settle = lambda *args: None
    waiting, running, done, refused = {0: deque(), 1: deque()}, [], [], []
    pending, t, drift = deque(arrivals), 0.0, 0.0

    def arrive(priority: int, at: float) -> None:
        _clock_ms[0] = at
        request, cls = _Request(priority, at), classes[priority]
        if arm != "none":
            try:
                slo.check(cls, PROMPT)
            except Exception:
                refused.append(request)
                return
        request.ticket = slo.ticket(priority, PROMPT, 1, OUTPUT, cls.preempt_grace_ms if arm != "none" else None,
                                    slo_admission.refusal_objective(cls) if arm != "none" else None)
        waiting[priority].append(request)

    for _ in range(SLOTS if closed_ms else 0):
        arrive(1, 0.0)
    while True:
        while pending and pending[0][0] <= t:
            at, priority = pending.popleft()
            arrive(priority, at)
        if closed_ms and t > closed_ms:
            break
        if not running and not waiting[0] and not waiting[1]:
            if not pending:
                break
            t = pending[0][0]
            continue
        budget = BUDGET - sum(1 for r in running if r.left == 0)
        for r in sorted(running, key=lambda r: (r.priority, r.arrived)):
            if r.left and budget > 0:
                r.chunk = min(r.left, budget)
                budget -= r.chunk
        for priority in (0, 1):
            while waiting[priority] and budget > 0:
                if len(running) >= SLOTS:
                    head, grace = waiting[priority][0], classes[priority].preempt_grace_ms if arm != "none" else None
                    victims = [v for v in running if v.priority > priority]
                    if priority != 0 or not victims or (grace is not None and t - head.arrived < grace):
                        break
                    victim = max(victims, key=lambda v: v.arrived)
                    running.remove(victim)
                    budget += victim.chunk
                    victim.chunk = 0
                    victim.left = PROMPT + (OUTPUT - victim.out if victim.first is not None else 0)
                    waiting[victim.priority].appendleft(victim)
                request = waiting[priority].popleft()
                running.append(request)
                request.chunk = min(request.left, budget)
                budget -= request.chunk
        tokens = sum(1 if r.left == 0 else r.chunk for r in running)
        drift = 0.98 * drift + math.sqrt(1 - 0.98 ** 2) * rng.gauss(0, noise)
        ms = (STEP_A_MS + STEP_B_MS * tokens) * math.exp(drift + rng.gauss(0, noise))
        t += ms + GAP_MS
        _clock_ms[0] = t
        engine.stats = SimpleNamespace(step_prefill_tokens=tokens, step_decode_tokens=0, step_schedule_ms=0.0,
                                       step_execute_ms=ms)
        for r in list(running):
            if r.left == 0:
                r.out -= 1
                if r.out == 0:
                    running.remove(r)
                    r.ticket.close()
                    done.append(r)
                    if closed_ms:
                        arrive(1, t)
            elif r.chunk:
                r.left -= r.chunk
                r.chunk = 0
                if r.left == 0 and r.first is None:
                    r.first = t
                    r.out -= 1
                    r.ticket.first_token()
    return done, refused


def simulate(load: float, noise: float, seed: int, seconds: float) -> dict:
    plain = {0: ClassInfo("realtime", 0, 1.0, False, True), 1: ClassInfo("standard", 1, 1.0, True, True)}
    closed, _ = _run([], plain, "none", noise, seed, closed_ms=8000.0)
    capacity = len(closed) / 8.0
    ttft = sorted(r.first - r.arrived for r in closed)[len(closed) // 2]
    objective = {0: 3 * ttft, 1: 6 * ttft}
    classes = {p: ClassInfo(name, p, 1.0, p == 1, True, ttft_slo_ms=max(1, round(objective[p])), slo_action="refuse")
               for p, name in ((0, "realtime"), (1, "standard"))}
    rng, arrivals, at = random.Random(seed + 1), [], 0.0
    while (at := at + rng.expovariate(load * capacity / 1e3)) < seconds * 1e3:
        arrivals.append((at, 0 if rng.random() < REALTIME_SHARE else 1))
    sent = {p: sum(1 for _, q in arrivals if q == p) for p in (0, 1)}
    arms = {}
    for arm in ("none", "objective", "line"):
        done, refused = _run(arrivals, classes, arm, noise, seed + 2)
        met = {p: sum(1 for r in done if r.priority == p and r.first - r.arrived <= objective[p]) for p in (0, 1)}
        served = {p: sum(1 for r in done if r.priority == p) for p in (0, 1)}
        arms[arm] = {"goodput": sum(met.values()) / seconds, "realtime": met[0] / sent[0],
                     "standard_admitted": served[1], "standard_missed": served[1] - met[1],
                     "refused": len(refused)}
    return {"capacity": capacity, "arms": arms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # offered load (x capacity), step-time noise, seeds run, simulated seconds per arm
    for name, default in {"load": 2.0, "noise": 0.2, "seeds": 6, "seconds": 20.0}.items():
        p.add_argument(f"--{name}", type=type(default), default=default)
    args = p.parse_args()
    print("seed  capacity  goodput x (objective / line)  realtime % (none / objective / line)  "
          "standard admitted-missed (objective / line)")
    for seed in range(args.seeds):
        out = simulate(args.load, args.noise, seed, args.seconds)
        a = out["arms"]
        ratio = [a[arm]["goodput"] / a["none"]["goodput"] for arm in ("objective", "line")]
        rt = " / ".join(f"{100 * a[arm]['realtime']:.1f}" for arm in ("none", "objective", "line"))
        missed = " / ".join(f"{a[arm]['standard_missed']} of {a[arm]['standard_admitted']}"
                            for arm in ("objective", "line"))
        print(f"{seed:4}  {out['capacity']:6.1f}/s  {ratio[0]:.2f} / {ratio[1]:.2f}  {rt}  {missed}")


if __name__ == "__main__":
    main()
