"""Spawned gloo ranks: gradzip's hook against PyTorch's own hooks, bit-identical replicas, the
PowerSGD reducer against an independent reference, ordering with several buckets in flight, and
small, empty and half-precision buckets."""

import time

import pytest
import torch
import torch.distributed as dist
from helpers.ddp_replicas import mlp, train_replica
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from gradzip.comm import make_reducer
from gradzip.compressors.base import seeded_generator
from gradzip.testing import run_ranks

pytestmark = pytest.mark.dist

SPECS = ["none", "fp16", "bf16", "topk:ratio=0.05", "powersgd:approx_rank=2", "powersgd:approx_rank=1,warm_start=false"]


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def pytorch_bf16_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    # DDP refuses bf16_compress_hook by name on CPU builds; the hook itself runs on gloo.
    return default_hooks.bf16_compress_hook(state, bucket)


def hooks_against_pytorch(rank, world_size):
    """Our none/fp16/bf16 hooks equal PyTorch's allreduce/fp16/bf16 hooks bit for bit."""
    pairs = [("none", default_hooks.allreduce_hook), ("fp16", default_hooks.fp16_compress_hook), ("bf16", pytorch_bf16_hook)]
    gen = torch.Generator().manual_seed(100 + rank)
    results = {}
    for spec, torch_hook in pairs:
        ours, theirs = DDP(mlp(0), bucket_cap_mb=0.002), DDP(mlp(0), bucket_cap_mb=0.002)
        ours.register_comm_hook(gradzip.CompressionState(spec), gradzip.compression_hook)
        theirs.register_comm_hook(None, torch_hook)
        equal = True
        for _ in range(3):
            x = torch.randn(16, 20, generator=gen) * 10
            for model in (ours, theirs):
                model.zero_grad()
                model(x).square().mean().backward()
            equal &= all(torch.equal(a, b) for a, b in zip(_grads(ours.module), _grads(theirs.module)))
        results[spec] = equal
    return results


def casts_past_range_against_pytorch(rank, world_size):
    """gradzip's fp16/bf16 reducers and PyTorch's hooks on one bucket holding in-range values and
    fp32 values past the wire dtype's range (the same on every rank)."""
    gen = torch.Generator().manual_seed(200 + rank)
    out = {}
    for spec, torch_hook, wire_dtype in [
        ("fp16", default_hooks.fp16_compress_hook, torch.float16),
        ("bf16", default_hooks.bf16_compress_hook, torch.bfloat16),
    ]:
        big = 1e5 if wire_dtype == torch.float16 else 3.4e38  # finite in fp32, past the wire's max
        bucket = torch.cat([torch.randn(40, generator=gen) * 10, torch.tensor([big, -big, 7.0])])
        ours = make_reducer(spec).reduce(0, bucket.clone(), step=0).wait()
        # PyTorch's hooks take a (tensor,) tuple in place of a GradBucket and decode in place.
        theirs = torch_hook(None, (bucket.clone(),)).wait()
        out[spec] = (ours, theirs, torch.finfo(wire_dtype).max)
    return out


def train_replicas(rank, world_size, specs):
    """For each spec, several DDP steps with several buckets and uneven compute per rank."""
    return {spec: train_replica(rank, world_size, spec, steps=5, pause_s=0.05) for spec in specs}


@pytest.mark.parametrize("world_size", [2, 3])
def test_identity_fp16_bf16_equal_pytorch_hooks_bit_for_bit(world_size):
    for rank_result in run_ranks(hooks_against_pytorch, world_size):
        assert rank_result == {"none": True, "fp16": True, "bf16": True}


