"""DGC's training tricks: momentum correction, local clipping, factor masking, sparsity warm-up."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.comm.reference import simulate_ranks
from gradzip.comm.traffic import choose_collective, plan_chunks
from gradzip.comm.warmup import WarmupReducer
from gradzip.compressors import build
from gradzip.compressors.spec import split_training_options
from gradzip.control.sparsity import warmup_ratio
from gradzip.feedback import DGCMemory, ErrorFeedback
from gradzip.testing import run_ranks


def reference_dgc(grads_per_step, *, ratio, momentum, clip_norm):
    """Algorithm 1 of Lin et al. (arXiv 1712.01887) written out: per rank u, v, a top-k mask."""
    world_size = len(grads_per_step[0])
    numel = grads_per_step[0][0].numel()
    k = max(1, round(ratio * numel))
    u = [torch.zeros(numel, dtype=torch.float64) for _ in range(world_size)]
    v = [torch.zeros(numel, dtype=torch.float64) for _ in range(world_size)]
    means = []
    for grads in grads_per_step:
        sent = []
        for r, g in enumerate(grads):
            limit = clip_norm / math.sqrt(world_size)
            g = g * min(1.0, limit / float(g.norm()))
            u[r] = momentum * u[r] + g
            v[r] = v[r] + u[r]
            mask = torch.zeros(numel, dtype=torch.bool)
            mask[torch.topk(v[r].abs(), k).indices] = True
            sent.append(torch.where(mask, v[r], 0.0))
            v[r] = torch.where(mask, 0.0, v[r])
            u[r] = torch.where(mask, 0.0, u[r])
        means.append(sum(sent[1:], sent[0].clone()) / world_size)
    return means


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    world_size=st.integers(2, 3),
    momentum=st.floats(0.0, 0.95),
    ratio=st.sampled_from([0.05, 0.2, 0.5]),
)
def test_memory_with_topk_is_dgc_algorithm_1(seed, world_size, momentum, ratio):
    gen = torch.Generator().manual_seed(seed)
    steps = [[torch.randn(40, generator=gen, dtype=torch.float64) for _ in range(world_size)] for _ in range(5)]
    clip_norm = 3.0
    memories = [DGCMemory(momentum=momentum, clip_norm=clip_norm, world_size=world_size) for _ in range(world_size)]
    expected = reference_dgc(steps, ratio=ratio, momentum=momentum, clip_norm=clip_norm)
    for step, grads in enumerate(steps):
        got = simulate_ranks(f"topk:ratio={ratio}", grads, step=step, feedback=memories, collective="allgather")
        torch.testing.assert_close(got, expected[step], rtol=1e-12, atol=1e-12)


def test_masking_zeroes_the_velocity_where_sent_and_keeps_the_rest():
    memory = DGCMemory(momentum=0.5)
    grad = torch.tensor([4.0, 1.0, -3.0, 0.5])
    compensated = memory.compensate(0, grad, step=0)
    decoded = torch.tensor([4.0, 0.0, -3.0, 0.0])  # what a top-2 sent
    memory.update(0, compensated, decoded, step=0)
    assert torch.equal(memory.velocities[0], torch.tensor([0.0, 1.0, 0.0, 0.5]))
    assert torch.equal(memory.residuals[0], torch.tensor([0.0, 1.0, 0.0, 0.5]))
    # next step: u = 0.5 * u + g, v = v + u
    again = memory.compensate(0, torch.ones(4), step=1)
    assert torch.equal(again, torch.tensor([1.0, 2.5, 1.0, 1.75]))
    unmasked = DGCMemory(momentum=0.5, masking=False)
    unmasked.update(0, unmasked.compensate(0, grad, step=0), decoded, step=0)
    assert torch.equal(unmasked.velocities[0], grad)


def test_local_clipping_scales_the_threshold_by_world_size():
    memory = DGCMemory(momentum=0.0, clip_norm=2.0, world_size=4)
    clipped = memory.compensate(0, torch.full((16,), 10.0), step=0)
    assert math.isclose(float(clipped.norm()), 2.0 / math.sqrt(4), rel_tol=1e-6)
    small = torch.full((4,), 0.1)
    assert torch.equal(DGCMemory(clip_norm=2.0, world_size=4).compensate(0, small, step=0), small)


def test_memory_state_dict_round_trip_and_shape_change():
    memory = DGCMemory(momentum=0.9)
    c = memory.compensate("b", torch.arange(6.0), step=0)
    memory.update("b", c, torch.zeros(6), step=0)
    restored = DGCMemory(momentum=0.9)
    restored.load_state_dict(memory.state_dict())
    assert torch.equal(restored.compensate("b", torch.ones(6), step=1), memory.compensate("b", torch.ones(6), step=1))
    with pytest.warns(UserWarning, match="changed shape"):
        fresh = memory.compensate("b", torch.ones(3), step=2)
    assert torch.equal(fresh, torch.ones(3))


@pytest.mark.parametrize(
    "kwargs, name",
    [({"momentum": 1.0}, "momentum"), ({"clip_norm": 0.0}, "clip_norm"), ({"world_size": 0}, "world_size")],
)
def test_memory_bad_values(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DGCMemory(**kwargs)


def test_warmup_ratio_is_dgc_schedule():
    sparsity = [1 - warmup_ratio(s, ratio=0.001, warmup_steps=400) for s in (0, 99, 100, 200, 300, 399, 400, 10**6)]
    expected = [0.75, 0.75, 0.9375, 0.984375, 0.996, 0.996, 0.999, 0.999]
    for got, want in zip(sparsity, expected):
        assert abs(got - want) < 2e-3
    assert warmup_ratio(0, ratio=0.01, warmup_steps=0) == 0.01
    ratios = [warmup_ratio(s, ratio=0.01, warmup_steps=50, stages=3) for s in range(60)]
    assert all(a >= b for a, b in zip(ratios, ratios[1:]))  # never loosens


@pytest.mark.parametrize(
    "kwargs, name",
    [({"ratio": 0.0}, "ratio"), ({"warmup_steps": -1}, "warmup_steps"), ({"stages": 0}, "stages"), ({"step": -1}, "step")],
)
def test_warmup_ratio_bad_values(kwargs, name):
    args = {"step": 0, "ratio": 0.01, "warmup_steps": 10, "stages": 4, **kwargs}
    step = args.pop("step")
    with pytest.raises(ValueError, match=name):
        warmup_ratio(step, **args)


def test_split_training_options():
    assert split_training_options("dgc:ratio=0.001,warmup_steps=100,clip_norm=1.5") == (
        "dgc:ratio=0.001", {"warmup_steps": 100, "clip_norm": 1.5}
    )
    assert split_training_options("topk:ratio=0.01") == ("topk:ratio=0.01", {})
    assert split_training_options("none") == ("none", {})


def test_warmup_reducer_bad_values():
    with pytest.raises(ValueError, match="need a codec with a ratio"):
        WarmupReducer(build("fp16"), warmup_steps=10)
    with pytest.raises(ValueError, match="warmup_steps"):
        WarmupReducer(build("topk:ratio=0.01"), warmup_steps=-1)
    with pytest.raises(ValueError, match="clip_norm"):
        WarmupReducer(build("topk:ratio=0.01"), clip_norm=0)


def _ranks_warmup(rank: int, world_size: int) -> dict:
    spec, warm, clip = "topk:ratio=0.01", 6, 2.0

    def grad_at(r: int, step: int) -> torch.Tensor:
        return torch.randn(3000, generator=torch.Generator().manual_seed(100 * step + r))

    reducer = WarmupReducer(build(spec), warmup_steps=warm, warmup_stages=3, clip_norm=clip)
    means, nbytes, saved = [], [], None
    for step in range(9):
        if step == 4:
            saved = copy.deepcopy(reducer.state_dict())
        means.append(reducer.reduce(0, grad_at(rank, step), step=step).wait())
        nbytes.append(reducer.options["metrics"].pop()["payload_bytes"])
    resumed = WarmupReducer(build(spec), warmup_steps=warm, warmup_stages=3, clip_norm=clip)
    resumed.load_state_dict(saved)
    again = [resumed.reduce(0, grad_at(rank, step), step=step).wait() for step in range(4, 9)]
    return {"means": means, "bytes": nbytes, "resumed": again}


def test_warmup_reducer_on_gloo_ranks_keeps_its_residuals_across_ratios():
    world_size, warm = 2, 6
    results = run_ranks(_ranks_warmup, world_size)
    # the reference: one error-feedback memory per rank (and per server chunk) across the
    # whole run, the codec's ratio following the schedule, gradients clipped to 2 / sqrt(2)
    feedback = [ErrorFeedback() for _ in range(world_size)]
    server = [ErrorFeedback() for _ in range(world_size)]
    for step in range(9):
        ratio = warmup_ratio(step, ratio=0.01, warmup_steps=warm, stages=3)
        grads = []
        for r in range(world_size):
            g = torch.randn(3000, generator=torch.Generator().manual_seed(100 * step + r))
            grads.append(g * min(1.0, 2.0 / math.sqrt(world_size) / float(g.norm())))
        expected = simulate_ranks(f"topk:ratio={ratio}", grads, step=step, key=0, feedback=feedback, server_feedback=server)
        for result in results:
            assert torch.equal(result["means"][step], expected), step
        # the payload of the codec at this step's ratio, on the route the reducer picks
        codec = build(f"topk:ratio={ratio}")
        route = choose_collective("auto", codec, 3000, torch.float32, world_size)
        payload = plan_chunks(codec, 3000, torch.float32, world_size).total_payload_nbytes
        assert results[0]["bytes"][step] == (payload if route == "twophase" else codec.payload_nbytes(3000)), step
    for result in results:
        assert all(torch.equal(a, b) for a, b in zip(result["resumed"], result["means"][4:]))
