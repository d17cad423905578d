"""``int8`` layers in the per-layer exchange (gradzip.comm.layered) on real gloo ranks: each int8
layer decodes to the mean of the ranks' codes on scales agreed over every rank (against a
single-process reference written from the definition), the other layers of the same plan as
their own codecs give, residuals per layer across steps, bytes and collectives per bucket, and a
non-finite gradient on one rank turning every rank's result into NaN without a stray collective;
a bucket that changes exchange while another of the same step is still in flight with a NaN; an
fp64 gradient beyond fp32's range, which must stay finite; a bucket all at one int8 spec, coded
whole as the int8 codec's own reducer codes it, and its residual laid out per layer again when the
plan changes."""

from __future__ import annotations

import pytest
import torch

from gradzip.comm.int8sum import Int8SumReducer
from gradzip.comm.layered import LayeredReducer, offsets_of
from gradzip.comm.traffic import allgather_bytes, allreduce_bytes
from gradzip.compressors import build
from gradzip.keys import bucket_key
from gradzip.metrics import StepMetrics
from gradzip.testing import run_ranks

pytestmark = pytest.mark.dist

SHAPES = [torch.Size(s) for s in [(16, 20), (7,), (12, 9), (30,)]]
NUMEL = sum(s.numel() for s in SHAPES)
PLAN = ("int8:group=64", "none", "int8", "fp16")
STEPS = 3
NAN_STEP = 3  # after the exact steps: rank 1's gradient holds a NaN


def grad(rank: int, step: int) -> torch.Tensor:
    g = torch.randn(NUMEL, generator=torch.Generator().manual_seed(50 * rank + step)) * (1 + rank)
    if step == NAN_STEP and rank == 1:
        g[3] = float("nan")
    return g


def _rank(rank: int, world_size: int) -> dict:
    metrics = StepMetrics(monitor_every=1)
    reducer = LayeredReducer(metrics=metrics)
    reducer.set_plan(0, PLAN)
    outs, records = [], []
    for step in range(NAN_STEP + 2):
        outs.append(reducer.reduce(0, grad(rank, step), step=step, shapes=SHAPES).wait())
        records.append(metrics.pop())
    return {"outs": outs, "records": records, "switch": _switch_mid_step(rank), "fp64": _beyond_fp32(rank),
            "whole": _whole(rank), "relayout": _relayout(rank), "to_low_rank": _relayout_to_low_rank(rank)}


