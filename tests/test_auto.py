"""``--compressor auto``: controllers on known figures, identical decisions on every rank, and
error feedback that survives a change of codec."""

from __future__ import annotations

import copy
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from gradzip.control.auto import (
    CHECK_STEPS,
    FIRST_WINDOW_STEPS,
    PROBE_MEMORY,
    AccordionController,
    AutoConfig,
    CostController,
    make_controller,
    parse_candidates,
)
from gradzip.control.auto_reducer import AutoReducer
from gradzip.control.figures import BucketFigures, CandidateFigures, Plan, WindowFigures
from gradzip.metrics import StepMetrics
from gradzip.testing import run_ranks

SPECS = ["none", "fp16", "topk:ratio=0.01", "powersgd:approx_rank=4"]


def _bucket(key=0, numel=1_000_000, comm_s=0.32, current=0, probes=True, **kw) -> BucketFigures:
    # 2 ranks: a ring all_reduce and an all_gather both send each payload byte once
    cands = [
        CandidateFigures("none", 0.0, 0.0, numel * 4, numel * 4, 1, 0.0),
        CandidateFigures("fp16", 0.002, 0.001, numel * 2, numel * 2, 1, 1e-4),
        CandidateFigures("topk:ratio=0.01", 0.05, 0.01, numel * 0.08, numel * 0.08, 1, 0.7),
        CandidateFigures("powersgd:approx_rank=4", 0.01, 0.002, 100_000, 100_000, 2, 0.5),
    ]
    fields = dict(key=key, numel=numel, itemsize=4, current=current, payload_bytes=cands[current].payload_bytes,
                  sent_bytes=cands[current].sent_bytes, communicate_s=comm_s, collectives=cands[current].collectives,
                  gradient_sum_norm=1.0, candidates=cands if probes else None)
    fields.update(kw)
    return BucketFigures(**fields)


def _window(buckets, period_s=1.0, start=1, end=50, latency_s=None, figures_bytes=800, probe_bytes=0) -> WindowFigures:
    """A window whose exchange took the buckets' seconds, and whose figure all_reduce (800
    bytes, one collective) and link probe (8 bytes and ``probe_bytes``, none if 0) each took
    ``latency_s`` plus its bytes at the buckets' rate."""
    window = WindowFigures(start=start, end=end, world_size=2, period_s=period_s, buckets=buckets,
                           in_flight_s=sum(b.communicate_s for b in buckets))
    if latency_s is not None:
        rate = sum(b.sent_bytes for b in buckets) / (window.in_flight_s - latency_s * sum(b.collectives for b in buckets))
        window.figures_s, window.figures_bytes = latency_s + figures_bytes / rate, float(figures_bytes)
        if probe_bytes:
            window.probe_latency_s, window.probe_latency_bytes = latency_s + 8 / rate, 8.0
            window.probe_s, window.probe_bytes = latency_s + probe_bytes / rate, float(probe_bytes)
    return window


def test_cost_controller_reads_the_link_whatever_codec_runs():
    # 1 Gbit/s (125 MB/s), 10 ms per collective: dense 4 MB in one collective, then PowerSGD's
    # 100 kB in two. The PowerSGD window's bytes alone read as a 100 kB / 20.8 ms = 38 Mbit/s
    # link; with the figure all_reduce's sample the latency comes apart from the bandwidth.
    ctl = CostController(AutoConfig(adapt_every=40, trial_steps=8), SPECS)
    ctl.decide(_window([_bucket(comm_s=0.010 + 4e6 / 125e6)], period_s=1.0, latency_s=0.010))
    assert ctl.link_estimate().latency_s == pytest.approx(0.010, rel=1e-6)
    assert ctl.link_estimate().bytes_per_s == pytest.approx(125e6, rel=1e-6)
    for _ in range(3):
        ctl.decide(_window([_bucket(current=3, comm_s=2 * 0.010 + 100_000 / 125e6, probes=False)], period_s=0.8,
                           latency_s=0.010))
    assert ctl.link_estimate().latency_s == pytest.approx(0.010, rel=1e-6)
    assert ctl.link_estimate().bytes_per_s == pytest.approx(125e6, rel=1e-6)


def test_cost_controller_follows_the_link_back_to_dense():
    # PowerSGD runs on a 100 Mbit/s link; the link recovers to 10 Gbit/s: dense is proposed again
    ctl = CostController(AutoConfig(adapt_every=40, trial_steps=8), SPECS)
    slow, fast = 12.5e6, 1.25e9
    assert ctl.decide(_window([_bucket(comm_s=0.001 + 4e6 / slow)], latency_s=0.001)).choices == {0: 3}
    assert ctl.decide(_window([_bucket(current=3, comm_s=0.002 + 1e5 / slow, probes=False)], period_s=0.6,
                              latency_s=0.001)).note.startswith("trial kept")
    # 8 ms of 10 on the wire: the exchange reads the link; a calibration probe all the same,
    # 20 ms of the link (250 kB at 100 Mbit/s; eight latencies of 1 ms are 100 kB)
    probe = ctl.probe_bytes()
    assert probe == pytest.approx(250_000, abs=1)
    # On the recovered link PowerSGD's 100 kB take 0.08 ms of 2.08: nearly all latency, which
    # says little of the bandwidth; the probe after the figure exchange reads the link (sized on
    # the slow one, 250 kB take 0.2 ms of 1.2 there: it counts for its share), and the next one is
    # a recovery probe (the dense payload, more than eight latencies' worth), which reads it fully.
    choice, probes_asked, choices = 3, [], []
    for _ in range(3):
        running = _bucket(current=choice)
        running.communicate_s = 0.001 * running.collectives + running.sent_bytes / fast
        plan = ctl.decide(_window([running], period_s=0.6, latency_s=0.001, probe_bytes=probe))
        choice = plan.choices[0]
        choices.append(choice)
        probe = ctl.probe_bytes()
        probes_asked.append(probe)
    assert choices[0] == 0 and probes_asked[0] >= 4_000_000  # dense at once; then a probe of the dense payload
    assert choices == [0, 0, 0]
    assert ctl.link_estimate().bytes_per_s == pytest.approx(fast, rel=0.25)