def test_fp16_bf16_saturate_past_range_and_equal_pytorch_within_it():
    # 3 ranks: the pre-divided out-of-range terms (max / 3) round, and their sum overflows again.
    for result in run_ranks(casts_past_range_against_pytorch, 3):
        for spec, (ours, theirs, wire_max) in result.items():
            past = torch.zeros(ours.numel(), dtype=torch.bool)
            past[40:42] = True
            # In range: bit for bit PyTorch's hook (cast, divide by world_size, all_reduce).
            assert torch.equal(ours[~past], theirs[~past]), spec
            # Past the range PyTorch's hook overflows to inf; gradzip saturates at the wire's max.
            assert torch.isinf(theirs[past]).all(), spec
            assert torch.isfinite(ours).all(), spec
            assert ours[40] > 0 > ours[41], spec
            assert torch.all(ours[past].abs() <= wire_max) and torch.all(ours[past].abs() >= 0.99 * wire_max), (spec, ours[past])


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_codec_leaves_ranks_bit_identical(world_size):
    results = run_ranks(train_replicas, world_size, SPECS)
    dense_bytes = sum(p.numel() for p in mlp(1).parameters()) * 4
    for spec in SPECS:
        params0, sent0, steps0 = results[0][spec]
        assert steps0 == 5
        for other in results[1:]:
            assert torch.equal(other[spec][0], params0), spec
        payload, _ = sent0[-1]
        if spec == "none":
            assert payload == dense_bytes
        else:
            assert payload < dense_bytes, spec


def powersgd_reference_check(rank, world_size):
    """The reducer's output against an independent computation from all ranks' matrices."""
    gen = torch.Generator().manual_seed(7)
    all_m = [torch.randn(12, 9, generator=gen, dtype=torch.float64) for _ in range(world_size)]
    bias = [torch.randn(5, generator=gen) for _ in range(world_size)]
    flat = torch.cat([all_m[rank].float().reshape(-1), bias[rank]])
    reducer = make_reducer("powersgd:approx_rank=2,warm_start=false,seed=3")
    out = reducer.reduce(0, flat, step=4, shapes=[torch.Size([12, 9]), torch.Size([5])]).wait()
    # Reference in float64 from the same initial Q.
    q = torch.randn(9, 2, generator=seeded_generator(3, 4, (0, 0))).double()
    p = sum(m @ q for m in all_m)
    p_hat = torch.linalg.qr(p).Q
    q_mean = sum(m.T @ p_hat for m in all_m) / world_size
    expected_matrix = p_hat @ q_mean.T
    expected_bias = torch.stack(bias).sum(0) / world_size
    residual = reducer.feedback.residuals[(0, 0)]
    local_expected_residual = all_m[rank] - p_hat @ (all_m[rank].T @ p_hat).T
    return (
        float((out[:108].double().reshape(12, 9) - expected_matrix).abs().max()),
        float((out[108:] - expected_bias).abs().max()),
        float((residual.double() - local_expected_residual).abs().max()),
    )


def test_powersgd_matches_independent_reference_on_three_ranks():
    for err_matrix, err_bias, err_residual in run_ranks(powersgd_reference_check, 3):
        assert err_matrix < 1e-4 and err_bias < 1e-6 and err_residual < 1e-4


