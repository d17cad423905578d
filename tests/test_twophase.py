"""Two-phase compressed all_reduce and the choice of collective, in one process.

The byte formulas are checked against hand-computed figures; the single-process reference
(``simulate_ranks``) against the exact mean and the error-feedback identity. The spawned gloo
ranks are in ``test_twophase_ranks.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.comm import make_reducer
from gradzip.comm.reference import simulate_ranks
from gradzip.comm.routes import check_collective, choose_collective
from gradzip.comm.traffic import allgather_bytes, allreduce_bytes, chunk_sizes, plan_chunks
from gradzip.compressors import build, list_compressors
from gradzip.ddp import CompressionState
from gradzip.feedback import ErrorFeedback

SINGLE_ROUND = [name for name in list_compressors() if not build(name).multi_round]


def test_chunk_sizes_cut_like_tensor_split():
    assert chunk_sizes(10, 4) == (3, 3, 2, 2)
    assert chunk_sizes(2, 4) == (1, 1, 0, 0)
    assert chunk_sizes(0, 3) == (0, 0, 0)
    for numel, world_size in [(10, 4), (7, 3), (2, 4), (1000, 8)]:
        expected = tuple(c.numel() for c in torch.arange(numel).tensor_split(world_size))
        assert chunk_sizes(numel, world_size) == expected


def test_byte_formulas_by_hand():
    topk = build("topk:ratio=0.1")
    # 1000 fp32 elements on 4 ranks. Chunks of 250: k = 25, values 4 bytes + uint8 indices.
    plan = plan_chunks(topk, 1000, torch.float32, 4)
    assert plan.sizes == (250,) * 4 and plan.payload_nbytes == (125,) * 4
    assert plan.sent_bytes(0) == 3 * 125 + 3 * 125 == 750
    # The whole bucket: k = 100 with int16 indices, 600 bytes, all_gather-ed to 3 peers.
    assert allgather_bytes(topk.payload_nbytes(1000), 4) == 1800
    assert allreduce_bytes(4000, 4) == 6000
    # An uneven cut: 10 elements on 4 ranks, chunks 3, 3, 2, 2, k = 1 each (4 + 1 bytes).
    plan = plan_chunks(topk, 10, torch.float32, 4)
    assert plan.payload_nbytes == (5, 5, 5, 5)
    plan = plan_chunks(topk, 2, torch.float32, 4)
    assert plan.payload_nbytes == (5, 5, 0, 0)
    assert plan.sent_bytes(0) == 5 + 3 * 5 and plan.sent_bytes(3) == 10


def test_auto_picks_by_bytes():
    topk, none, fp16 = build("topk:ratio=0.01"), build("none"), build("fp16")
    f32 = torch.float32
    assert choose_collective("auto", none, 10_000, f32, 8) == "allreduce"
    assert choose_collective("auto", fp16, 10_000, f32, 8) == "allreduce"
    # Aggregatable payloads stay on all_reduce even where per-chunk rounding would make two
    # phases a few bytes smaller (Random-K 1% of 1000 on 3 ranks: 3 + 3 + 3 values against 10).
    randomk = build("randomk:ratio=0.01")
    assert plan_chunks(randomk, 1000, f32, 3).total_payload_nbytes < randomk.payload_nbytes(1000)
    assert choose_collective("auto", randomk, 1000, f32, 3) == "allreduce"
    # Two ranks: all_gather and two phases send the same bytes; one round wins the tie.
    assert choose_collective("auto", topk, 10_000, f32, 2) == "allgather"
    for world_size in (3, 4, 8):
        assert choose_collective("auto", topk, 100_000, f32, world_size) == "twophase"
    # 1 element: Top-K's 4 + 1 bytes exceed the 4 raw bytes, so the bucket goes dense.
    assert choose_collective("auto", topk, 1, f32, 4) == "dense"
    assert choose_collective("twophase", topk, 1, f32, 4) == "dense"
    assert choose_collective("allgather", topk, 100_000, f32, 8) == "allgather"
    # Dense beats all_gather of a 30% Top-K at 8 ranks (7 * 0.3 * 8 B > 2 * 7/8 * 4 B per element).
    assert choose_collective("auto", build("topk:ratio=0.3"), 100_000, f32, 8) in ("twophase", "dense")
    assert choose_collective("auto", build("topk:ratio=0.3"), 100_000, f32, 8) != "allgather"


def test_forced_collectives_validated():
    with pytest.raises(ValueError, match="aggregatable"):
        check_collective("allreduce", build("topk"))
    with pytest.raises(ValueError, match="collective must be one of"):
        check_collective("ring", build("none"))
    with pytest.raises(ValueError, match="aggregatable"):
        CompressionState("topk:ratio=0.01", collective="allreduce")
    with pytest.raises(ValueError, match="min_compress_bytes"):
        CompressionState("topk:ratio=0.01", min_compress_bytes=-1)
    with pytest.raises(ValueError, match="collective must be auto"):
        make_reducer("powersgd", collective="twophase")


def _integer_grads(world_size: int, numel: int, seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(-50, 50, (numel,), generator=gen).to(dtype) for _ in range(world_size)]


@settings(max_examples=40, deadline=None)
@given(world_size=st.integers(1, 5), numel=st.integers(0, 40), seed=st.integers(0, 1000))
def test_two_phase_identity_is_the_exact_mean(world_size, numel, seed):
    # Integer values: every summation order gives the same sum, so the mean is exact.
    grads = _integer_grads(world_size, numel, seed)
    got = simulate_ranks("none", grads, collective="twophase")
    assert torch.equal(got, torch.stack(grads).sum(0) / world_size)


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(SINGLE_ROUND),
    world_size=st.integers(1, 5),
    numel=st.integers(0, 60),
    seed=st.integers(0, 1000),
)
def test_two_phase_keeps_shape_dtype_and_finiteness(name, world_size, numel, seed):
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(3, numel, generator=gen) for _ in range(world_size)]
    codec = build(name)
    fb = [ErrorFeedback() for _ in range(world_size)] if codec.error_feedback else None
    sfb = [ErrorFeedback() for _ in range(world_size)] if codec.error_feedback else None
    got = simulate_ranks(codec, grads, collective="twophase", feedback=fb, server_feedback=sfb)
    assert got.shape == grads[0].shape and got.dtype == grads[0].dtype
    assert torch.isfinite(got).all()


# Random-K at its default 1% keeps one element of a 51-element chunk: it converges, but over
# thousands of steps; at 10% the same law shows within the test's horizon.
EF_SPECS = ["topk:ratio=0.05"] + [
    "randomk:ratio=0.1" if n == "randomk" else n for n in SINGLE_ROUND if build(n).error_feedback
]


@pytest.mark.slow
@pytest.mark.parametrize("spec", EF_SPECS)
def test_error_feedback_identity_and_convergence(spec):
    """sum of applied + mean worker residual + server residuals == sum of true means, exactly
    (up to float64 rounding), so the applied sum converges to the true sum as steps grow."""
    world_size, numel = 4, 203  # chunks of 51, 51, 51, 50
    codec = build(spec)
    fb = [ErrorFeedback() for _ in range(world_size)]
    sfb = [ErrorFeedback() for _ in range(world_size)]
    gen = torch.Generator().manual_seed(0)
    drift = torch.randn(numel, generator=gen, dtype=torch.float64)
    applied = torch.zeros(numel, dtype=torch.float64)
    true = torch.zeros(numel, dtype=torch.float64)
    gaps, norms = {}, {}
    for step in range(240):
        grads = [drift + torch.randn(numel, generator=gen, dtype=torch.float64) for _ in range(world_size)]
        applied += simulate_ranks(codec, grads, step=step, key="b", feedback=fb, server_feedback=sfb, collective="twophase")
        true += torch.stack(grads).mean(0)
        worker = torch.stack([f.residuals["b"] for f in fb]).mean(0)
        server = torch.cat([sfb[j].residuals["b"] for j in range(world_size)])
        torch.testing.assert_close(applied + worker + server, true, rtol=1e-9, atol=1e-9)
        if step + 1 in (60, 120, 240):
            gaps[step + 1] = float((applied - true).norm() / true.norm())
            norms[step + 1] = (max(float(f.residuals["b"].norm()) for f in fb), float(server.norm()))
    # Residuals level off (doubling the steps less than doubles them), so the gap shrinks ~1/steps
    # (over 240 steps: scaled signs contract slowly and level off later than Top-K).
    assert norms[240][0] < 2 * norms[120][0] and norms[240][1] < 2 * norms[120][1]
    assert gaps[240] < 0.6 * gaps[60]


def test_state_dict_carries_server_feedback():
    state = CompressionState("topk:ratio=0.1", collective="twophase")
    saved = state.state_dict()["reducer"]
    assert "server_feedback" in saved and "feedback" in saved
    state.reducer.twophase.server_feedback.residuals["b"] = torch.ones(3)
    restored = CompressionState("topk:ratio=0.1", collective="twophase")
    restored.load_state_dict(state.state_dict())
    assert torch.equal(restored.reducer.twophase.server_feedback.residuals["b"], torch.ones(3))