def test_cost_controller_sets_aside_a_codec_that_ran_over_the_error_budget():
    ctl = CostController(AutoConfig(adapt_every=40, trial_steps=8, max_error=0.6), SPECS)
    assert ctl.decide(_window([_bucket(comm_s=4e6 / 12.5e6)], latency_s=0.0001)).choices == {0: 3}
    ctl.decide(_window([_bucket(current=3, comm_s=0.01)], period_s=0.6, latency_s=0.0001))  # kept
    # running, with its residual in x, PowerSGD's error reads 0.8: over the budget of 0.6
    over = _bucket(current=3, comm_s=0.01)
    over.candidates[3].relative_error = 0.8
    plan = ctl.decide(_window([over], period_s=0.6, latency_s=0.0001))
    assert plan.choices[0] != 3 and "powersgd:approx_rank=4" in plan.reasons[0]
    state = ctl.state_dict()
    again = CostController(AutoConfig(adapt_every=40, trial_steps=8, max_error=0.6), SPECS)
    again.load_state_dict(state)
    assert again.over_budget == ctl.over_budget and again.link_estimate() == ctl.link_estimate()


def test_cost_controller_counts_a_nan_error_over_the_budget():
    ctl = CostController(AutoConfig(adapt_every=40, trial_steps=8, max_error=0.6), SPECS)
    probed = _bucket(comm_s=4e6 / 12.5e6)
    probed.candidates[3].relative_error = float("nan")  # PowerSGD's probe on a gradient holding NaN
    plan = ctl.decide(_window([probed], latency_s=0.0001))
    assert plan.choices == {0: 1} and "powersgd:approx_rank=4 error nan" in plan.reasons[0]
    ctl = CostController(AutoConfig(adapt_every=40, trial_steps=8, max_error=0.6), SPECS)
    assert ctl.decide(_window([_bucket(comm_s=4e6 / 12.5e6)], latency_s=0.0001)).choices == {0: 3}
    ctl.decide(_window([_bucket(current=3, comm_s=0.01)], period_s=0.6, latency_s=0.0001))  # kept
    plan = ctl.decide(_window([_bucket(current=3, comm_s=0.01, running_error=float("nan"))], period_s=0.6,
                              latency_s=0.0001))
    assert plan.choices[0] != 3 and "over the error budget" in plan.note


def test_cost_controller_slow_link_trial_kept_then_steady():
    ctl = CostController(AutoConfig(adapt_every=40, trial_steps=8), SPECS)
    plan = ctl.decide(_window([_bucket(comm_s=4e6 / 12.5e6)], latency_s=0.0))  # 100 Mbit/s
    # top-k is cheapest on the wire but over the error budget (0.7 > 0.6): PowerSGD wins
    assert plan.choices == {0: 3} and plan.window_steps == 8 and "trial" in plan.note
    assert "100 Mbit/s" in plan.reasons[0] and "topk:ratio=0.01 error 0.70" in plan.reasons[0]
    plan = ctl.decide(_window([_bucket(current=3, comm_s=0.01)], period_s=0.6))
    assert plan.choices == {0: 3} and plan.note.startswith("trial kept") and plan.window_steps == 40
    plan = ctl.decide(_window([_bucket(current=3, comm_s=0.01, probes=False)], period_s=0.6))
    assert plan.choices == {0: 3} and plan.note == "no change"


def test_cost_controller_prices_a_codec_by_its_fastest_recent_probe():
    # Two windows on a 10 Gbit/s link stay dense and probe PowerSGD at 12 ms. The link drops to
    # 100 Mbit/s in the window whose probe read PowerSGD's encode at 0.5 s (a rank that lost the
    # CPU): priced on that probe alone fp16 would win (0.16 s against 0.51 s), priced on its
    # fastest of the last three probes PowerSGD does (0.03 s).
    def spiked(**kw):
        b = _bucket(**kw)
        b.candidates[3].compress_s = 0.5
        return b

    fast, slow = 1.25e9, 12.5e6
    alone = CostController(AutoConfig(adapt_every=40, trial_steps=8), SPECS)
    assert alone.decide(_window([spiked(comm_s=4e6 / slow)], latency_s=0.0)).choices == {0: 1}
    ctl = CostController(AutoConfig(adapt_every=40, trial_steps=8), SPECS)
    for _ in range(2):
        assert ctl.decide(_window([_bucket(comm_s=4e6 / fast)], latency_s=0.0)).choices == {0: 0}
    plan = ctl.decide(_window([spiked(comm_s=4e6 / slow)], latency_s=0.0))
    assert plan.choices == {0: 3} and "trial" in plan.note
    # an encode that stays slow for PROBE_MEMORY probes is what the codec costs now
    ctl = CostController(AutoConfig(adapt_every=40, trial_steps=8), SPECS)
    for _ in range(PROBE_MEMORY):
        assert ctl.decide(_window([spiked(comm_s=4e6 / fast)], latency_s=0.0)).choices == {0: 0}
    assert ctl.decide(_window([spiked(comm_s=4e6 / slow)], latency_s=0.0)).choices == {0: 1}