def small_and_half_precision_buckets(rank, world_size):
    out = {}
    # A bucket of only 1-D tensors and one of a single (4, 4) matrix: exact means, no
    # compression, and an empty tensor comes back empty with nothing sent.
    reducer = make_reducer("powersgd:approx_rank=4")
    bias = torch.arange(10.0) * (rank + 1)
    out["vector"] = reducer.reduce(0, bias, step=0, shapes=[torch.Size([10])]).wait()
    square = torch.full((4, 4), float(rank + 1))
    out["small_matrix"] = reducer.reduce(1, square.reshape(-1), step=0, shapes=[torch.Size([4, 4])]).wait()
    out["empty"] = reducer.reduce(2, torch.empty(0), step=0, shapes=[torch.Size([0])]).wait()
    out["metrics"] = reducer.metrics.pop()
    # Half-precision gradients through PowerSGD rank 1 with error feedback.
    gen = torch.Generator().manual_seed(rank)
    out["half_powersgd"] = {}
    for dtype in (torch.float16, torch.bfloat16):
        r = make_reducer("powersgd:approx_rank=1")
        g = torch.randn(16, 16, generator=gen).to(dtype)
        res = [r.reduce(0, g.reshape(-1), step=s, shapes=[g.shape]).wait() for s in range(3)]
        out["half_powersgd"][str(dtype)] = (res[-1].dtype, tuple(res[-1].shape), all(torch.isfinite(x).all() for x in res))
    # Small matrices that would not shrink travel uncompressed: exact mean.
    out["uncompressed_matrices"] = []
    for dtype, shape, approx_rank in ((torch.bfloat16, (8, 4), 4), (torch.float16, (4, 8), 4), (torch.float32, (3, 3), 2)):
        g = (torch.arange(float(torch.Size(shape).numel())).reshape(shape) + rank).to(dtype)
        r = make_reducer(f"powersgd:approx_rank={approx_rank}")
        out["uncompressed_matrices"].append(r.reduce(0, g.reshape(-1), step=0, shapes=[torch.Size(shape)]).wait())
    # fp16 averaging of large and of tiny values.
    fp16 = make_reducer("fp16")
    out["fp16_big"] = fp16.reduce(0, torch.full((8,), 40000.0), step=0).wait()
    out["fp16_tiny"] = fp16.reduce(1, torch.full((8,), 1e-7), step=0).wait()
    # The fp16 codec on an fp32 bucket hands float16 to the collective.
    x = torch.tensor([1.0, 2.0, 3.0, 1e-4]) * (rank + 1)
    fp16.metrics.pop()
    out["fp16_of_fp32"] = fp16.reduce(2, x, step=0).wait()
    out["fp16_payload"] = fp16.metrics.pop()["payload_bytes"]
    return out


def test_small_empty_and_half_precision_buckets_average_exactly_or_stay_finite_on_two_ranks():
    results = run_ranks(small_and_half_precision_buckets, 2)
    for out in results:
        assert torch.equal(out["vector"], torch.arange(10.0) * 1.5)
        assert torch.equal(out["small_matrix"], torch.full((16,), 1.5))
        assert out["empty"].shape == (0,)
        assert out["metrics"]["payload_bytes"] == (10 + 16) * 4  # nothing for the empty tensor
        for dtype in (torch.float16, torch.bfloat16):
            got_dtype, shape, finite = out["half_powersgd"][str(dtype)]
            assert got_dtype == dtype and shape == (256,) and finite
        for got, (dtype, shape) in zip(out["uncompressed_matrices"], ((torch.bfloat16, (8, 4)), (torch.float16, (4, 8)), (torch.float32, (3, 3)))):
            base = torch.arange(float(torch.Size(shape).numel())).reshape(-1)
            expected = ((base.to(dtype) / 2) + ((base + 1).to(dtype) / 2)).to(dtype)
            assert got.dtype == dtype and torch.equal(got, expected)
        assert torch.equal(out["fp16_big"], torch.full((8,), 40000.0))
        small = out["fp16_tiny"]
        assert (small > 0).all() and torch.isfinite(small).all()
        expected_fp16_of_fp32 = (torch.tensor([1.0, 2.0, 3.0, 1e-4]).half().div(2) + (torch.tensor([1.0, 2.0, 3.0, 1e-4]) * 2).half().div(2)).float()
        assert out["fp16_of_fp32"].dtype == torch.float32 and torch.equal(out["fp16_of_fp32"], expected_fp16_of_fp32)
        assert out["fp16_payload"] == 4 * 2


def many_buckets_powersgd(rank, world_size):
    """PowerSGD on a two-layer MLP in many buckets on gloo, with one rank slower: the case where
    PyTorch's powerSGD_hook hangs or aborts. Every rank must finish with identical parameters."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    ddp = DDP(model, bucket_cap_mb=0.05)
    ddp.register_comm_hook(gradzip.CompressionState("powersgd:approx_rank=2"), gradzip.compression_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for step in range(6):
        opt.zero_grad()
        loss = ddp(torch.randn(32, 256, generator=gen)).square().mean()
        if rank == 0 and step % 2:
            time.sleep(0.1)
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


def test_powersgd_many_buckets_uneven_ranks_does_not_hang():
    assert all(run_ranks(many_buckets_powersgd, 2, timeout_s=60))
