"""Runs of the per-layer exchange (gradzip.comm.layered) on gloo ranks, and its reference: each
layer through its own codec's route, in one process."""

from __future__ import annotations

import torch

from gradzip.comm.layered import LayeredReducer, offsets_of
from gradzip.comm.routes import REGISTRY
from gradzip.compressors import build
from gradzip.feedback import ErrorFeedback
from gradzip.metrics import StepMetrics

SHAPES = [torch.Size(s) for s in [(16, 8), (8,), (32, 4), (5,), (12, 6)]]
NUMEL = sum(s.numel() for s in SHAPES)
PLANS = [
    ("topk:ratio=0.25", "none", "fp16", "randomk:ratio=0.5", "qsgd:bits=4"),
    ("topk:ratio=0.1", "none", "topk:ratio=0.5", "none", "none"),  # ratios change, residuals stay
    ("fp16", "fp16", "fp16", "fp16", "fp16"),  # everything owed is sent, at fp16
    ("none", "none", "none", "none", "none"),  # nothing owed: the bucket goes as one layer
    ("fp16", "fp16", "fp16", "fp16", "fp16"),  # likewise, cast
]
LOW_RANK = ("powersgd:approx_rank=2", "none", "powersgd:approx_rank=1", "none", "powersgd:approx_rank=3")


def grad(rank: int, step: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 * rank + step)) * (1 + rank)


def layered_rank(rank: int, world_size: int) -> dict:
    """The plans above on one bucket, then a low-rank plan ending dense, on this rank."""
    metrics = StepMetrics(monitor_every=1)
    reducer = LayeredReducer(metrics=metrics)
    outs, records = [], []
    for step, plan in enumerate(PLANS):
        reducer.set_plan(0, plan)
        outs.append(reducer.reduce(0, grad(rank, step), step=step, shapes=SHAPES).wait())
        records.append(metrics.pop())
    low = LayeredReducer(metrics=metrics)
    low_outs = []
    for step in range(4):
        # rank plan for 3 steps, then dense: what PowerSGD still owed goes out with it
        low.set_plan(7, LOW_RANK if step < 3 else ("none",) * len(SHAPES))
        low_outs.append(low.reduce(7, grad(rank, 10 + step), step=step, shapes=SHAPES).wait())
        records.append(metrics.pop())
    return {"outs": outs, "records": records, "low_outs": low_outs,
            "residual": reducer.residual(0, SHAPES), "low_residual": low.residual(7, SHAPES)}


def reference(world_size: int) -> list[torch.Tensor]:
    """Each layer through its own codec's route reference, with one memory per rank."""
    feedback = [ErrorFeedback() for _ in range(world_size)]
    outs = []
    for step, plan in enumerate(PLANS):
        grads = [grad(r, step) for r in range(world_size)]
        out = torch.empty(NUMEL)
        for i, (spec, shape, o) in enumerate(zip(plan, SHAPES, offsets_of(SHAPES))):
            layer = [g[o : o + shape.numel()] for g in grads]
            codec = build(spec)
            if spec == "none" or not codec.error_feedback:  # sent with what the rank still owed the layer
                layer = [feedback[r].compensate((0, i), x, step=step) for r, x in enumerate(layer)]
                for f in feedback:
                    f.residuals.pop((0, i), None)
                if spec == "none":
                    out[o : o + shape.numel()] = sum(layer) / world_size
                    continue
            route = REGISTRY["allreduce" if codec.aggregatable else "allgather"]
            # error feedback only for the codecs that keep it (Top-K, Random-K; not fp16 or QSGD)
            memory = feedback if codec.error_feedback else None
            out[o : o + shape.numel()] = route.reference(codec, layer, step=step, key=(0, i), feedback=memory)[0]
        outs.append(out)
    return outs