def test_a_probe_asked_on_a_fast_link_is_sized_down_when_the_link_fell():
    # asked at 4 Gbit/s: 20 ms of the link, 8 MiB at most, which would take 3.4 s at 20 Mbit/s
    ctl = CostController(AutoConfig(adapt_every=40, trial_steps=8), SPECS)
    fast, slow = 5e8, 2.5e6
    ctl.decide(_window([_bucket(comm_s=0.0005 + 4e6 / fast)], latency_s=0.0005))
    asked = ctl.probe_bytes()
    assert asked == 8 << 20
    # the next window's exchange took what 20 Mbit/s takes: the probe goes at that rate
    fell = _window([_bucket(comm_s=0.0005 + 4e6 / slow)], latency_s=0.0005)
    assert ctl.size_probe(fell, asked) == 64 << 10  # eight latencies at 2.5 MB/s: under the floor
    # an exchange near its prediction (skew, noise) leaves the probe as asked
    same = _window([_bucket(comm_s=2 * (0.0005 + 4e6 / fast))], latency_s=0.0005)
    assert ctl.size_probe(same, asked) == asked
    assert ctl.size_probe(fell, 0) == 0  # no probe asked, none sent


def test_cost_controller_rejects_a_slower_trial_and_does_not_retry_it():
    ctl = CostController(AutoConfig(adapt_every=40, trial_steps=8), SPECS)
    assert ctl.decide(_window([_bucket(comm_s=0.32)], period_s=1.0)).choices == {0: 3}
    plan = ctl.decide(_window([_bucket(current=3, comm_s=0.01)], period_s=1.05))
    assert plan.choices == {0: 0} and plan.note.startswith("trial rejected") and "trial slower" in plan.reasons[0]
    plan = ctl.decide(_window([_bucket(comm_s=0.32)], period_s=1.0))
    assert plan.choices == {0: 0} and "lost a trial" in plan.note


def test_cost_controller_judges_a_trial_across_a_link_change_by_its_predicted_cost():
    # Dense at 1 Gbit/s (4 MB in 33 ms of a 1 s step: PowerSGD's saving is under 5% of it). The
    # link drops to 20 Mbit/s in the last step of the next window: its period is still the fast
    # steps' (1.0 s), its link estimate reads the slow step already (88 Mbit/s), and PowerSGD is
    # tried. On the slow link PowerSGD's steps take 1.02 s: slower than the stale 1.0 s, but the
    # estimate moved from 88 to 22 Mbit/s (the older fast windows weigh a sixteenth and less), a
    # factor of 4, so the predicted costs judge: PowerSGD 12 ms encoding + 2 ms + 100 kB at 2.75 MB/s = 50.5 ms,
    # dense 1 ms + 4 MB at 2.75 MB/s = 1460 ms; PowerSGD stays.
    fast, slow = 125e6, 2.5e6
    ctl = CostController(AutoConfig(adapt_every=40, trial_steps=8), SPECS)
    dense_fast = 0.001 + 4e6 / fast
    assert ctl.decide(_window([_bucket(comm_s=dense_fast)], period_s=1.0, latency_s=0.001)).choices == {0: 0}
    straddling = (3 * dense_fast + 0.001 + 4e6 / slow) / 4
    plan = ctl.decide(_window([_bucket(comm_s=straddling)], period_s=1.0, latency_s=0.001))
    assert plan.choices == {0: 3} and "trial" in plan.note and 80 < ctl.link_estimate().mbit < 95
    trial = _bucket(current=3, comm_s=0.002 + 1e5 / slow, probes=False)
    plan = ctl.decide(_window([trial], period_s=1.02, latency_s=0.001))
    assert plan.choices == {0: 3} and plan.note == "trial kept: the link moved from 88 to 22 Mbit/s; predicted 50.5 ms against 1460.1 ms"
    # on one link the periods judge, as before: the same trial 5% slower than dense is rejected,
    # and so it is when the estimate moved by less than a factor of 2 (its noise on a fast link)
    ctl = CostController(AutoConfig(adapt_every=40, trial_steps=8), SPECS)
    assert ctl.decide(_window([_bucket(comm_s=0.001 + 4e6 / slow)], period_s=1.0, latency_s=0.001)).choices == {0: 3}
    plan = ctl.decide(_window([trial], period_s=1.05, latency_s=0.001))
    assert plan.choices == {0: 0} and plan.note == "trial rejected: step period 1050 ms against 1000 ms"
    ctl = CostController(AutoConfig(adapt_every=40, trial_steps=8), SPECS)
    assert ctl.decide(_window([_bucket(comm_s=0.001 + 4e6 / slow)], period_s=1.0, latency_s=0.001)).choices == {0: 3}
    plan = ctl.decide(_window([_bucket(current=3, comm_s=0.002 + 1e5 / (1.9 * slow), probes=False)], period_s=1.05,
                              latency_s=0.001))
    assert 1.5 < ctl.link_estimate().bytes_per_s / slow < 2 and plan.note.startswith("trial rejected: step period")


def test_cost_controller_tries_no_saving_a_trial_cannot_measure():
    # 1 Gbit/s-like: dense 40 ms on the wire, PowerSGD 12 ms encoding + 1 ms: 27 ms saved
    ctl = CostController(AutoConfig(adapt_every=40, trial_steps=8, trial_margin=0.05), SPECS)
    plan = ctl.decide(_window([_bucket(comm_s=0.04)], period_s=1.0))  # 2.7% of the step: noise
    assert plan.choices == {0: 0} and plan.window_steps == 40
    assert plan.note.startswith("predicted saving 27.0 ms under 5% of the 1000 ms step")
    ctl = CostController(AutoConfig(adapt_every=40, trial_steps=8, trial_margin=0.05), SPECS)
    plan = ctl.decide(_window([_bucket(comm_s=0.04)], period_s=0.4))  # 6.8% of the step: tried
    assert plan.choices == {0: 3} and plan.window_steps == 8 and "trial" in plan.note


