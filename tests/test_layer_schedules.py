"""The per-layer schedules on real gloo ranks: every rank plans the same codec for every layer at
the same step and ends with the same tensors, and a run resumed from the reducer's state goes on
exactly as the uninterrupted one."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from gradzip.control.layer_reducer import LayerAutoReducer
from gradzip.control.schedules import layer_controller
from gradzip.metrics import StepMetrics
from gradzip.testing import run_ranks

pytestmark = pytest.mark.dist

SHAPES = {0: [(16, 8), (8,), (24, 12)], 1: [(32, 4), (4,)]}
SCHEDULES = {
    # a 1 ms target on loopback: the budget makes Kimad compress some layers
    "kimad": {"levels": "0.5/0.1/0.02", "target_ms": 1, "error_every": 3},
    "legacy": {"splits": "100", "policy": "0.5/0.1|0.2/0.05"},
    # rank probe, warm-up and the windowed controller within the run
    "edgc": {"window": 4, "sample_every": 2, "probe_steps": 3, "warmup_steps": 0},
}
STEPS = 24


def _grad(rank: int, step: int, key: int) -> torch.Tensor:
    numel = sum(torch.Size(s).numel() for s in SHAPES[key])
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + key)
    return torch.randn(numel, generator=gen) / (1 + step) ** 0.5


def _make(name: str, params: dict, metrics: StepMetrics) -> LayerAutoReducer:
    return LayerAutoReducer(layer_controller(name, params, total_steps=STEPS), metrics=metrics)


def _run(reducer: LayerAutoReducer, rank: int, steps: range, metrics: StepMetrics, *, uneven: bool = False):
    history = []
    for step in steps:
        if uneven:
            time.sleep(0.002 * rank * (step % 3))  # uneven compute per rank
        futs = {k: reducer.reduce(k, _grad(rank, step, k), step=step, shapes=SHAPES[k]) for k in SHAPES}
        values = {k: f.wait() for k, f in futs.items()}
        record = metrics.pop()
        plans = {k: tuple(layer["codec"] for layer in record["buckets"][k]["layers"]) for k in SHAPES}
        history.append((plans, values))
    return history


def _ranks(rank: int, world_size: int) -> dict:
    out = {}
    for name, params in SCHEDULES.items():
        metrics = StepMetrics()
        reducer = _make(name, params, metrics)
        out[name] = _run(reducer, rank, range(STEPS), metrics, uneven=True)
        out[name + " decided"] = [e["step"] for e in metrics.events if e["kind"] == "auto"]
    # resume: LEGACY, and EDGC past its probe (r_max given), from a state taken mid-run
    for name, params in (("legacy", SCHEDULES["legacy"]), ("edgc", {**SCHEDULES["edgc"], "max_rank": 4})):
        metrics = StepMetrics()
        straight = _run(_make(name, params, metrics), rank, range(STEPS), metrics)
        first = _make(name, params, metrics)
        _run(first, rank, range(11), metrics)
        state = first.state_dict()
        resumed = _make(name, params, metrics)
        resumed.load_state_dict(state)
        out[name + " resume"] = (straight[11:], _run(resumed, rank, range(11, STEPS), metrics))
    dist.barrier()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_plans_alike_and_resumes_exactly(world_size):
    results = run_ranks(_ranks, world_size, timeout_s=240)
    for name in SCHEDULES:
        histories = [r[name] for r in results]
        for step in range(STEPS):
            plans = [h[step][0] for h in histories]
            assert all(p == plans[0] for p in plans), (name, step, plans)
            for key in SHAPES:
                assert all(torch.equal(h[step][1][key], histories[0][step][1][key]) for h in histories), (name, step)
        assert all(r[name + " decided"] == results[0][name + " decided"] for r in results)
        seen = {tuple(sorted(h[0].items())) for h in histories[0]}
        assert len(seen) >= 2, f"{name} never changed its plan in {STEPS} steps"
    # LEGACY: the 100-element threshold and the phase at step 12, by hand
    legacy = results[0]["legacy"]
    assert legacy[0][0][0] == ("topk:ratio=0.1", "topk:ratio=0.5", "topk:ratio=0.1")
    assert legacy[12][0][0] == ("topk:ratio=0.05", "topk:ratio=0.2", "topk:ratio=0.05")
    assert any("powersgd" in spec for plan in (h[0][0] for h in results[0]["edgc"]) for spec in plan)
    for r in results:
        for name in ("legacy", "edgc"):
            straight, resumed = r[name + " resume"]
            for (plans_a, values_a), (plans_b, values_b) in zip(straight, resumed):
                assert plans_a == plans_b
                assert all(torch.equal(values_a[k], values_b[k]) for k in SHAPES), name
