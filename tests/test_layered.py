"""A codec per layer inside a bucket (gradzip.comm.layered) on real gloo ranks: each layer's
result against the single-process reference of its own codec's route, the bytes and the number of
collectives per bucket, residuals that stay with their layer when the plan changes, and low-rank
plans with a rank per layer."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradzip.comm.layered import LayeredReducer, offsets_of
from gradzip.comm.routes import REGISTRY
from gradzip.comm.traffic import allgather_bytes, allreduce_bytes
from gradzip.compressors import build
from gradzip.feedback import ErrorFeedback
from gradzip.metrics import StepMetrics
from gradzip.testing import run_ranks

pytestmark = pytest.mark.dist

SHAPES = [torch.Size(s) for s in [(16, 8), (8,), (32, 4), (5,), (12, 6)]]
NUMEL = sum(s.numel() for s in SHAPES)
PLANS = [
    ("topk:ratio=0.25", "none", "fp16", "randomk:ratio=0.5", "qsgd:bits=4"),
    ("topk:ratio=0.1", "none", "topk:ratio=0.5", "none", "none"),  # ratios change, residuals stay
    ("none", "none", "none", "none", "none"),  # everything owed is sent
]
LOW_RANK = ("powersgd:approx_rank=2", "none", "powersgd:approx_rank=1", "none", "powersgd:approx_rank=3")


def _grad(rank: int, step: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 * rank + step)) * (1 + rank)


def _layered(rank: int, world_size: int) -> dict:
    metrics = StepMetrics(monitor_every=1)
    reducer = LayeredReducer(metrics=metrics)
    outs, records = [], []
    for step, plan in enumerate(PLANS):
        reducer.set_plan(0, plan)
        outs.append(reducer.reduce(0, _grad(rank, step), step=step, shapes=SHAPES).wait())
        records.append(metrics.pop())
    low = LayeredReducer(metrics=metrics)
    low_outs = []
    for step in range(4):
        # rank plan for 3 steps, then dense: what PowerSGD still owed goes out with it
        low.set_plan(7, LOW_RANK if step < 3 else ("none",) * len(SHAPES))
        low_outs.append(low.reduce(7, _grad(rank, 10 + step), step=step, shapes=SHAPES).wait())
        records.append(metrics.pop())
    dist.barrier()
    return {"outs": outs, "records": records, "low_outs": low_outs,
            "residual": reducer.residual(0, SHAPES), "low_residual": low.residual(7, SHAPES)}


def _reference(world_size: int) -> list[torch.Tensor]:
    """Each layer through its own codec's route reference, with one memory per rank."""
    feedback = [ErrorFeedback() for _ in range(world_size)]
    outs = []
    for step, plan in enumerate(PLANS):
        grads = [_grad(r, step) for r in range(world_size)]
        out = torch.empty(NUMEL)
        for i, (spec, shape, o) in enumerate(zip(plan, SHAPES, offsets_of(SHAPES))):
            layer = [g[o : o + shape.numel()] for g in grads]
            codec = build(spec)
            if spec == "none":  # sent with what the rank still owed the layer
                layer = [feedback[r].compensate((0, i), x, step=step) for r, x in enumerate(layer)]
                for f in feedback:
                    f.residuals.pop((0, i), None)
                out[o : o + shape.numel()] = sum(layer) / world_size
                continue
            route = REGISTRY["allreduce" if codec.aggregatable else "allgather"]
            out[o : o + shape.numel()] = route.reference(codec, layer, step=step, key=(0, i), feedback=feedback)[0]
        outs.append(out)
    return outs


@pytest.mark.parametrize("world_size", [2, 3])
def test_per_layer_payloads_decode_to_per_layer_results(world_size):
    results = run_ranks(_layered, world_size, timeout_s=120)
    reference = _reference(world_size)
    exact = world_size == 2  # beyond two ranks gloo sums in its own order
    for step, expected in enumerate(reference):
        for r in results:
            got = r["outs"][step]
            assert torch.equal(got, results[0]["outs"][step])
            if exact:
                assert torch.equal(got, expected), step
            else:
                assert torch.allclose(got, expected, rtol=0, atol=4e-3), step  # fp16 sums differ by 1 ulp
    # bytes handed to the collectives: fp32 part all_reduced, fp16 part all_reduced, the rest gathered
    record = results[0]["records"][0]["buckets"][0]
    codecs = [build(s) for s in PLANS[0]]
    payload = [c.payload_nbytes(s.numel()) for c, s in zip(codecs, SHAPES)]
    fp32 = payload[1] + payload[3]  # none, randomk (values; shared indices are never sent)
    expected_sent = allreduce_bytes(fp32, world_size) + allreduce_bytes(payload[2], world_size)
    expected_sent += allgather_bytes(payload[0] + payload[4], world_size)
    assert record["sent_bytes"] == expected_sent
    assert record["collectives"] == 3 and record["collective"] == "layered"
    assert [layer["payload_bytes"] for layer in record["layers"]] == payload
    assert [layer["codec"] for layer in record["layers"]] == list(PLANS[0])
    assert "quality" in record
    dense = results[0]["records"][2]["buckets"][0]
    assert dense["collectives"] == 1 and dense["sent_bytes"] == allreduce_bytes(NUMEL * 4, world_size)
    # the all-dense step sent every residual: nothing is owed
    assert all(r["residual"] is None for r in results)
    _check_low_rank(results, world_size)


def _check_low_rank(results, world_size):
    """A rank per layer; error feedback kept through the plan and sent whole by a dense step."""
    for step in range(4):
        assert torch.equal(results[0]["low_outs"][step], results[1]["low_outs"][step])
    first = results[0]["low_outs"][0]
    for i, (shape, o) in enumerate(zip(SHAPES, offsets_of(SHAPES))):
        layer = first[o : o + shape.numel()]
        spec = LOW_RANK[i]
        if spec == "none":
            mean = sum(_grad(r, 10)[o : o + shape.numel()] for r in range(world_size)) / world_size
            assert torch.allclose(layer, mean, rtol=1e-6, atol=1e-6)
        else:
            assert int(torch.linalg.matrix_rank(layer.view(shape[0], -1))) == int(spec.split("=")[1])
    layers = results[0]["records"][3]["buckets"][7]["layers"]
    assert [entry["codec"] for entry in layers] == list(LOW_RANK)
    # sum_t out_t = sum_t mean_r g_{r,t} once the last, dense step sent what PowerSGD owed
    total = sum(results[0]["low_outs"])
    expected = sum(sum(_grad(r, 10 + step) for r in range(world_size)) / world_size for step in range(4))
    assert torch.allclose(total, expected, rtol=1e-4, atol=1e-4)
    assert float((results[0]["low_outs"][0] - expected / 4).norm()) > 0.1  # compression did drop something
    assert all(r["low_residual"] is None for r in results)