def test_cost_controller_fast_link_stays_dense():
    ctl = CostController(AutoConfig(), SPECS)
    plan = ctl.decide(_window([_bucket(comm_s=4e6 / 1e10)]))  # 80 Gbit/s: encoding costs more than it saves
    assert plan.choices == {0: 0} and plan.note == "no change"
    assert "stays none" in plan.reasons[0]


def test_the_window_link_sample_is_its_least_disturbed_step(monkeypatch):
    # Seconds with a collective in flight per step of the first window (steps 1 to 4, decided at
    # step 5): step 1 opens the window (a switch) and is left out; of the others, a descheduled
    # rank made two steps 25 and 35 times slower than the 2 ms the link takes. The sample is the
    # 2 ms step, where the mean over the window would read 56 ms.
    metrics = StepMetrics()
    reducer = AutoReducer(["none", "fp16"], make_controller(AutoConfig(adapt_every=4), ["none", "fp16"]),
                          metrics=metrics)
    seen = []
    monkeypatch.setattr(reducer, "_decide", lambda step: seen.append((step, reducer._window_in_flight(4))))
    for step, flight in zip(range(1, 6), [0.1, 0.05, 0.002, 0.07, 0.0]):
        reducer._start_step(step)
        metrics.in_flight_total_s += flight
    assert [s for s, _ in seen] == [5] and seen[0][1] == pytest.approx(0.002)
    # a window of one step (Kimad's) has no step after its first: that step's seconds
    reducer._in_flight, reducer._in_flight_at_start = [], metrics.in_flight_total_s - 0.03
    assert reducer._window_in_flight(1) == pytest.approx(0.03)


def test_schedules():
    acc = AccordionController(AutoConfig(adapt_every=10), ["none", "powersgd:approx_rank=4", "powersgd:approx_rank=1"])
    assert acc.decide(_window([_bucket(gradient_sum_norm=10.0)], start=1, end=11)).choices == {0: 1}
    assert acc.decide(_window([_bucket(gradient_sum_norm=9.0)], start=12, end=22)).choices == {0: 2}  # 10% change
    assert acc.decide(_window([_bucket(gradient_sum_norm=2.0)], start=23, end=33)).choices == {0: 1}  # 78%: critical


def test_auto_config_validation():
    assert parse_candidates("none; fp16;powersgd:approx_rank=4") == ("none", "fp16", "powersgd:approx_rank=4")
    assert AutoConfig(candidates=("fp16",)).candidate_specs() == ["none", "fp16"]
    # the default list, int8 among it while it can sum over the ranks
    default = ["none", "fp16", "int8", "powersgd:approx_rank=4", "topk:ratio=0.01"]
    assert AutoConfig().candidate_specs() == AutoConfig().candidate_specs(127) == default
    assert AutoConfig().candidate_specs(128) == [s for s in default if s != "int8"]
    with pytest.raises(ValueError, match="auto-schedule"):
        AutoConfig(schedule="fast").validate()
    with pytest.raises(ValueError, match="adapt_every"):
        AutoConfig(adapt_every=2).validate()
    with pytest.raises(ValueError, match="besides none"):
        AutoConfig(candidates=("none",)).validate()
    with pytest.raises(ValueError, match="besides none"):
        AutoConfig(candidates=(" ",)).validate()
    # every candidate is built before any worker starts: unknown, out of range, not runnable
    with pytest.raises(ValueError, match="auto-candidates: 'bogus': unknown compressor"):
        AutoConfig(candidates=("fp16", "bogus")).validate()
    with pytest.raises(ValueError, match=r"auto-candidates: 'topk:ratio=5': ratio must be in \(0, 1\]"):
        AutoConfig(candidates=("topk:ratio=5",)).validate()
    with pytest.raises(ValueError, match="powersgd, int8 and single-round codecs, not separate"):
        AutoConfig(candidates=("separate",)).validate()
    AutoConfig(candidates=("fp16", "powersgd:approx_rank=2", "topk:ratio=0.1")).validate()


SHAPES = {0: [(16, 8), (8,)], 1: [(32, 4)]}


def _grad(rank: int, step: int, key: int) -> torch.Tensor:
    numel = sum(torch.Size(s).numel() for s in SHAPES[key])
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * rank + 10 * step + key))


def _agreement(rank: int, world_size: int) -> dict:
    from gradzip.control.auto import make_controller
    from gradzip.control.auto_reducer import AutoReducer

    out = {}
    candidates = ("none", "fp16", "topk:ratio=0.1", "powersgd:approx_rank=1")
    for schedule in ("cost", "accordion"):
        cfg = AutoConfig(schedule=schedule, adapt_every=4, trial_steps=3, candidates=candidates,
                         max_error=2.0, min_gain=0.01)
        specs = cfg.candidate_specs()
        metrics = StepMetrics()
        reducer = AutoReducer(specs, make_controller(cfg, specs), metrics=metrics)
        history, decided_at = [], []
        for step in range(16):
            time.sleep(0.003 * rank * (step % 3))  # uneven compute per rank
            futs = [reducer.reduce(key, _grad(rank, step, key), step=step, shapes=SHAPES[key]) for key in SHAPES]
            values = [f.wait() for f in futs]
            history.append((dict(reducer.choices), [v.clone() for v in values]))
            decided_at += [e["step"] for e in metrics.pop()["events"] if e["kind"] == "auto"]
        out[schedule] = history
        out[schedule + " decided at"] = decided_at
    dist.barrier()
    return out


