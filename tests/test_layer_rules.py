"""Decision rules of the per-layer schedules on synthetic inputs, against hand-computed or
brute-force answers: the knapsack, the link estimator, LEGACY's table, Kimad's budget, EDGC's
controller."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.choice import parse_compressor
from gradzip.compressors import build
from gradzip.control import knapsack
from gradzip.control.edgc import EDGCConfig, EDGCController, entropy, map_entropy_change_to_rank, predict_rank
from gradzip.control.figures import BucketFigures, LayerFigures, WindowFigures
from gradzip.control.kimad import COMPUTE_STEPS, KimadConfig, KimadController
from gradzip.control.layers import sent_bytes
from gradzip.control.legacy import LegacyController
from gradzip.control.link import Link, LinkEstimator, fit
from gradzip.control.schedules import layer_controller

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


def test_link_probe_is_at_least_what_the_caller_names():
    slow, fast = Link(0.001, 2.5e6), Link(0.001, 2.5e8)  # 20 Mbit/s, then 2 Gbit/s
    est = LinkEstimator(probe_every=1)
    est.add([(1, 800, slow.seconds(800, 1)), (1, 4e5, slow.seconds(4e5, 1))])
    assert est.probe_bytes(4e6) == 0  # 160 ms of 161 on the wire: the exchange reads the link
    est.add([(1, 800, fast.seconds(800, 1)), (1, 4e4, fast.seconds(4e4, 1))])  # 0.16 ms of 1.16
    assert est.last_share < 0.25
    assert est.probe_bytes() == max(64 << 10, int(8 * est.link.latency_s * est.link.bytes_per_s))
    assert est.probe_bytes(4e6) == 4_000_000  # the dense exchange, as the controllers ask
    assert est.probe_bytes(1e9) == 8 << 20


def test_a_calibration_probe_is_eight_latencies_and_20_ms_worth():
    for latency, expect in ((0.001, 250_000), (0.005, 500_000)):  # at 100 Mbit/s: 20 ms, then 8 latencies
        est = LinkEstimator(probe_every=1)
        link = Link(latency, 12.5e6)
        est.add([(1, 800, link.seconds(800, 1)), (1, 4e6, link.seconds(4e6, 1))])
        assert est.probe_bytes() == 0  # the exchange reads the link, no calibration asked
        assert est.probe_bytes(calibrate=True) == pytest.approx(expect, abs=1)
        # a recovery probe (the exchange mostly latency) is at least what the caller names
        assert est.probe_bytes(4e6, share=0.1, calibrate=True) == 4_000_000
    est = LinkEstimator(probe_every=1)
    est.add([(1, 800, Link(0.0005, 5e8).seconds(800, 1)), (1, 2e6, Link(0.0005, 5e8).seconds(2e6, 1))])
    assert est.probe_bytes(calibrate=True) == 8 << 20  # 20 ms at 4 Gbit/s is 10 MB: the cap
    assert est.probe_bytes(calibrate=True) == 8 << 20


def test_a_probe_replaces_the_exchange_in_the_window_link_samples():
    window = WindowFigures(start=1, end=5, world_size=2, period_s=0.4, in_flight_s=0.2, figures_s=0.002,
                           figures_bytes=800.0, buckets=[])
    assert window.link_samples() == [(1.0, 800.0, 0.002)]  # no bucket: the figure exchange alone
    window.buckets = [BucketFigures(key=0, numel=10, itemsize=4, current=1, payload_bytes=3e5, sent_bytes=3e5,
                                    communicate_s=0.2, collectives=1, gradient_sum_norm=1.0)]
    assert window.link_samples() == [(1.0, 3e5, 0.2), (1.0, 800.0, 0.002)]
    window.probe_latency_s, window.probe_latency_bytes = 0.0005, 8.0
    window.probe_s, window.probe_bytes = 0.027, 65536.0
    assert window.link_samples() == [(1.0, 8.0, 0.0005), (1.0, 65536.0, 0.027)]
    # what the estimator reads from it: the probe's link, not the skewed exchange's 12 Mbit/s
    est = LinkEstimator()
    link = est.add(window.link_samples())
    assert link.bytes_per_s * 8 / 1e6 == pytest.approx(65536 * 8 / (0.027 - 0.0005) / 1e6, rel=1e-3)


def test_link_estimator_keeps_a_fitted_latency_through_one_size():
    est = LinkEstimator()
    link = Link(0.004, 1e7)
    est.add([(1, 1000, link.seconds(1000, 1)), (1, 1e6, link.seconds(1e6, 1))])
    est.add([(1, 1e6, link.seconds(1e6, 1) * 2 - 0.004)])  # bandwidth halves, one size only
    assert est.link.latency_s == pytest.approx(0.004, rel=1e-6)
    assert math.isfinite(est.link.bytes_per_s) and est.link.bytes_per_s < 1e7


def test_link_estimator_latency_never_above_the_fastest_newest_exchange():
    # Fitted on a slow link whose small exchanges queued behind bulk ones: 30 ms per collective.
    slow = Link(0.030, 2.5e6)
    est = LinkEstimator(half_life=0.5, keep=8)
    for _ in range(3):
        est.add([(1, 800, slow.seconds(800, 1)), (2, 3e5, slow.seconds(3e5, 2))])
    assert est.link.latency_s == pytest.approx(0.030, rel=1e-6)
    # The link recovers; the codec's exchange (300 kB in two collectives) and a probe padded to
    # 1 MB: bytes per collective 6.7x apart, too close for a fit, each far under the kept 30 ms.
    fast = Link(0.0005, 5e8)
    batch = [(2, 3e5, fast.seconds(3e5, 2)), (1, 1e6, fast.seconds(1e6, 1))]
    est.add(batch)
    # the latency is at most the newest batch's fastest time per collective ...
    assert est.link.latency_s == pytest.approx(min(fast.seconds(3e5, 2) / 2, fast.seconds(1e6, 1)), rel=1e-9)
    # ... so the newest batch has wire time again and the bandwidth climbs from the slow link's
    # 2.5e6 B/s at once. With the latency only bounded (0.8 ms against the true 0.5 ms), the
    # batch reads 1.3 MB over 2.5 - 0.8 ms of wire time: within a factor of 2 of the fast link.
    readings = [est.link.bytes_per_s] + [est.add(batch).bytes_per_s for _ in range(3)]
    assert readings[0] > 10 * 2.5e6
    assert readings[-1] == pytest.approx(1.3e6 / (fast.seconds(1e6, 1) - 0.0008), rel=0.1)
    assert 0.5 < readings[-1] / 5e8 < 2


# -- LEGACY's table -----------------------------------------------------------------------------

def test_legacy_table_lookup_by_hand():
    # two thresholds (three size groups) by two phases of a 100-step run, Top-K ratios
    ctl = layer_controller("legacy", {"splits": "1000/100000", "policy": "0.9/0.1/0.02|0.1/0.02/0.001"}, total_steps=100)
    assert [ctl.group(n) for n in (10, 999, 1000, 99_999, 100_000, 10**7)] == [0, 0, 1, 1, 2, 2]
    assert [ctl.phase(t) for t in (0, 49, 50, 99, 500)] == [0, 0, 1, 1, 1]
    shapes = [torch.Size(s) for s in [(20,), (40, 50), (400, 500)]]  # 20, 2,000 and 200,000 elements
    early = ctl.layer_plan(0, shapes, torch.float32, 10)
    late = ctl.layer_plan(0, shapes, torch.float32, 60)
    # a 20-element layer at ratio 0.9 sends more than its raw bytes (18 values and indices): dense
    assert early == ("none", "topk:ratio=0.1", "topk:ratio=0.02")
    assert late == ("topk:ratio=0.1", "topk:ratio=0.02", "topk:ratio=0.001")
    # the reference code's defaults: 1% below 10,000 elements, 0.1% above, one phase
    default = LegacyController.from_params({})
    assert default.layer_plan(0, [torch.Size((5000,)), torch.Size((100, 100))], torch.float32, 10**6) == (
        "topk", "topk:ratio=0.001")  # topk's own default ratio is 0.01
    ranks = layer_controller("legacy", {"codec": "powersgd", "policy": "8/2"})  # any compressor: here a rank
    assert ranks.layer_plan(0, [torch.Size((50, 50)), torch.Size((500, 500))], torch.float32, 0) == (
        "powersgd:approx_rank=8", "powersgd:approx_rank=2")
    # the next window starts with the next phase
    assert ctl.decide(WindowFigures(1, 6, 2, 0.0)).window_steps == 44
    with pytest.raises(ValueError, match="total_steps"):
        layer_controller("legacy", {"policy": "0.1/0.01|0.01/0.001"})
    with pytest.raises(ValueError, match="ratio"):
        parse_compressor("legacy:policy=0.1/2")


# -- Kimad --------------------------------------------------------------------------------------

SHAPES = [torch.Size((1000,)), torch.Size((1000,))]


_KIMAD_STEPS = itertools.count(1)


def _kimad_window(errors, *, rate, latency=0.0, probed=True, met=True, probe=True):
    """One step (each call the next): dense 8 kB exchange of the two layers at ``rate``, the
    figure all_reduce of 800 bytes, with ``probe`` a link probe of 800 and 8,000 bytes at the same
    rate (what Kimad reads the link from once it has an estimate), and per layer the squared
    error of each level (levels 0.1 then 0.01)."""
    layers = [LayerFigures(s, list(e) if probed else [], 1.0) for s, e in zip(SHAPES, errors)]
    bucket = BucketFigures(key=0, numel=2000, itemsize=4, current=0, payload_bytes=8000, sent_bytes=8000,
                           communicate_s=0.0, collectives=1, gradient_sum_norm=0.0, layers=layers)
    step = next(_KIMAD_STEPS)
    window = WindowFigures(step, step + 1, 2, 0.0, [bucket], in_flight_s=latency + 8000 / rate,
                           figures_s=latency + 800 / rate, figures_bytes=800.0, met=met)
    if probe:
        window.probe_latency_s, window.probe_latency_bytes = latency + 800 / rate, 800.0
        window.probe_s, window.probe_bytes = latency + 8000 / rate, 8000.0
    return window


def test_kimad_splits_the_budget_to_the_layer_that_loses_least():
    # floor=none: every layer's lightest choice is the dense gradient (the default floor, fp16,
    # is checked below)
    ctl = KimadController(KimadConfig(levels="0.1/0.01", light="none", floor="none", target_ms=11, hysteresis=0.1))
    ctl.layer_plan(0, SHAPES, torch.float32, 0)
    # 2 ranks: a layer sends 4,000 bytes dense, 600 at ratio 0.1 (100 fp32 values and 100 int16
    # indices, all_gathered), 60 at 0.01. Layer 0 loses more than layer 1 at every level.
    errors = [(5.0, 40.0), (1.0, 2.0)]
    # 500 kB/s for 11 ms: a 5,500-byte budget: one layer dense (the one that would lose more),
    # the other at 0.1 (error 1 against 5 the other way round)
    plan = ctl.decide(_kimad_window(errors, rate=5e5))
    assert "re-planned" in plan.note
    assert ctl.layer_plan(0, SHAPES, torch.float32, 1) == ("none", "topk:ratio=0.1")
    # the link drops tenfold: 550 bytes: only both at 0.01 (120 bytes) fits; then it recovers.
    # The estimate is within 25% after 4 steps and the plan follows, both ways alike.
    for rate, expected in ((5e4, ("topk", "topk")), (5e5, ("none", "topk:ratio=0.1"))):
        for steps in range(1, 9):
            ctl.decide(_kimad_window(errors, rate=rate, probed=False))
            if steps == 4:
                assert ctl.link.link.bytes_per_s == pytest.approx(rate, rel=0.25)
            if ctl.layer_plan(0, SHAPES, torch.float32, 0) == expected:
                break
        assert steps <= 5, (rate, steps)
    # noise within the hysteresis keeps the plan
    assert "kept" in ctl.decide(_kimad_window(errors, rate=5.2e5, probed=False)).note
    # Kimad (not +): one level for every layer, the gentlest that fits
    uniform = KimadController(KimadConfig(levels="0.1/0.01", light="none", floor="none", target_ms=11, layerwise=False))
    uniform.layer_plan(0, SHAPES, torch.float32, 0)
    uniform.decide(_kimad_window(errors, rate=5e5))
    assert uniform.layer_plan(0, SHAPES, torch.float32, 1) == ("topk:ratio=0.1", "topk:ratio=0.1")
    state = ctl.state_dict()
    again = KimadController(KimadConfig(levels="0.1/0.01", light="none", floor="none", target_ms=11, hysteresis=0.1))
    again.load_state_dict(state)
    again.layer_plan(0, SHAPES, torch.float32, 0)
    for rate in (5e4, 5e4, 5e4):
        window = _kimad_window(errors, rate=rate, probed=False)
        assert again.decide(window).note == ctl.decide(window).note
    assert again.plans == ctl.plans


def test_kimad_keeps_every_layer_on_the_fp16_floor_while_it_fits():
    ctl = KimadController(KimadConfig(levels="0.1/0.01", light="none", target_ms=11, hysteresis=0.1))
    assert ctl.cfg.floor == "fp16"
    assert ctl.layer_plan(0, SHAPES, torch.float32, 0) == ("fp16", "fp16")  # before any plan
    assert ctl.probe_specs(0, SHAPES) == [["fp16", "topk:ratio=0.1", "topk"]] * 2
    # 2 ranks: a layer sends 2,000 bytes at fp16 (all_reduced), 600 at ratio 0.1, 60 at 0.01.
    # 250 kB/s for 11 ms: 2,750 bytes, under the floor's 4,000: the layers must be priced first
    plan = ctl.decide(_kimad_window([(), ()], rate=2.5e5, probed=False))
    assert plan.probe_next and "pricing" in plan.note
    assert ctl.layer_plan(0, SHAPES, torch.float32, 1) == ("fp16", "fp16")
    # priced: fp16 loses almost nothing; the layer that loses less at 0.1 takes 0.1
    # (2,000 + 600 = 2,600 bytes, error 1 + 1e-6; the other way round 5 + 1e-6)
    errors = [(1e-6, 5.0, 40.0), (1e-6, 1.0, 2.0)]
    plan = ctl.decide(_kimad_window(errors, rate=2.5e5))
    assert "re-planned" in plan.note
    assert ctl.layer_plan(0, SHAPES, torch.float32, 2) == ("fp16", "topk:ratio=0.1")
    assert ctl.errors[0][1] == {"fp16": 1e-6, "topk:ratio=0.1": 1.0, "topk": 2.0}
    # the link recovers to 500 kB/s: 5,500 bytes hold both layers at fp16 again, within 5 steps,
    # and no probe is asked for while the floor fits
    followed = []
    for _ in range(8):
        plan = ctl.decide(_kimad_window(errors, rate=5e5, probed=False))
        followed.append(ctl.layer_plan(0, SHAPES, torch.float32, 3) == ("fp16", "fp16"))
        if followed[-1]:
            break
    assert followed[-1] and len(followed) <= 5 and not plan.probe_next
    # PowerSGD's exchange mixes only with dense layers: its floor is none, and fp16 is refused
    assert KimadConfig(codec="powersgd", levels="1/2").validate().floor == "none"
    for bad in ({"floor": "int8"}, {"codec": "powersgd", "levels": "1/2", "floor": "fp16"}):
        with pytest.raises(ValueError, match="floor"):
            KimadConfig(**bad).validate()


def test_kimad_times_the_link_by_probes_it_asks_for_when_the_exchange_strays():
    errors = [(5.0, 40.0), (1.0, 2.0)]
    ctl = KimadController(KimadConfig(levels="0.1/0.01", light="none", floor="none", target_ms=500, link_every=20))
    ctl.layer_plan(0, SHAPES, torch.float32, 0)
    # the first window (met: the ranks issued its exchange together) gives the first estimate;
    # a probe is asked for at the next decision: 20 ms at the estimate (1 kB), 64 KiB at least
    plan = ctl.decide(_kimad_window(errors, rate=5e4, probe=False))
    assert ctl.link.link.bytes_per_s == pytest.approx(5e4)
    assert plan.meet_next and ctl.probe_bytes() == 64 << 10
    # the probe (sent right after the meeting): its two all_reduces are the batch; it read the
    # link within SETTLED (1.1x) of the estimate it leaves, so no other is asked for
    plan = ctl.decide(_kimad_window(errors, rate=4e4))
    weighed = [(1.0, 4e4), (0.5, 5e4)]
    assert ctl.link.link.bytes_per_s == pytest.approx(
        math.exp(sum(w * math.log(r) for w, r in weighed) / sum(w for w, _ in weighed)))
    assert not plan.meet_next and ctl.probe_bytes() == 0
    estimate = ctl.link.link.bytes_per_s
    # exchanges decided a step late (met or not) are not read into the estimate; one within
    # STRAY (2x) of what the estimate predicts asks for nothing
    for rate, met in ((estimate / 1.9, False), (estimate * 1.9, False), (estimate / 1.5, True)):
        plan = ctl.decide(_kimad_window(errors, rate=rate, met=met, probe=False))
        assert ctl.link.link.bytes_per_s == estimate and not plan.meet_next and ctl.probe_bytes() == 0
    # one beyond it either way (by more than STRAY_S, 10 ms: 8 kB take about 170 ms) asks for a probe
    for rate in (estimate / 2.1, estimate * 2.1):
        assert ctl.decide(_kimad_window(errors, rate=rate, met=False, probe=False)).meet_next
        assert ctl.link.link.bytes_per_s == estimate and ctl.probe_bytes() == 64 << 10
    # a probe 6 steps after the last, at a tenfold slower link: each batch weighs
    # 2 ** (-age / half_life), its age in steps; the estimate it leaves is within 1.1x of it
    plan = ctl.decide(_kimad_window(errors, rate=4e3, met=False))
    weighed = [(1.0, 4e3), (0.5 ** 6, 4e4), (0.5 ** 7, 5e4)]
    assert ctl.link.link.bytes_per_s == pytest.approx(
        math.exp(sum(w * math.log(r) for w, r in weighed) / sum(w for w, _ in weighed)))
    assert not plan.meet_next
    # with no stray exchange, the next probe comes link_every (20) steps after the last
    asks = [ctl.decide(_kimad_window(errors, rate=ctl.link.link.bytes_per_s, met=False, probe=False)).meet_next
            for _ in range(20)]
    assert asks == [False] * 19 + [True]
    # a probe that reads the link far from the estimate it leaves (older probes still weigh in
    # it) asks for another: 2 steps after one at 4e3, a probe at 4e5
    ctl.decide(_kimad_window(errors, rate=4e3, met=False))
    ctl.decide(_kimad_window(errors, rate=4e3, met=False, probe=False))
    assert ctl.decide(_kimad_window(errors, rate=4e5, met=False)).meet_next
    # a probe asked for at a fast estimate, sent after an exchange four times slower than that
    # estimate predicts (the link fell), is sized at the rate the exchange moved its bytes
    fell = _kimad_window(errors, rate=ctl.link.link.bytes_per_s / 5, probe=False)
    assert ctl.size_probe(fell, 4 << 20) == 64 << 10 and ctl.size_probe(fell, 0) == 0
    slower = _kimad_window(errors, rate=ctl.link.link.bytes_per_s / 2, probe=False)
    assert ctl.size_probe(slower, 4 << 20) == 4 << 20
    # on a fast link, an exchange three times slower than predicted but by under STRAY_S asks nothing
    fast = KimadController(KimadConfig(levels="0.1/0.01", light="none", floor="none", target_ms=500))
    fast.layer_plan(0, SHAPES, torch.float32, 0)
    fast.decide(_kimad_window(errors, rate=1e7, probe=False))
    fast.decide(_kimad_window(errors, rate=1e7))
    assert not fast.decide(_kimad_window(errors, rate=1e7 / 3, met=False, probe=False)).meet_next
    with pytest.raises(ValueError, match="link_every"):
        KimadConfig(link_every=0).validate()


def test_kimad_floor_edges():
    # a budget that crosses the floor's bytes re-plans even within the hysteresis: 380 kB/s for
    # 11 ms is 4,180 bytes (the floor's 4,000 fit); 350 kB/s is 3,850, 8% lower, and does not
    ctl = KimadController(KimadConfig(levels="0.1/0.01", light="none", target_ms=11, hysteresis=0.1))
    ctl.layer_plan(0, SHAPES, torch.float32, 0)
    errors = [(1e-6, 5.0, 40.0), (1e-6, 1.0, 2.0)]
    ctl.decide(_kimad_window(errors, rate=3.8e5))  # priced once; the floor fits
    assert ctl.tier == "floor" and ctl.layer_plan(0, SHAPES, torch.float32, 1) == ("fp16", "fp16")
    plans = []
    for _ in range(5):
        ctl.decide(_kimad_window(errors, rate=3.5e5, probed=False))
        plans.append(ctl.layer_plan(0, SHAPES, torch.float32, 2))
    assert plans[-1] == ("fp16", "topk:ratio=0.1"), plans
    # back on the floor only with the hysteresis to spare: 4,180 bytes again is under the floor's
    # 4,000 x 1.1 and keeps the split; 4,950 holds it
    # 4,180 bytes again is under the floor's 4,000 x 1.1: the split and its plan stay; 4,950
    # holds the floor
    for rate, tier, plan in ((3.8e5, "split", ("fp16", "topk:ratio=0.1")), (4.5e5, "floor", ("fp16", "fp16"))):
        for _ in range(5):
            ctl.decide(_kimad_window(errors, rate=rate, probed=False))
        assert (ctl.tier, ctl.layer_plan(0, SHAPES, torch.float32, 3)) == (tier, plan), rate
    # a state saved before the tiers (on_floor, no tier) resumes in the tier it names: a budget
    # under the floor's bytes then leaves it at once, however close to the saved budget
    old = {k: v for k, v in ctl.state_dict().items() if k != "tier"}
    old["on_floor"] = True
    again = KimadController(KimadConfig(levels="0.1/0.01", light="none", target_ms=11, hysteresis=0.1))
    again.load_state_dict(old)
    again.layer_plan(0, SHAPES, torch.float32, 0)
    for _ in range(5):
        again.decide(_kimad_window(errors, rate=4.3e5, probed=False))  # 4,730 bytes: the floor, kept
    assert again.tier == "floor"
    for _ in range(5):
        again.decide(_kimad_window(errors, rate=3.5e5, probed=False))  # 3,850: under the floor's 4,000
    assert again.tier == "split" and again.layer_plan(0, SHAPES, torch.float32, 1) == ("fp16", "topk:ratio=0.1")
    # an fp16 or bf16 gradient has floor none: a cast would send as many bytes
    for dtype in (torch.float16, torch.bfloat16):
        assert ctl.floor(dtype) == "none" and ctl.candidates(SHAPES[0], dtype)[0] == "none"
    assert ctl.floor(torch.float32) == "fp16"
    # levels by the codec's knob when none are given; the finest budget resolution is bounded
    assert KimadConfig(codec="powersgd").validate().levels == (8, 4, 2, 1)
    assert KimadConfig(codec="qsgd").validate().levels == (8, 4, 2)
    with pytest.raises(ValueError, match="units must be an integer between 10 and 100,000"):
        KimadConfig(units=10**12).validate()
    # codecs with an exchange of their own other than PowerSGD's are refused, naming the codec
    for codec in ("countsketch", "separate", "radius"):
        with pytest.raises(ValueError, match=f"codec must be a single-round codec or powersgd .*; {codec} has its own exchange"):
            KimadConfig(codec=codec).validate()


def test_kimad_starts_on_the_floor_and_decides_at_step_2():
    """2 ranks, two 1,000-element layers: fp16 on both until the first window (step 1) is
    decided, then the tier the budget buys."""
    ctl = KimadController(KimadConfig(levels="0.1/0.01", target_ms=11))
    assert ctl.first_window_steps() == 1
    ctl.begin(2)
    assert ctl.tier == "floor" and ctl.layer_plan(0, SHAPES, torch.float32, 0) == ("fp16", "fp16")
    # 250 kB/s for 11 ms: 2,750 bytes, under the floor's 4,000 and over int8's 2,032
    ctl.decide(_kimad_window([(), ()], rate=2.5e5, probed=False))
    assert ctl.tier == "light" and ctl.layer_plan(0, SHAPES, torch.float32, 1) == ("int8", "int8")
    ctl.begin(2)  # told again (a resumed run): the running tier stays
    assert ctl.tier == "light"
    # resumed from a state saved in the light tier onto 200 ranks, where int8 cannot sum: the floor
    resumed = KimadController(KimadConfig(levels="0.1/0.01", target_ms=11))
    resumed.begin(2)
    resumed.layer_plan(0, SHAPES, torch.float32, 0)
    resumed.decide(_kimad_window([(), ()], rate=2.5e5, probed=False))
    assert resumed.tier == "light" and resumed.layer_plan(0, SHAPES, torch.float32, 1) == ("int8", "int8")
    again = KimadController(KimadConfig(levels="0.1/0.01", target_ms=11))
    again.load_state_dict(resumed.state_dict())
    again.begin(200)
    assert again.tier == "floor" and again.layer_plan(0, SHAPES, torch.float32, 2) == ("fp16", "fp16")
    for cfg, world_size in (({"light_floor": False}, 2), ({"light": "none"}, 2), ({}, 128)):
        other = KimadController(KimadConfig(levels="0.1/0.01", target_ms=11, **cfg))
        other.begin(world_size)  # int8 sums over at most 127 ranks
        assert other.tier == "floor" and other.layer_plan(0, SHAPES, torch.float32, 0) == ("fp16", "fp16"), cfg


def test_kimad_takes_int8_between_the_fp16_floor_and_top_k():
    """The default ``light=int8``: 2 ranks, a 1,000-element layer sends 2,000 bytes at fp16, 1,016
    at int8 (16 bytes of scales and 1,000 of codes, both all_reduced), 600 at Top-K 0.1 and 60
    at 0.01; int8 loses far less than Top-K, a little more than fp16."""
    errors = [(1e-6, 1e-4, 5.0, 40.0), (1e-6, 2e-4, 1.0, 2.0)]

    def plan_at(rate, errors=errors, **cfg):
        ctl = KimadController(KimadConfig(levels="0.1/0.01", target_ms=11, **cfg))
        ctl.layer_plan(0, SHAPES, torch.float32, 0)
        ctl.decide(_kimad_window(errors, rate=rate))
        return ctl, ctl.layer_plan(0, SHAPES, torch.float32, 1)

    ctl, plan = plan_at(2.5e5)
    assert ctl.cfg.light_codec.name == "int8"
    assert ctl.probe_specs(0, SHAPES) == [["fp16", "int8", "topk:ratio=0.1", "topk"]] * 2
    # 2,750 bytes: both at int8 (2,032 bytes, error 3e-4) beats fp16 with Top-K 0.1 (2,600, error 1)
    assert plan == ("int8", "int8")
    # 1,650 bytes: int8 on the layer that loses more at 0.1, Top-K 0.1 on the other (1,616 bytes)
    assert plan_at(1.5e5)[1] == ("int8", "topk:ratio=0.1")
    # 3,300 bytes: both at int8 (2,032) fit, so both take it (light_floor, the default), though
    # fp16 on the layer that loses more at int8 would also fit (3,016 bytes, error 1e-4 + 1e-6
    # against 3e-4); the knapsack, which spends the budget, picks that without light_floor
    ctl, plan = plan_at(3e5)
    assert plan == ("int8", "int8") and ctl.tier == "light" and not ctl.decide(
        _kimad_window(errors, rate=3e5, probed=False)).probe_next
    assert plan_at(3e5, light_floor=False)[1] == ("int8", "fp16")
    # a budget crossing the light tier's bytes re-plans within the hysteresis: 190 kB/s is
    # 2,090 bytes (both at int8 fit); 180 kB/s, 5% lower, is 1,980 (they do not)
    ctl, plan = plan_at(1.9e5)
    assert plan == ("int8", "int8")
    for _ in range(5):
        ctl.decide(_kimad_window(errors, rate=1.8e5, probed=False))
    assert ctl.tier == "split" and ctl.layer_plan(0, SHAPES, torch.float32, 2) == ("int8", "topk:ratio=0.1")
    # back to the gentler tier only with the hysteresis to spare (2,032 bytes x 1.1 = 2,235), so a
    # budget hovering at a tier's bytes does not flap: 2,090 bytes again keeps the split; 2,310 moves
    for rate, tier in ((1.9e5, "split"), (2.1e5, "light")):
        for _ in range(5):
            ctl.decide(_kimad_window(errors, rate=rate, probed=False))
        assert ctl.tier == tier, rate
    assert ctl.layer_plan(0, SHAPES, torch.float32, 3) == ("int8", "int8")
    # in the light tier's band (2,032 to 2,438 bytes at a hysteresis of 0.2) a split plan re-solved
    # there sends less than both layers at int8, though that would fit the budget
    ctl, plan = plan_at(1.5e5, hysteresis=0.2)
    replanned = []
    for _ in range(6):
        replanned.append("re-planned" in ctl.decide(_kimad_window(errors, rate=2.1e5, probed=False)).note)
    held = ctl.layer_plan(0, SHAPES, torch.float32, 4)
    assert ctl.tier == "split" and 2032 <= ctl.budget < 2438 and any(replanned), (ctl.budget, replanned)
    assert sum(sent_bytes(p, s, torch.float32, 2) for p, s in zip(held, SHAPES)) < 2032, held
    with pytest.raises(ValueError, match="light_floor must be true or false; got 'yes'"):
        KimadConfig(light_floor="yes").validate()
    # Kimad's one level for all: int8 is the gentlest that fits 2,750 bytes
    assert plan_at(2.5e5, layerwise=False)[1] == ("int8", "int8")
    # without it, the same budget puts one layer on Top-K (the test above)
    without = [(e[0], *e[2:]) for e in errors]
    assert plan_at(2.5e5, without, light="none")[1] == ("fp16", "topk:ratio=0.1")
    # int8 sums over at most 127 ranks: past that it is no candidate
    ctl.world_size = 128
    assert ctl.candidates(SHAPES[0], torch.float32) == ["fp16", "topk:ratio=0.1", "topk"]
    assert ctl.candidates(SHAPES[0], torch.float16) == ["none", "topk:ratio=0.1", "topk"]
    assert KimadController.from_params({}).state_dict()["world_size"] == 1
    with pytest.raises(ValueError, match="light must be a registered codec name or none; got 'nope'"):
        KimadConfig(light="nope").validate()
    with pytest.raises(ValueError, match="light must be int8 or a single-round codec; countsketch"):
        KimadConfig(light="countsketch").validate()
    with pytest.raises(ValueError, match="light must be none with codec=powersgd"):
        KimadConfig(codec="powersgd", light="int8").validate()
    assert KimadConfig(codec="powersgd").validate().light_codec is None
    with pytest.raises(ValueError, match="light must be another codec than topk"):
        KimadConfig(light="topk").validate()
    # from a spec (validated by the parser and again by the controller): light=none stays none
    spec_built = KimadController.from_params({"light": "none", "levels": "0.1/0.01"})
    assert spec_built.cfg.light_codec is None
    assert spec_built.candidates(SHAPES[0], torch.float32) == ["fp16", "topk:ratio=0.1", "topk"]
    assert KimadController.from_params({}).cfg.light_codec.name == "int8"


# -- EDGC -----------------------------------------------------------------------------------------


def test_edgc_controller_on_a_scripted_entropy_series():
    # windows of 4 samples; first two windows' means 10 and 8: the largest change is 2
    series = [10.0] * 4 + [8.0] * 4
    ranks: list[int] = []
    kw = dict(min_rank=8, max_rank=32, samples_per_window=4, step=4)
    assert map_entropy_change_to_rank(series[:7], ranks, **kw) == 32  # under two windows: r_max
    ranks.clear()
    # change 2 of 2 maps to 32; the first mapping moves at most 4 from 32
    assert map_entropy_change_to_rank(series, ranks, **kw) == 32
    series += [7.5] * 4  # change 0.5 of 2: 8 + 24 * 0.25 = 14; a step of at most 4: 28
    assert map_entropy_change_to_rank(series, ranks, **kw) == 28
    series += [7.5] * 4  # change 0: 8; from 28: 24
    assert map_entropy_change_to_rank(series, ranks, **kw) == 24
    series += [7.4] * 4  # change 0.1 of 2: 8 + 1.2 = 9.2 -> 9 -> even 8; from 24: 20
    assert map_entropy_change_to_rank(series, ranks, **kw) == 20
    series += [6.4] * 4  # change 1 of 2: 20: stays
    assert map_entropy_change_to_rank(series, ranks, **kw) == 20
    assert ranks == [32, 28, 24, 20, 20]
    first: list[int] = []  # a first mapping far below r_max moves only rank_step down
    assert map_entropy_change_to_rank([10.0] * 4 + [8.0] * 4 + [8.0] * 4, first, **kw) == 28


def _psgd(rank: int) -> str:
    return build(f"powersgd:approx_rank={rank}").spec  # rank 4 is powersgd's default: "powersgd"


def test_edgc_probe_and_warmup_rules():
    # the rank-time line: dense 100 ms; ranks 2, 4, 8, 16 take 40, 60, 90, 130 ms: 100 ms at rank 10 -> 8
    assert predict_rank({0: 0.1, 2: 0.04, 4: 0.06, 8: 0.09, 16: 0.13}, 0.1, cap=1000) == 8
    assert predict_rank({0: 0.1, 2: 0.04, 4: 0.05}, 0.1, cap=1000) == 12  # extrapolated: rank 14 -> 12
    assert predict_rank({0: 0.1, 2: 0.2}, 0.1, cap=1000) == 4  # nothing pays: the least, 4
    shapes = [torch.Size((64, 64)), torch.Size((64,))]
    ctl = EDGCController(EDGCConfig(window=20, sample_every=5, warmup_steps=30, probe_steps=3))
    ctl.layer_plan(0, shapes, torch.float32, 0)

    def window(exchange_s, start, end, errors=None, samples=()):
        layers = [LayerFigures(s, list(e), 1.0) for s, e in zip(shapes, errors or [[], []])]
        bucket = BucketFigures(key=0, numel=4160, itemsize=4, current=0, payload_bytes=0, sent_bytes=0,
                               communicate_s=0, collectives=1, gradient_sum_norm=0, layers=layers)
        return WindowFigures(start, end, 2, 0.0, [bucket], exchange_s=exchange_s, entropy=list(samples))

    ctl.decide(window(0.1, 1, 6, samples=[5.0]))  # dense baseline
    assert ctl.layer_plan(0, shapes, torch.float32, 6) == ("powersgd:approx_rank=2", "none")
    for t, rank in ((0.04, 4), (0.06, 8), (0.09, 16)):
        ctl.decide(window(t, 6, 9))
        assert ctl.layer_plan(0, shapes, torch.float32, 9) == (_psgd(rank), "none")
    plan = ctl.decide(window(0.13, 9, 12))  # slower than dense: r_max = 8, then warm-up dense
    assert ctl.max_rank == 8 and plan.probe_next and ctl.layer_plan(0, shapes, torch.float32, 12) == ("none", "none")
    assert ctl.probe_specs(0, shapes) == [[_psgd(8)], []]
    ctl.decide(window(0.1, 12, 15, errors=[[4.0], []]))  # the rank-8 error: 2
    assert ctl.probe_specs(0, shapes) == [[_psgd(2)], []]
    ctl.decide(window(0.1, 15, 35, errors=[[9.0], []]))  # the rank-2 error 3 > 2: warm-up goes on
    assert ctl.phase == "warmup"
    plan = ctl.decide(window(0.1, 35, 55, errors=[[1.0], []]))  # 1 < 2, and past warmup_steps
    assert ctl.phase == "compress" and ctl.layer_plan(0, shapes, torch.float32, 55) == (_psgd(8), "none")
    assert plan.window_steps == 20
    state = ctl.state_dict()
    again = EDGCController(EDGCConfig(window=20, sample_every=5, warmup_steps=30, probe_steps=3))
    again.load_state_dict(state)
    assert again.state_dict() == state


def test_edgc_entropy_is_the_reference_codes_estimate():
    x = torch.arange(16, dtype=torch.float32)  # stride 4: 0, 4, 8, 12 in 4 bins: uniform, log 4
    assert entropy(x, stride=4, bins=4) == pytest.approx(math.log(4))
    assert entropy(torch.ones(10)) == 0.0
    assert entropy(torch.tensor([1.0, float("nan"), 3.0]), stride=1, bins=2) == pytest.approx(math.log(2))


def test_kimad_sizes_its_budget_to_the_compute_time_by_default():
    ctl = KimadController(KimadConfig(levels="0.1/0.01", light="none", floor="none", hysteresis=0.1))
    assert ctl.cfg.target_ms == "compute"
    ctl.layer_plan(0, SHAPES, torch.float32, 0)
    errors = [(5.0, 40.0), (1.0, 2.0)]

    def window(period_s, exchange_s, probed=True):
        w = _kimad_window(errors, rate=5e5, probed=probed)
        w.period_s, w.exchange_s = period_s, exchange_s
        return w

    # no period measured yet (a step that probes): nothing to size the budget by
    assert "measuring the compute time" in ctl.decide(window(0.0, 0.029)).note
    # a step period of 40 ms of which the exchange took 29 ms: 11 ms of compute, the budget of
    # the fixed 11 ms above (5,500 bytes at 500 kB/s): one layer dense, the other at 0.1
    plan = ctl.decide(window(0.040, 0.029))
    assert "target 11 ms" in plan.note
    assert ctl.layer_plan(0, SHAPES, torch.float32, 1) == ("none", "topk:ratio=0.1")
    # the median of the last steps: one long step (a validation pause) does not move it
    ctl.decide(window(2.0, 0.029, probed=False))
    assert ctl.compute == pytest.approx([0.011, 1.971])
    assert ctl.layer_plan(0, SHAPES, torch.float32, 2) == ("none", "none")  # median of two: 991 ms
    for _ in range(3):
        ctl.decide(window(0.040, 0.029, probed=False))
    assert statistics.median(ctl.compute) == pytest.approx(0.011)
    assert ctl.layer_plan(0, SHAPES, torch.float32, 3) == ("none", "topk:ratio=0.1")
    # compute ten times longer at the same link: 55,000 bytes, both layers dense
    for _ in range(COMPUTE_STEPS):
        ctl.decide(window(0.139, 0.029, probed=False))
    assert ctl.layer_plan(0, SHAPES, torch.float32, 4) == ("none", "none")
    # an exchange longer than the period counts as no compute
    assert ctl.target_s(window(0.010, 0.029)) == pytest.approx(0.110)  # median of 9 + one 0
    again = KimadController(KimadConfig(levels="0.1/0.01", light="none", floor="none", hysteresis=0.1))
    again.load_state_dict(ctl.state_dict())
    assert again.compute == ctl.compute
    for bad in ("fast", 0, -5):
        with pytest.raises(ValueError, match="target_ms"):
            KimadConfig(target_ms=bad).validate()


def test_link_estimator_edges():
    est = LinkEstimator(keep=2)
    # a row with infinite bytes is dropped, not read as an infinite rate
    assert est.add([(1, float("inf"), 0.1), (1, 1e3, 0.01)]).bytes_per_s == pytest.approx(1e5)
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="probe_every"):
            LinkEstimator(probe_every=bad)
    # a state with more batches than this estimator keeps is cut to its newest
    big = LinkEstimator(keep=8)
    for k in range(5):
        big.add([(1, 1e3 * (k + 1), 0.01)])
    est.load_state_dict(big.state_dict())
    assert est.batches == big.batches[-2:]
