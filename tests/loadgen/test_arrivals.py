"""Arrival processes: rates, burstiness, ramps and bounds, deterministic per seed."""

import math
import statistics

import pytest

from loadgen.arrivals import ArrivalConfig, arrival_times


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0] + times, times)]


def test_poisson_mean_rate_and_exponential_gaps():
    times = list(arrival_times(ArrivalConfig("poisson", 10.0), seed=0, limit=5000))
    assert times == sorted(times) and len(times) == 5000
    assert len(times) / times[-1] == pytest.approx(10.0, rel=0.03)
    gaps = _gaps(times)
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)
    assert cv == pytest.approx(1.0, abs=0.05)  # exponential gaps: std == mean


def test_gamma_burstiness_keeps_the_rate_and_sets_the_variability():
    times = list(arrival_times(ArrivalConfig("gamma", 5.0, burstiness=0.25), seed=1, limit=8000))
    assert len(times) / times[-1] == pytest.approx(5.0, rel=0.06)
    gaps = _gaps(times)
    cv2 = statistics.pvariance(gaps) / statistics.mean(gaps) ** 2
    assert cv2 == pytest.approx(1 / 0.25, rel=0.15)  # squared coefficient of variation = 1 / shape


def test_constant_rate_is_exact():
    times = list(arrival_times(ArrivalConfig("constant", 4.0), seed=0, limit=5))
    assert times == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])


def test_ramp_follows_the_integrated_rate():
    # Constant arrivals on a ramp land exactly where the integrated rate reaches 1, 2, 3, ...
    cfg = ArrivalConfig("constant", 1.0, ramp_to=9.0, ramp_s=10.0)
    times = list(arrival_times(cfg, seed=0, duration_s=12.0))
    for k, t in enumerate(times):
        integral = t + 0.4 * t * t if t <= 10 else 50 + 9 * (t - 10)
        assert integral == pytest.approx(k, abs=1e-9)
    assert len(times) == 50 + 18  # 50 in the ramp, then 9/s for 2 s
    # A ramped Poisson process: its count over the ramp has mean = the area under the rate (500 here).
    counts = [len(list(arrival_times(ArrivalConfig("poisson", 10.0, ramp_to=90.0, ramp_s=10.0), seed=s, duration_s=10.0)))
              for s in range(5)]
    assert statistics.mean(counts) == pytest.approx(500, rel=0.05)
    first_half = list(arrival_times(ArrivalConfig("poisson", 10.0, ramp_to=90.0, ramp_s=10.0), seed=0, duration_s=5.0))
    assert len(first_half) == pytest.approx(150, rel=0.2)  # area 10..50 over 5 s


def test_bounds_and_determinism():
    cfg = ArrivalConfig("poisson", 20.0)
    a = list(arrival_times(cfg, seed=7, limit=100))
    assert a == list(arrival_times(cfg, seed=7, limit=100))
    assert a != list(arrival_times(cfg, seed=8, limit=100))
    timed = list(arrival_times(cfg, seed=7, duration_s=2.0))
    assert timed and max(timed) < 2.0 and timed == a[: len(timed)]
    assert list(arrival_times(ArrivalConfig("throughput"), seed=0, limit=3)) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(process="poisson"), "rate"),
    (dict(process="poisson", rate=-1.0), "rate"),
    (dict(process="poisson", rate=math.inf), "rate"),
    (dict(process="concurrency"), "concurrency"),
    (dict(process="gamma", rate=1.0, burstiness=0), "burstiness"),
    (dict(process="poisson", rate=1.0, ramp_to=2.0), "ramp"),
    (dict(process="uniform", rate=1.0), "process"),
])
def test_bad_configs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ArrivalConfig(**kwargs)


def test_arrivals_need_a_bound():
    with pytest.raises(ValueError):
        list(arrival_times(ArrivalConfig("poisson", 1.0), seed=0))
    with pytest.raises(ValueError):
        list(arrival_times(ArrivalConfig("throughput"), seed=0, duration_s=5))