@pytest.mark.dist
def test_auto_decisions_identical_on_all_ranks():
    results = run_ranks(_agreement, 3, timeout_s=120)
    for schedule in ("cost", "accordion"):
        histories = [r[schedule] for r in results]
        for step in range(16):
            choices = [h[step][0] for h in histories]
            assert choices[0] == choices[1] == choices[2], (schedule, step, choices)
            for values in zip(*(h[step][1] for h in histories)):
                assert all(torch.equal(values[0], v) for v in values[1:]), (schedule, step)
        assert results[0][schedule + " decided at"] == results[1][schedule + " decided at"]
        if schedule != "cost":  # windows of adapt_every = 4 steps from step 1, each decided at its end
            assert results[0][schedule + " decided at"] == [5, 9, 13]
        seen = {tuple(sorted(h[0].items())) for h in histories[0]}
        if schedule == "accordion":
            assert len(seen) >= 2, f"{schedule} made no decision in 16 steps"


FORCED = {2: "topk:ratio=0.1", 5: "powersgd:approx_rank=1", 8: "fp16", 10: "none", 12: "topk:ratio=0.1",
          14: "powersgd:approx_rank=1"}


def _forced(rank: int, world_size: int, forced: dict | None = None, candidates: tuple | None = None) -> dict:
    from gradzip.control.auto import make_controller
    from gradzip.control.auto_reducer import AutoReducer

    cfg = AutoConfig(adapt_every=1000, candidates=candidates or ("fp16", "topk:ratio=0.1", "powersgd:approx_rank=1"))
    specs = cfg.candidate_specs()
    metrics = StepMetrics()
    reducer = AutoReducer(specs, make_controller(cfg, specs), metrics=metrics)
    for step, spec in (forced or FORCED).items():
        reducer.force(step, {0: spec, 1: spec})
    sum_out = {k: torch.zeros(_grad(0, 0, k).numel(), dtype=torch.float64) for k in SHAPES}
    sum_mean = {k: torch.zeros_like(v) for k, v in sum_out.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(17):
            futs = {k: reducer.reduce(k, _grad(rank, step, k), step=step, shapes=SHAPES[k]) for k in SHAPES}
            for k, fut in futs.items():
                sum_out[k] += fut.wait().double()
                sum_mean[k] += sum(_grad(r, step, k).double() for r in range(world_size)) / world_size
    residuals = {k: reducer.residual(k) for k in SHAPES}
    dist.barrier()
    return {"sum_out": sum_out, "sum_mean": sum_mean, "residuals": residuals, "final": dict(reducer.choices),
            "warnings": [str(w.message) for w in caught],
            "decided_at": [e["step"] for e in metrics.events if e["kind"] == "auto"]}


@pytest.mark.dist
def test_forced_codec_changes_keep_error_feedback_consistent():
    results = run_ranks(_forced, 2, timeout_s=120)
    for r in results:
        assert not [w for w in r["warnings"] if "changed shape" in w]
        assert r["final"] == {0: 3, 1: 3}
        # the first decision follows a short window after step 0, not adapt_every (1000) steps;
        # it finds the PowerSGD forced at step 5 over the error budget on these random gradients
        # and moves off it, and the replacement's error is checked CHECK_STEPS later
        assert r["decided_at"] == [1 + FIRST_WINDOW_STEPS, 1 + FIRST_WINDOW_STEPS + CHECK_STEPS]
    for k in SHAPES:
        # What every rank received plus what the ranks still owe, averaged, is everything they sent:
        # sum_t out_t + mean_r e_r == sum_t mean_r g_{r,t}. A residual lost at a switch breaks it.
        owed = sum(r["residuals"][k].double() for r in results) / len(results)
        expected = results[0]["sum_mean"][k]
        got = results[0]["sum_out"][k] + owed
        assert torch.equal(results[0]["sum_out"][k], results[1]["sum_out"][k])
        assert float((got - expected).norm()) <= 2e-3 * float(expected.norm())
        assert float(owed.norm()) > 0.05 * float(expected.norm())  # PowerSGD at the end owes a real residual


@pytest.mark.dist
def test_int8_as_a_candidate_takes_and_hands_back_its_residual():
    """``int8`` runs in auto beside single-round codecs: switched in and out (forced), what every
    rank received plus what the ranks still owe, averaged, is everything they sent, and the
    ranks agree bit for bit."""
    forced = {2: "int8:group=16", 5: "topk:ratio=0.1", 8: "int8:group=16", 11: "fp16", 13: "int8:group=16"}
    results = run_ranks(_forced, 3, forced, ("fp16", "int8:group=16", "topk:ratio=0.1"), timeout_s=120)
    for k in SHAPES:
        owed = sum(r["residuals"][k].double() for r in results) / len(results)
        expected = results[0]["sum_mean"][k]
        got = results[0]["sum_out"][k] + owed
        assert all(torch.equal(r["sum_out"][k], results[0]["sum_out"][k]) for r in results)
        assert float((got - expected).norm()) <= 2e-3 * float(expected.norm())


def _auto(candidates: tuple, schedule: str = "cost") -> AutoReducer:
    from gradzip.control.auto import make_controller

    cfg = AutoConfig(schedule=schedule, adapt_every=4 if schedule == "accordion" else 1000, candidates=candidates)
    specs = cfg.candidate_specs()
    return AutoReducer(specs, make_controller(cfg, specs), metrics=StepMetrics())


def _skips_and_resume(rank: int, world_size: int) -> dict:
    out = {}
    # A: rank 1's bucket 0 is NaN at step 5, the step both buckets switch from Top-K to int8: the
    # step is skipped, and what Top-K left (carried into int8) must survive it, for both buckets
    reducer = _auto(("topk:ratio=0.1", "int8:group=16"))
    for step, spec in ((2, "topk:ratio=0.1"), (5, "int8:group=16"), (8, "none")):
        reducer.force(step, {0: spec, 1: spec})
    sum_out = {k: torch.zeros(_grad(0, 0, k).numel(), dtype=torch.float64) for k in SHAPES}
    sum_mean = {k: torch.zeros_like(v) for k, v in sum_out.items()}
    for step in range(10):
        grads = {k: _grad(rank, step, k) for k in SHAPES}
        if step == 5 and rank == 1:
            grads[0][3] = float("nan")
        outs = {k: reducer.reduce(k, g, step=step, shapes=SHAPES[k]).wait() for k, g in grads.items()}
        if step != 5:  # the skipped step: neither the outputs nor the gradients count
            for k in SHAPES:
                sum_out[k] += outs[k].double()
                sum_mean[k] += sum(_grad(r, step, k).double() for r in range(world_size)) / world_size
        else:
            out["nan at 5"] = bool(torch.isnan(outs[0]).all())
    reducer.settle()
    out["sums"] = (sum_out, sum_mean, {k: reducer.residual(k) for k in SHAPES})
    # B: fp16 gradients near the top of fp16's range under Top-K, then dense: the fp32 residual
    # carried into the dense step would overflow fp16 if cast and added there
    reducer = _auto(("topk:ratio=0.01",))
    reducer.force(1, {0: "topk:ratio=0.01", 1: "topk:ratio=0.01"})
    reducer.force(7, {0: "none", 1: "none"})
    finite = []
    for step in range(10):
        futs = [reducer.reduce(k, (_grad(rank, step, k) * 1e4).half(), step=step, shapes=SHAPES[k]) for k in SHAPES]
        finite.append(all(bool(torch.isfinite(f.wait()).all()) for f in futs))
    out["fp16 finite"] = finite
    # C: accordion decides from the window's gradient sums alone: a state saved at a window's first
    # step (5) or in its middle (7) resumes bit for bit
    candidates = ("int8:group=16", "topk:ratio=0.1")

    def run(reducer, steps):
        history = []
        for step in steps:
            grads = {k: _grad(rank, step, k) + 1.0 for k in SHAPES}
            values = {k: reducer.reduce(k, g, step=step, shapes=SHAPES[k]).wait() for k, g in grads.items()}
            history.append((dict(reducer.choices), values))
        return history

    straight = run(_auto(candidates, "accordion"), range(14))
    out["straight"] = straight
    for cut in (5, 7):
        first = _auto(candidates, "accordion")
        run(first, range(cut))
        again = _auto(candidates, "accordion")
        again.load_state_dict(first.state_dict())
        out[f"resumed {cut}"] = run(again, range(cut, 14))
    dist.barrier()
    return out


@pytest.mark.dist
def test_a_skipped_step_keeps_what_a_switch_carried_fp16_carries_fit_and_accordion_resumes_exactly():
    results = run_ranks(_skips_and_resume, 2, timeout_s=120)
    for r in results:
        assert r["nan at 5"]
        sum_out, sum_mean, owed = r["sums"]
        assert all(v is None for v in owed.values())  # the dense steps at the end sent everything
        for k in SHAPES:
            # what was received over the kept steps is everything sent: no carry lost at step 5
            assert float((sum_out[k] - sum_mean[k]).norm()) <= 1e-5 * float(sum_mean[k].norm()), k
        assert r["fp16 finite"] == [True] * 10
        straight = r["straight"]
        assert {c for choices, _ in straight for c in choices.values()} >= {1, 2}  # it did switch
        for cut in (5, 7):
            for (choices_a, values_a), (choices_b, values_b) in zip(straight[cut:], r[f"resumed {cut}"]):
                assert choices_a == choices_b, cut
                assert all(torch.equal(values_a[k], values_b[k]) for k in SHAPES), cut


@pytest.mark.e2e
def test_train_auto_with_monitoring_and_verify_writes_it_all(tmp_path):
    import json
    import subprocess
    import sys

    tiny = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "32", "--batch-size", "4",
            "--vocab-size", "512", "--bucket-cap-mb", "0.02"]
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gradzip", "train", *tiny, "--steps", "12", "--eval-every", "12",
           "--compressor", "auto", "--adapt-every", "4", "--auto-schedule", "accordion",
           "--auto-candidates", "fp16;powersgd:approx_rank=2", "--monitor-every", "2", "--verify-every", "3",
           "--norm-warn", "1.0", "--norm-warn-checks", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(len(r["buckets"]) >= 1 for r in records)
    assert len(records[-1]["buckets"]) >= 2  # several buckets after DDP's rebuild
    for r in records:
        checked = all("quality" in b for b in r["buckets"].values())
        assert checked == (r["step"] % 2 == 0)
        assert all(("verify" in b) == (r["step"] % 3 == 0) for b in r["buckets"].values())
    switches = [e for r in records for e in r.get("events", []) if e["kind"] == "switch"]
    assert switches and all(e["reason"] for e in switches)
    summary = json.loads((out / "summary.json").read_text())["monitor"]
    assert summary["auto_decisions"] and summary["quality"]
    assert any("bucket" in line and "->" in line for line in proc.stdout.splitlines())


