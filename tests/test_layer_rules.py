"""Decision rules of the per-layer schedules on synthetic inputs, against hand-computed or
brute-force answers: the knapsack, the link estimator, LEGACY's table, Kimad's budget, EDGC's
controller."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.control import knapsack
from gradzip.control.link import Link, LinkEstimator, fit

# -- the knapsack -----------------------------------------------------------------------------


def _brute(errors, weights, capacity):
    best = None
    for choice in itertools.product(*(range(len(e)) for e in errors)):
        w = sum(weights[i][c] for i, c in enumerate(choice))
        if w > capacity:
            continue
        e = sum(errors[i][c] for i, c in enumerate(choice))
        if best is None or e < best - 1e-12:
            best = e
    return best


layers = st.lists(
    st.lists(st.tuples(st.integers(0, 12), st.floats(0, 100, allow_nan=False)), min_size=1, max_size=4),
    min_size=1, max_size=5,
)


@settings(max_examples=150, deadline=None)
@given(layers, st.integers(0, 40))
def test_knapsack_matches_brute_force(cands, capacity):
    weights = [[w for w, _ in layer] for layer in cands]
    errors = [[e for _, e in layer] for layer in cands]
    choice = knapsack.solve(errors, weights, capacity)
    best = _brute(errors, weights, capacity)
    if best is None:
        assert choice is None
        return
    assert choice is not None and len(choice) == len(cands)
    assert sum(weights[i][c] for i, c in enumerate(choice)) <= capacity
    assert sum(errors[i][c] for i, c in enumerate(choice)) == pytest.approx(best, abs=1e-9)


def test_knapsack_by_hand_and_errors():
    # two layers: dense (10 units, error 0) or compressed (1 unit, errors 5 and 1); 11 units fit
    # one dense layer: the layer whose compression hurts more (error 5) stays dense.
    assert knapsack.solve([[0, 5], [0, 1]], [[10, 1], [10, 1]], 11) == [0, 1]
    assert knapsack.solve([[0, 5], [0, 1]], [[10, 1], [10, 1]], 1) is None
    assert knapsack.solve([], [], 0) == []
    with pytest.raises(ValueError, match="capacity"):
        knapsack.solve([[0]], [[0]], -1)
    with pytest.raises(ValueError, match="weights"):
        knapsack.solve([[0]], [[1.5]], 3)
    weights, cap = knapsack.discretise([[1000.0, 10.0]], budget=100.0, units=10)
    assert cap == 10 and weights == [[100, 1]]


# -- the link -----------------------------------------------------------------------------------


def test_link_fit_recovers_latency_and_bandwidth_from_sizes_far_apart():
    link = Link(latency_s=0.002, bytes_per_s=12.5e6)  # 100 Mbit/s, 2 ms per collective
    rows = [(1, b, link.seconds(b, 1)) for b in (800, 2e5, 3e6)] + [(2, 5e6, link.seconds(5e6, 2))]
    got = fit(rows)
    assert got.latency_s == pytest.approx(0.002, rel=1e-9)
    assert got.bytes_per_s == pytest.approx(12.5e6, rel=1e-9)
    # one payload size only: latency and bandwidth cannot be told apart, and fit says so
    assert fit([(1, 1e5, 0.01), (1, 1e5, 0.011)]) is None


def test_link_estimator_follows_a_drop_and_a_recovery_at_the_same_speed():
    fast, slow = Link(0.001, 125e6), Link(0.001, 2.5e6)  # 1 Gbit/s, then 20 Mbit/s

    def batch(link, payload):
        # one window: the figures' own all_reduce (800 bytes) and the step's exchange
        return [(1, 800, link.seconds(800, 1)), (3, payload, link.seconds(payload, 3))]

    est = LinkEstimator(half_life=0.5, keep=8)
    for _ in range(4):
        est.add(batch(fast, 4e6))  # dense
    assert est.link.bytes_per_s == pytest.approx(125e6, rel=1e-6)
    assert est.link.latency_s == pytest.approx(0.001, rel=1e-6)
    readings = []
    for _ in range(3):  # the link drops; a codec now sends 40 kB, a payload the fit never saw
        readings.append(est.add(batch(slow, 4e4)).bytes_per_s)
    down = next(i for i, r in enumerate(readings) if abs(r / 2.5e6 - 1) < 0.25)
    assert down <= 2 and readings[-1] == pytest.approx(2.5e6, rel=0.25)
    readings = []
    for _ in range(3):  # the link recovers while the small payload still runs
        readings.append(est.add(batch(fast, 4e4)).bytes_per_s)
    up = next(i for i, r in enumerate(readings) if abs(r / 125e6 - 1) < 0.25)
    assert up <= down and readings[-1] == pytest.approx(125e6, rel=0.25)
    state = est.state_dict()
    again = LinkEstimator(half_life=0.5, keep=8)
    again.load_state_dict(state)
    assert again.link == est.link and again.add(batch(fast, 4e4)) == est.add(batch(fast, 4e4))


def test_link_estimator_keeps_a_fitted_latency_through_one_size():
    est = LinkEstimator()
    link = Link(0.004, 1e7)
    est.add([(1, 1000, link.seconds(1000, 1)), (1, 1e6, link.seconds(1e6, 1))])
    est.add([(1, 1e6, link.seconds(1e6, 1) * 2 - 0.004)])  # bandwidth halves, one size only
    assert est.link.latency_s == pytest.approx(0.004, rel=1e-6)
    assert math.isfinite(est.link.bytes_per_s) and est.link.bytes_per_s < 1e7