def _relayout_to_low_rank(rank: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Whole int8 under bucket (0, 1) at step 0; at step 1 DDP lays the bucket out as (1, 0) and
    the plan turns low-rank. Returns the sum of the outputs per parameter, the residual left
    after step 2 and each step's gradient: error feedback loses nothing when
    ``sum outputs + mean residual = sum mean gradients``."""
    shapes = {0: torch.Size([16, 20]), 1: torch.Size([12, 9])}
    reducer = LayeredReducer()
    total = {p: torch.zeros(shapes[p].numel(), dtype=torch.float64) for p in shapes}
    grads = []
    for step, params in enumerate([[0, 1], [1, 0], [1, 0]]):
        gen = torch.Generator().manual_seed(100 * rank + step)
        full = {p: torch.randn(shapes[p].numel(), generator=gen) for p in (0, 1)}
        grads.append({p: full[p].double() for p in full})
        key = bucket_key(params, [shapes[p].numel() for p in params])
        reducer.set_plan(key, ("int8:group=64",) * 2 if step == 0 else ("powersgd:approx_rank=2",) * 2)
        out = reducer.reduce(key, torch.cat([full[p] for p in params]), step=step,
                             shapes=[shapes[p] for p in params]).wait()
        for p, part in zip(params, out.split([shapes[p].numel() for p in params])):
            total[p] += part.double()
    reducer.settle()
    owed = reducer.residual(key, [shapes[1], shapes[0]]).double()
    return torch.cat([total[0], total[1]]), torch.cat([owed[shapes[1].numel():], owed[: shapes[1].numel()]]), grads


def _relayout(rank: int) -> dict:
    """DDP's buckets laid out anew while every layer is at int8, beside the int8 codec's own
    reducer on the same bucket keys and gradients: buckets (0, 1), (2, 3), then (0), (1, 2), (3)
    for two steps, then the first layout again. Bucket (1, 2) must take parameter 1's residual
    from where the one-layer bucket (0)'s regrouping left it and parameter 2's from the flat
    residual of the old bucket (2, 3)."""
    numels = {0: 100, 1: 70, 2: 90, 3: 50}
    layered, own = LayeredReducer(), Int8SumReducer(build("int8:group=64"))
    equal = []
    for step, layout in enumerate([[[0, 1], [2, 3]], [[0], [1, 2], [3]], [[0], [1, 2], [3]], [[0, 1], [2, 3]]]):
        gen = torch.Generator().manual_seed(1000 * rank + 10 * step)
        full = {p: torch.randn(numels[p], generator=gen) * (1 + rank) for p in numels}
        for params in layout:
            key = bucket_key(params, [numels[p] for p in params])
            layered.set_plan(key, ("int8:group=64",) * len(params))
            grad = torch.cat([full[p] for p in params])
            shapes = [torch.Size([numels[p]]) for p in params]
            mine = layered.reduce(key, grad, step=step, shapes=shapes).wait()
            equal.append(torch.equal(mine, own.reduce(key, grad, step=step).wait()))
    layered.settle()
    return {"equal": equal, "keys": sorted(map(str, layered.feedback.residuals))}


WHOLE = ("int8:group=64",) * len(SHAPES)
#: after the whole steps: int8 per layer beside none and fp16, whole again, then every layer dense
AFTER_WHOLE = [("int8:group=64", "none", "int8:group=64", "fp16"), WHOLE, ("none",) * len(SHAPES)]


def _whole(rank: int) -> dict:
    """Three steps all at ``int8:group=64`` beside the int8 codec's own reducer on the same
    gradients, then the plans of AFTER_WHOLE; the residual before each of those steps."""
    metrics = StepMetrics()
    layered, own = LayeredReducer(metrics=metrics), Int8SumReducer(build("int8:group=64"))
    layered.set_plan(0, WHOLE)
    outs, own_outs, records = [], [], []
    for step in range(3):
        outs.append(layered.reduce(0, grad(rank, 10 + step), step=step, shapes=SHAPES).wait())
        records.append(metrics.pop())
        own_outs.append(own.reduce(0, grad(rank, 10 + step), step=step).wait())
    own.settle()
    residuals, after = [], []
    for step, plan in enumerate(AFTER_WHOLE, start=3):
        layered.set_plan(0, plan)
        residuals.append(layered.residual(0, SHAPES))
        after.append(layered.reduce(0, grad(rank, 10 + step), step=step, shapes=SHAPES).wait())
    return {"outs": outs, "own_outs": own_outs, "records": records, "after": after, "residuals": residuals,
            "own_residual": own.feedback.residuals[0], "end": layered.residual(0, SHAPES)}


def _switch_mid_step(rank: int) -> tuple[list[bool], bool]:
    """Bucket A (int8 and Top-K layers) launched, not waited for (as under DDP), with a NaN in its
    Top-K layer on rank 1 at step 1, while bucket B moves to the low-rank exchange at that step:
    A's step must be put back on every rank, and A finite again from step 2."""
    shapes_a, shapes_b = [torch.Size((40,)), torch.Size((12,))], [torch.Size((8, 6)), torch.Size((5,))]
    reducer = LayeredReducer()
    reducer.set_plan("A", ("int8:group=8", "topk:ratio=0.5"))
    reducer.set_plan("B", ("none", "none"))
    finite = []
    for step in range(4):
        if step == 1:
            reducer.set_plan("B", ("powersgd:approx_rank=1", "none"))
        gen = torch.Generator().manual_seed(10 * rank + step)
        grad_a, grad_b = torch.randn(52, generator=gen) * (rank + 1), torch.randn(53, generator=gen)
        if step == 1 and rank == 1:
            grad_a[45] = float("nan")
        fut_a = reducer.reduce("A", grad_a, step=step, shapes=shapes_a)
        fut_b = reducer.reduce("B", grad_b, step=step, shapes=shapes_b)
        finite.append(bool(torch.isfinite(fut_a.wait()).all()))
        fut_b.wait()
    return finite, bool(torch.isfinite(reducer.residual("A", shapes_a)).all())


def _beyond_fp32(rank: int) -> torch.Tensor:
    """An fp64 int8 layer holding finite values beyond fp32's range, beside a dense one."""
    grad = torch.tensor([1e300, -2e300, 1.0, 5.0, 1.0, 2.0, 3.0, 4.0], dtype=torch.float64) * (rank + 1)
    reducer = LayeredReducer()
    reducer.set_plan(0, ("int8", "none"))
    return reducer.reduce(0, grad, step=0, shapes=[torch.Size((4,)), torch.Size((4,))]).wait()


def _int8_reference(layers: list[torch.Tensor], residuals: list[torch.Tensor], group: int) -> torch.Tensor:
    """One int8 layer over the ranks: compensate, agree each group's max |x| over ranks, round at
    floor(127 / W) levels, average the integer sum; ``residuals`` are updated in place."""
    world_size = len(layers)
    levels = 127 // world_size
    xs = [g + r for g, r in zip(layers, residuals)]
    numel = xs[0].numel()
    scales = torch.stack([
        torch.stack([x[i : i + group].abs().max() for i in range(0, numel, group)]) for x in xs
    ]).amax(dim=0)
    per_element = scales.repeat_interleave(group)[:numel]
    codes = [torch.round(x / per_element * levels) for x in xs]
    for r, x, c in zip(residuals, xs, codes):
        r.copy_(x - c / levels * per_element)
    return sum(codes) / (levels * world_size) * per_element


def reference(world_size: int) -> list[torch.Tensor]:
    residuals = {i: [torch.zeros(s.numel()) for _ in range(world_size)] for i, s in enumerate(SHAPES)}
    outs = []
    for step in range(STEPS):
        grads = [grad(r, step) for r in range(world_size)]
        out = torch.empty(NUMEL)
        for i, (spec, shape, o) in enumerate(zip(PLAN, SHAPES, offsets_of(SHAPES))):
            layer = [g[o : o + shape.numel()] for g in grads]
            if spec.startswith("int8"):
                out[o : o + shape.numel()] = _int8_reference(layer, residuals[i], build(spec).group)
            elif spec == "fp16":
                out[o : o + shape.numel()] = sum(x.half().float() / world_size for x in layer)
            else:
                out[o : o + shape.numel()] = sum(layer) / world_size
        outs.append(out)
    return outs


@pytest.mark.parametrize("world_size", [2, 3])
def test_int8_layers_sum_codes_on_agreed_scales(world_size):
    results = run_ranks(_rank, world_size, timeout_s=180)
    expected = reference(world_size)
    for step in range(STEPS):
        for r in results:
            assert torch.equal(r["outs"][step], results[0]["outs"][step]), step  # bit-identical on every rank
        got = results[0]["outs"][step]
        for spec, shape, o in zip(PLAN, SHAPES, offsets_of(SHAPES)):
            part, want = got[o : o + shape.numel()], expected[step][o : o + shape.numel()]
            if spec.startswith("int8"):
                # the integer sum is exact; the decode's division order may differ by an ulp
                assert torch.allclose(part, want, rtol=1e-6, atol=1e-7), (step, spec)
            else:
                assert torch.allclose(part, want, rtol=1e-3, atol=1e-3), (step, spec)
    # bytes handed to the collectives: the dense layer's fp32, the fp16 layer, int8 scales and codes
    record = results[0]["records"][0]["buckets"][0]
    codecs = [build(s) for s in PLAN]
    scales = 4 * (codecs[0].n_scales(SHAPES[0].numel()) + codecs[2].n_scales(SHAPES[2].numel()))
    codes = SHAPES[0].numel() + SHAPES[2].numel()
    want = allreduce_bytes(4 * SHAPES[1].numel(), world_size) + allreduce_bytes(2 * SHAPES[3].numel(), world_size)
    want += allreduce_bytes(scales, world_size) + allreduce_bytes(codes, world_size) + allgather_bytes(0, world_size)
    assert record["sent_bytes"] == want
    assert record["collectives"] == 4  # fp32 and fp16 all_reduces, the MAX, the codes' SUM
    assert [layer["payload_bytes"] for layer in record["layers"]] == [
        c.payload_nbytes(s.numel()) for c, s in zip(codecs, SHAPES)]
    assert record["layers"][0]["payload_bytes"] == SHAPES[0].numel() + 4 * 5  # 320 codes, 5 groups of 64
    assert "quality" in record
    # one rank's NaN: every rank returns all NaN, and the next step exchanges again
    for r in results:
        assert bool(torch.isnan(r["outs"][NAN_STEP]).all())
        assert bool(torch.isfinite(r["outs"][NAN_STEP + 1]).all())
        assert torch.equal(r["outs"][NAN_STEP + 1], results[0]["outs"][NAN_STEP + 1])
    for r in results:
        # a step put back on every rank, not kept with a NaN residual on the rank that had it
        assert r["switch"] == ([True, False, True, True], True)
        # saturated to fp32's range on every rank (the agreed scale, L codes each), not NaN
        fmax = torch.finfo(torch.float32).max
        mean = sum(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64) * (q + 1) for q in range(world_size))
        assert torch.equal(r["fp64"][:4], torch.tensor([fmax, -fmax, 0.0, 0.0], dtype=torch.float64))
        assert torch.allclose(r["fp64"][4:], mean / world_size, rtol=1e-12, atol=0)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_bucket_all_at_int8_is_coded_whole(world_size):
    results = run_ranks(_rank, world_size, timeout_s=180)
    whole = [r["whole"] for r in results]
    for r in results:
        # every bucket as the int8 codec's own reducer gives it, and one residual per bucket in the end
        assert r["relayout"]["equal"] == [True] * 10, r["relayout"]
        assert r["relayout"]["keys"] == [str(bucket_key([0, 1], [100, 70])), str(bucket_key([2, 3], [90, 50]))]
    # a re-layout at the step the plan turns low-rank: what int8 left moves to PowerSGD's memory
    out_sum, owed_mean = results[0]["to_low_rank"][0], sum(r["to_low_rank"][1] for r in results) / world_size
    grad_mean = sum(torch.cat([g[0], g[1]]) for r in results for g in r["to_low_rank"][2]) / world_size
    assert torch.allclose(out_sum + owed_mean, grad_mean, rtol=0, atol=1e-5)
    for w in whole:
        for step in range(3):
            # the int8 codec's own reducer, to the bit: groups over the flat bucket, one residual
            assert torch.equal(w["outs"][step], w["own_outs"][step]), step
            assert torch.equal(w["outs"][step], whole[0]["outs"][step]), step
        assert torch.equal(w["residuals"][0], w["own_residual"])
    record = whole[0]["records"][0]["buckets"][0]
    codec = build("int8:group=64")
    assert record["collectives"] == 2 and record["sent_bytes"] == (
        allreduce_bytes(4 * codec.n_scales(NUMEL), world_size) + allreduce_bytes(NUMEL, world_size))
    # 465 elements: groups start at 0, 64, ..., 448; a layer's bytes are its codes and the scales
    # of the groups starting in it (5 in [0, 320), one each in [320, 327), [327, 435), [435, 465))
    assert [layer["payload_bytes"] for layer in record["layers"]] == [320 + 20, 7 + 4, 108 + 4, 30 + 4]
    assert sum(layer["payload_bytes"] for layer in record["layers"]) == codec.payload_nbytes(NUMEL)
    # step 3: the whole residual, cut per layer, is what each layer owes under the per-layer plan
    grads = [grad(r, 13) for r in range(world_size)]
    owed = [w["residuals"][0] for w in whole]
    layer_residuals = []
    want = torch.empty(NUMEL)
    for spec, shape, o in zip(AFTER_WHOLE[0], SHAPES, offsets_of(SHAPES)):
        part = slice(o, o + shape.numel())
        layer = [g[part] for g in grads]
        residuals = [r[part].clone() for r in owed]
        if spec.startswith("int8"):
            want[part] = _int8_reference(layer, residuals, 64)
        elif spec == "fp16":
            want[part] = sum((x + r).half().float() / world_size for x, r in zip(layer, residuals))
            residuals = [torch.zeros_like(r) for r in residuals]
        else:
            want[part] = sum(x + r for x, r in zip(layer, residuals)) / world_size
            residuals = [torch.zeros_like(r) for r in residuals]
        layer_residuals.append(residuals)
    for q, w in enumerate(whole):
        for spec, shape, o in zip(AFTER_WHOLE[0], SHAPES, offsets_of(SHAPES)):
            part = slice(o, o + shape.numel())
            # fp16's quotients and their sum round in fp16 (a step of 2^-9 at 2 to 4)
            tol = {"int8:group=64": 1e-6, "none": 1e-5, "fp16": 2e-3}[spec]
            assert torch.allclose(w["after"][0][part], want[part], rtol=tol, atol=tol), spec
        # kept per layer: the int8 layers' new rounding, nothing for the layers sent whole
        kept = torch.cat([layer_residuals[i][q] for i in range(len(SHAPES))])
        assert torch.allclose(w["residuals"][1], kept, rtol=1e-5, atol=1e-6)
    # step 4, whole again: the per-layer residuals laid end to end (zeros where a layer owed none)
    owed = [w["residuals"][1].clone() for w in whole]
    want = _int8_reference([grad(r, 14) for r in range(world_size)], owed, 64)
    for q, w in enumerate(whole):
        assert torch.allclose(w["after"][1], want, rtol=1e-6, atol=1e-7)
        assert torch.allclose(w["residuals"][2], owed[q], rtol=1e-5, atol=1e-6)
        # step 5, every layer dense: the mean of what each rank still owed with its gradient
        mean = sum(grad(r, 15) + whole[r]["residuals"][2] for r in range(world_size)) / world_size
        assert torch.allclose(w["after"][2], mean, rtol=1e-5, atol=1e-6)
        assert w["end"] is None