def test_cost_controller_moves_off_a_running_codec_over_the_error_budget_without_a_trial():
    ctl = CostController(AutoConfig(adapt_every=40, trial_steps=8, max_error=0.6), SPECS)
    assert ctl.decide(_window([_bucket(comm_s=4e6 / 12.5e6)], latency_s=0.0001)).choices == {0: 3}
    ctl.decide(_window([_bucket(current=3, comm_s=0.01, probes=False)], period_s=0.6, latency_s=0.0001))  # kept
    # no probe of every candidate in this window; the running PowerSGD measured 0.8 on its last step
    plan = ctl.decide(_window([_bucket(current=3, comm_s=0.01, probes=False, running_error=0.8)], period_s=0.6,
                              latency_s=0.0001))
    # Top-K's probe (0.7) is over the budget too, and PowerSGD is set aside: fp16 is the cheapest
    # within it on a 100 Mbit/s link (2 MB against dense 4 MB)
    # its own error is checked after CHECK_STEPS (4), sooner than a trial's 8
    assert plan.choices == {0: 1} and ctl.trial is None and plan.window_steps == CHECK_STEPS == 4 and plan.probe_next
    assert "error budget" in plan.note and "powersgd:approx_rank=4 error 0.80" in plan.reasons[0]
    # fp16 runs within the budget: PowerSGD is not proposed again on the same link
    plan = ctl.decide(_window([_bucket(current=1, comm_s=2e6 / 12.5e6, running_error=1e-4)], period_s=0.8,
                              latency_s=0.0001))
    assert plan.choices == {0: 1}


