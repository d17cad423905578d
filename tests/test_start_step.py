"""``start_step=N``, which every codec takes: dense exchanges before step N, the codec after.

On spawned gloo ranks (2 and 3): the DDP reducer on every route (all_gather, two-phase,
all_reduce, a composition) and FSDP's compressed reduce-scatter. Before ``start_step`` each
rank must hold the exact mean, report a dense collective with the raw bytes, and keep no
residual; from ``start_step`` on, the result must equal the single-process reference fed the
same steps, bit-identical on every rank.
"""

import pytest
import torch
import torch.distributed as dist

from gradzip.comm import make_reducer
from gradzip.comm.reference import simulate_ranks
from gradzip.compressors import SpecError, build
from gradzip.feedback import ErrorFeedback
from gradzip.fsdp import CompressedReduceScatter
from gradzip.metrics import StepMetrics
from gradzip.testing import run_ranks

NUMEL = 1001
STEPS = 4
CASES = [
    ("topk:ratio=0.1,start_step=2", "allgather"),
    ("efsignsgd:start_step=2", "twophase"),
    ("randomk:ratio=0.2,start_step=1", "allreduce"),
    ("topk:ratio=0.1,start_step=3+uniform:bits=8", "auto"),
]
FSDP_SPEC = "efsignsgd:start_step=2"


def _grad(rank: int, step: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 * step + rank)) * (1 + rank)


def _on_ranks(rank: int, world_size: int) -> dict:
    out = {}
    for spec, collective in CASES:
        reducer = make_reducer(spec, collective=collective)
        for step in range(STEPS):
            got = reducer.reduce("b", _grad(rank, step), step=step).wait()
            bucket = reducer.metrics.pop()["buckets"]["b"]
            residual = None if reducer.feedback is None else reducer.feedback.residuals.get("b")
            out[(spec, step)] = {
                "got": got, "route": bucket["collective"], "payload_bytes": bucket["payload_bytes"],
                "has_residual": residual is not None,
            }
    comm = CompressedReduceScatter(build(FSDP_SPEC), name="m", metrics=StepMetrics())
    for step in range(STEPS):
        output = torch.empty(NUMEL)
        comm(output, torch.cat([_grad(rank, step)] * world_size), dist.group.WORLD, dist.ReduceOp.AVG)
        out[("fsdp", step)] = {"got": output, "exchange": comm.last_exchange}
    return out


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request):
    return request.param, run_ranks(_on_ranks, request.param, timeout_s=180)


def test_reducer_is_dense_before_start_step_and_the_codec_after(ranks):
    world_size, results = ranks
    for spec, collective in CASES:
        codec = build(spec)
        use_feedback = codec.error_feedback
        feedback = [ErrorFeedback() for _ in range(world_size)] if use_feedback else None
        server = [ErrorFeedback() for _ in range(world_size)] if use_feedback else None
        for step in range(STEPS):
            grads = [_grad(r, step) for r in range(world_size)]
            got = [results[r][(spec, step)] for r in range(world_size)]
            for r in range(1, world_size):
                assert torch.equal(got[r]["got"], got[0]["got"]), (spec, step)
            want = simulate_ranks(spec, grads, step=step, key="b", feedback=feedback, server_feedback=server,
                                  collective=collective)
            if step < codec.start_step:
                exact = torch.stack(grads).double().mean(0).float()
                torch.testing.assert_close(got[0]["got"], exact, msg=f"{spec} step {step}")
                assert got[0]["route"] == "dense", (spec, step)
                assert got[0]["payload_bytes"] == NUMEL * 4, (spec, step)
                assert not got[0]["has_residual"], (spec, step)
            else:
                assert got[0]["route"] != "dense", (spec, step)
                assert got[0]["has_residual"] == use_feedback, (spec, step)
                torch.testing.assert_close(got[0]["got"], want, rtol=1e-6, atol=1e-6, msg=f"{spec} step {step}")
                # The compressed result is not the exact mean (the codec dropped something).
                assert not torch.allclose(got[0]["got"], torch.stack(grads).mean(0)), (spec, step)


def test_fsdp_reduce_scatter_is_dense_before_start_step(ranks):
    world_size, results = ranks
    start = build(FSDP_SPEC).start_step
    for step in range(STEPS):
        exact = torch.stack([_grad(r, step) for r in range(world_size)]).double().mean(0).float()
        for r in range(world_size):
            got = results[r][("fsdp", step)]
            if step < start:
                assert got["exchange"] != "all_to_all", step
                torch.testing.assert_close(got["got"], exact, msg=f"step {step}")
            else:
                assert got["exchange"] == "all_to_all", step
                assert not torch.allclose(got["got"], exact), step


def test_every_codec_takes_start_step_and_keeps_it_in_its_spec():
    for spec, start in [("topk:ratio=0.01,start_step=20", 20), ("natural:start_step=1", 1),
                        ("powersgd:approx_rank=2,start_step=5", 5), ("topk:start_step=4+uniform:bits=4", 4)]:
        codec = build(spec)
        assert codec.start_step == start
        assert build(codec.spec).start_step == start
        assert f"start_step={start}" in codec.spec
    assert "start_step" not in build("signsgd:start_step=0").spec
    assert build("signsgd").start_step == 0


@pytest.mark.parametrize("bad", ["topk:start_step=-1", "efsignsgd:start_step=1.5", "uniform:start_step=true"])
def test_start_step_out_of_range_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match="start_step"):
        build(bad)


def test_unknown_parameter_lists_start_step_among_the_allowed():
    with pytest.raises(SpecError, match="start_step"):
        build("signsgd:ratio=0.1")