def _over_budget(rank: int, world_size: int) -> dict:
    from gradzip.control.auto import make_controller
    from gradzip.control.auto_reducer import AutoReducer

    cfg = AutoConfig(adapt_every=4, trial_steps=4, reprobe_every=100, max_error=0.5,
                     candidates=("topk:ratio=0.05",))
    specs = cfg.candidate_specs()
    metrics = StepMetrics()
    reducer = AutoReducer(specs, make_controller(cfg, specs), metrics=metrics)
    reducer.force(6, {0: "topk:ratio=0.05", 1: "topk:ratio=0.05"})
    choices = []
    for step in range(12):
        futs = [reducer.reduce(k, _grad(rank, step, k), step=step, shapes=SHAPES[k]) for k in SHAPES]
        for f in futs:
            f.wait()
        choices.append(dict(reducer.choices))
    dist.barrier()
    return {"choices": choices, "events": [e for e in metrics.events if e["kind"] == "auto"]}


@pytest.mark.dist
def test_a_running_codec_over_the_error_budget_is_measured_and_left_between_full_probes():
    # Top-K at 5% of Gaussian gradients leaves most of their norm (relative error near 0.9): the
    # first window's probe keeps the buckets dense; Top-K forced at step 6 runs in a window that
    # prices no candidate (reprobe_every=100), and its own error, measured on the window's last
    # step, moves both buckets back to dense at the window's end (step 9), without a trial.
    results = run_ranks(_over_budget, 2, timeout_s=120)
    assert results[0] == results[1]
    choices, events = results[0]["choices"], results[0]["events"]
    assert choices[5] == {} or set(choices[5].values()) == {0}
    assert choices[8] == {0: 1, 1: 1} and choices[9] == {0: 0, 1: 0} and choices[11] == {0: 0, 1: 0}
    left = [e for e in events if e["step"] == 9]
    assert len(left) == 1 and "error budget" in left[0]["note"]
    errors = [float(r.split(" error ")[1].split(" ")[0]) for r in left[0]["reasons"].values()]
    assert len(errors) == 2 and all(e > 0.5 for e in errors)


def _running_error_vs_monitor(rank: int, world_size: int) -> dict:
    from gradzip.control.auto import make_controller
    from gradzip.control.auto_reducer import AutoReducer

    cfg = AutoConfig(adapt_every=4, trial_steps=4, reprobe_every=100, max_error=2.0,
                     candidates=("powersgd:approx_rank=1", "topk:ratio=0.1"))
    specs = cfg.candidate_specs()
    metrics = StepMetrics(monitor_every=4)
    reducer = AutoReducer(specs, make_controller(cfg, specs), metrics=metrics)
    seen = []
    decide = reducer.controller.decide

    def recording(window):
        seen.append({str(b.key): b.running_error for b in window.buckets})
        return decide(window)

    reducer.controller.decide = recording
    reducer.force(2, {0: "powersgd:approx_rank=1", 1: "topk:ratio=0.1"})
    monitored = {}
    for step in range(10):
        futs = [reducer.reduce(k, _grad(rank, step, k), step=step, shapes=SHAPES[k]) for k in SHAPES]
        for f in futs:
            f.wait()
        popped = metrics.pop()
        if step == 8:
            monitored = {str(k): b["quality"]["relative_error"] for k, b in popped["buckets"].items()}
    dist.barrier()
    return {"seen": seen, "monitored": monitored}


@pytest.mark.dist
def test_the_running_error_auto_reads_is_the_figure_the_monitor_logs():
    # PowerSGD's error with the all-reduced P (what it really leaves) and Top-K's, read from the
    # residual each left on the window's last step (8), against the reducers' own monitor there;
    # the max over the 3 ranks is what the controller sees.
    results = run_ranks(_running_error_vs_monitor, 3, timeout_s=120)
    seen = results[0]["seen"]
    assert len(seen) == 2 and all(r["seen"] == seen for r in results)
    for key in ("0", "1"):
        expected = max(r["monitored"][key] for r in results)
        assert 0.05 < expected < 1.0
        assert seen[1][key] == pytest.approx(expected, rel=1e-5)


class _Scripted:
    """Every bucket takes candidate ``window.end % 3``: a plan from the window alone, so that the
    step at which it applies is known by hand. The plans of the windows ending at a step in
    ``ask`` ask the next decision to meet; it asks for a small link probe at every decision, and
    records, per window, whether it was met and whether a probe came with it."""

    needs_gradient_sum = False
    checks_running_error = False
    entropy_every = 0
    min_window_steps = 1

    def __init__(self, late: bool, ask: tuple[int, ...] = ()) -> None:
        self.decides_late = late
        self.ask = ask
        self.windows: list[tuple[int, int, bool, bool]] = []

    def first_window_steps(self) -> int:
        return 2

    def probe_bytes(self) -> int:
        return 4096

    def decide(self, window: WindowFigures) -> Plan:
        self.windows.append((window.start, window.end, window.met, window.probe_s > 0))
        return Plan({b.key: window.end % 3 for b in window.buckets}, 1, {}, "scripted", False,
                    meet_next=window.end in self.ask)

    def state_dict(self) -> dict:
        return {"windows": list(self.windows)}

    def load_state_dict(self, state: dict) -> None:
        self.windows = [tuple(w) for w in state["windows"]]


def _late_decisions(rank: int, world_size: int) -> dict:
    candidates = ("none", "fp16", "topk:ratio=0.1")

    def run(reducer, steps):
        out = []
        for step in steps:
            time.sleep(0.003 * rank * (step % 3))  # uneven compute per rank
            futs = {k: reducer.reduce(k, _grad(rank, step, k), step=step, shapes=SHAPES[k]) for k in SHAPES}
            out.append((dict(reducer.choices), {k: f.wait() for k, f in futs.items()}))
        return out

    out = {}
    for name, late, ask in (("at_once", False, ()), ("late", True, ()), ("meets", True, (5, 8))):
        straight = AutoReducer(candidates, _Scripted(late, ask))
        out[name] = (run(straight, range(12)), straight.controller.windows)
    # resumed from a state taken while a late decision's figures are in flight (those of step 7)
    first = AutoReducer(candidates, _Scripted(True, (5, 8)))
    run(first, range(8))
    state = first.state_dict()
    resumed = AutoReducer(candidates, _Scripted(True, (5, 8)))
    resumed.load_state_dict(state)
    out["resumed"] = (run(resumed, range(8, 12)), resumed.controller.windows)
    dist.barrier()
    return out


@pytest.mark.dist
def test_a_controller_that_decides_late_applies_each_plan_a_step_after_its_figures():
    results = run_ranks(_late_decisions, 2, timeout_s=120)
    for r in results:
        at_once, windows = r["at_once"]
        # the first window is steps 1-2; each decision applies at the end of its window, and
        # each after the first sends the probe the one before asked for
        assert windows == [(1, 3, True, False)] + [(s - 1, s, True, True) for s in range(4, 12)]
        assert [h[0].get(0, 0) for h in at_once] == [0, 0, 0] + [s % 3 for s in range(3, 12)]
        # only the first decision waits (no plan asks for a meeting): the figures of the window
        # ending at step s are read back, and its plan applied, at s + 1; no later window is
        # met, and no probe is sent (only right after a wait, where the ranks leave it together)
        late, windows = r["late"]
        assert windows == [(1, 3, True, False), (3, 4, True, False)] + [(s - 2, s - 1, False, False) for s in range(6, 12)]
        assert [h[0].get(0, 0) for h in late] == [0] * 4 + [(s - 1) % 3 for s in range(4, 12)]
        # the plans of the windows ending at 5 and 8, read back at 6 and 9, ask those steps to
        # wait: their own plan applies at once, after the late one read back there, with the
        # probe sent right after the wait, and they open a met window
        meets, windows = r["meets"]
        assert windows == [(1, 3, True, False), (3, 4, True, False), (4, 5, False, False), (5, 6, False, True),
                           (6, 7, True, False), (7, 8, False, False), (8, 9, False, True), (9, 10, True, False)]
        assert [h[0].get(0, 0) for h in meets] == [0, 0, 0] + [(s if s % 3 == 0 else s - 1) % 3 for s in range(3, 12)]
        resumed, resumed_windows = r["resumed"]
        assert resumed_windows == windows
        for (choices_a, values_a), (choices_b, values_b) in zip(meets[8:], resumed):
            assert choices_a == choices_b
            assert all(torch.equal(values_a[k], values_b[k]) for k in SHAPES)
    for name in ("late", "meets"):
        for (a, va), (b, vb) in zip(results[0][name][0], results[1][name][0]):
            assert a == b and all(torch.equal(va[k], vb[k]) for k in SHAPES)  # every rank alike


def _rollback_over_a_skipped_switch(rank: int, world_size: int) -> dict:
    """The switch of both buckets from Top-K to int8 at step 4 skipped for a NaN on rank 1, then the
    state saved at step 4 loaded into the same reducer and steps 4-5 retaken clean (the first
    window, whose decision would depend on timings, ends at step 6): the outputs and what the
    ranks still owe must equal those of a run that never saw the NaN."""
    def run(reducer, steps, spoil_at=None):
        outs = []
        for step in steps:
            grads = {k: _grad(rank, step, k) for k in SHAPES}
            if step == spoil_at and rank == 1:
                grads[0][3] = float("nan")
            outs.append({k: reducer.reduce(k, g, step=step, shapes=SHAPES[k]).wait() for k, g in grads.items()})
        return outs

    def make():
        reducer = _auto(("topk:ratio=0.1", "int8:group=16"))
        reducer.force(2, {0: "topk:ratio=0.1", 1: "topk:ratio=0.1"})
        reducer.force(4, {0: "int8:group=16", 1: "int8:group=16"})
        return reducer

    clean = make()
    clean_outs = run(clean, range(6))
    clean.settle()
    reducer = make()
    run(reducer, range(4))
    saved = copy.deepcopy(reducer.state_dict())
    skipped = run(reducer, [4], spoil_at=4)[0]
    reducer.load_state_dict(saved)
    reducer.force(4, {0: "int8:group=16", 1: "int8:group=16"})  # forcing is not state: the skipped step used it
    retaken = run(reducer, range(4, 6))
    reducer.settle()
    dist.barrier()
    return {"skipped": bool(torch.isnan(skipped[0]).all()),
            "outputs": all(torch.equal(a[k], b[k]) for a, b in zip(clean_outs[4:], retaken) for k in SHAPES),
            "owed": all(torch.equal(clean.residual(k), reducer.residual(k)) for k in SHAPES),
            "carried": bool(saved["carry"]) or any(clean.residual(k) is not None for k in SHAPES)}


@pytest.mark.dist
def test_a_rollback_over_a_skipped_switch_retakes_it_as_a_clean_run():
    for r in run_ranks(_rollback_over_a_skipped_switch, 2, timeout_s=120):
        assert r["skipped"] and r["carried"]
        assert r["outputs"] and r["owed"]
