"""The CUDA paths, checked on the CPU.

- What a codec's path through the DDP hook reads on the host: run on ``meta`` tensors (no
  values to read) through a fake process group of two ranks under
  :class:`helpers.host_sync.NoHostSync`, on every route the codec takes; a codec that declares
  no ``host_reads`` must pass, one that declares some must not (so the declaration, which the
  docs' GPU page prints, stays true both ways).
- The device form of the non-finite contract (``gradzip.comm.nonfinite``: flags kept on the
  device, payloads multiplied by 1 or NaN), forced onto CPU tensors: one rank in-process, and
  two gloo ranks through the contract test of ``test_nonfinite``; with them, the count sketch's
  bitmaps combined as on NCCL (one byte each, MAX) against gloo's packed OR.
- The stream plumbing that does not need a GPU: ``collect_all`` parts joined into values, and
  kernels compiled only for the device types that have a compiler.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.aggregatable_runs import reduce_steps
from helpers.host_sync import HostSync, NoHostSync
from helpers.tiny_run import same
from test_nonfinite import _nonfinite_worker, check_contract

from gradzip.comm import countsketch, devices, make_reducer, nonfinite
from gradzip.comm.queue import CollectiveQueue
from gradzip.compressors import REGISTRY, build
from gradzip.compressors.kernels import fused
from gradzip.testing import run_ranks

NUMEL = (1 << 16) + 37  # whole rows of the kernels and a short tail
SHAPES = [torch.Size([256, 256]), torch.Size([37])]


@pytest.fixture
def fake_group():
    """A process group of two ranks whose collectives move nothing (any device, meta too)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.fixture
def one_rank():
    """A gloo group of this process alone."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _routes(codec) -> list[dict]:
    """Reducer options reaching every route a codec takes: each collective it accepts, dense
    (before its start step) and fused (below min_compress_bytes)."""
    if codec.multi_round:
        return [{}]
    options = [{"collective": c} for c in ("allgather", "twophase")] + [{"min_compress_bytes": 1 << 30}]
    return options + ([{"collective": "allreduce"}] if codec.aggregatable else [])


def _hook_step(name: str, options: dict, dtype: torch.dtype, *, step: int) -> None:
    reducer = make_reducer(build(f"{name}:start_step=1"), **options)
    grad = torch.empty(NUMEL, device="meta", dtype=dtype)
    with NoHostSync():
        reducer.reduce(0, grad, step=step, shapes=SHAPES).wait()


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_declared_host_reads_match_the_hook_path_on_meta_tensors(fake_group, name):
    codec = build(name)
    # Step 1 on every route in both dtypes; step 0, before the codec's start step, is dense.
    routes = _routes(codec)
    runs = [(options, dtype, 1) for options in routes for dtype in (torch.float32, torch.bfloat16)] + [(routes[0], torch.float32, 0)]
    if not codec.host_reads:
        for options, dtype, step in runs:
            _hook_step(name, options, dtype, step=step)  # raises HostSync naming the op that waits
        return
    failures = 0
    for options, dtype, step in runs:
        try:
            _hook_step(name, options, dtype, step=step)
        except (HostSync, RuntimeError, NotImplementedError):  # meta kernels refuse value reads too
            failures += 1
    assert failures, f"{name} reads nothing on the host any more: drop its host_reads declaration"


def test_host_sync_detector_catches_reads_and_blocking_copies():
    x = torch.empty(8, device="meta")
    with NoHostSync(), pytest.raises(HostSync, match="_local_scalar_dense"):
        float(x.sum())
    with NoHostSync(), pytest.raises(HostSync, match="nonzero"):
        x.nonzero()
    with NoHostSync(), pytest.raises(HostSync, match="blocking copy"):
        torch.zeros(8).to("meta")
    with NoHostSync():
        torch.zeros(8).to("meta", non_blocking=True)
        torch.where(x > 0, x, 0.0).abs()


# -- the device form of the non-finite contract, on CPU values ------------------------------

DEVICE_SPECS = [
    ("none", {}),  # dense
    ("fp16", {"collective": "allreduce"}),
    ("randomk:ratio=0.1", {"collective": "allreduce"}),
    ("topk:ratio=0.1", {"collective": "allgather"}),
    ("efsignsgd", {"collective": "twophase"}),
    ("topk:ratio=0.1", {"min_compress_bytes": 1 << 30}),  # fused
]


def _force_device_checks(monkeypatch) -> None:
    """Make the reducers take the device form of every check on CPU tensors."""
    monkeypatch.setattr(nonfinite, "on_host", lambda t: False)


@pytest.mark.parametrize(("spec", "options"), DEVICE_SPECS, ids=[f"{s}-{o}" for s, o in DEVICE_SPECS])
def test_device_checks_keep_the_contract_on_one_rank(one_rank, monkeypatch, spec, options):
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(NUMEL, generator=gen) for _ in range(3)]
    host = make_reducer(spec, **options)
    expected = [host.reduce(0, g, step=s).wait().clone() for s, g in enumerate(grads)]

    _force_device_checks(monkeypatch)
    reducer = make_reducer(spec, **options)
    assert torch.equal(reducer.reduce(0, grads[0], step=0).wait(), expected[0])
    before = reducer.state_dict()
    bad = grads[1].clone()
    bad[7] = float("inf")
    assert torch.isnan(reducer.reduce(0, bad, step=1).wait()).all(), "a bucket with inf did not come back all NaN"
    assert reducer.ledger.pending, "the device flag was not noted for the step"
    after = reducer.state_dict()  # settles step 1: reads the flag, puts the state back
    assert not reducer.ledger.finite(1)
    assert same(before, after), f"{spec}: state changed by a skipped step"
    # The next step continues as if step 1 had never happened (the host twin saw step 1 finite,
    # so compare with a twin that skips it).
    twin = make_reducer(spec, **options)
    twin.reduce(0, grads[0], step=0).wait()
    assert torch.equal(reducer.reduce(0, grads[2], step=2).wait(), twin.reduce(0, grads[2], step=2).wait())
    big = torch.full((NUMEL,), torch.finfo(torch.float32).max)
    assert torch.isfinite(make_reducer(spec, **options).reduce(0, big, step=0).wait()).all()


COUNTSKETCH = "countsketch:ratio=0.02,width=3"  # bitmaps a byte each still leave it below the raw bytes


def _device_checks_worker(rank: int, world_size: int, specs: list) -> dict:
    """The contract of test_nonfinite with the device form of the checks; and the count sketch
    with its bitmaps as NCCL sends them (a byte each, MAX) beside gloo's (packed bits, BOR)."""
    packed = reduce_steps(rank, world_size, COUNTSKETCH, SHAPES, 3, 1)
    countsketch.packed_bitmaps = lambda group: False
    bytewise = reduce_steps(rank, world_size, COUNTSKETCH, SHAPES, 3, 1)
    nonfinite.on_host = lambda t: False  # this spawned process only
    return {"contract": _nonfinite_worker(rank, world_size, specs), "countsketch": (packed, bytewise)}


@pytest.mark.dist
def test_device_checks_keep_the_contract_across_ranks():
    """Rank 1's inf (step 1) and rank 0's NaN (step 2) reach the other rank through the device
    flags: all NaN everywhere, state put back, the next step as if they never happened. The
    count sketch's MAX of byte bitmaps (NCCL's way) gives what the OR of packed bits does."""
    reports = run_ranks(_device_checks_worker, 2, DEVICE_SPECS, timeout_s=300)
    numel = sum(s.numel() for s in SHAPES)
    for report in reports:
        packed, bytewise = report["countsketch"]
        assert all(torch.equal(a, b) for a, b in zip(packed["outs"], bytewise["outs"], strict=True))
        codec = build(COUNTSKETCH)
        assert bytewise["bytes"] == [codec.payload_nbytes(numel, packed=False)] * 3
        assert packed["bytes"] == [codec.payload_nbytes(numel)] * 3
    check_contract([r["contract"] for r in reports])


# -- stream plumbing -------------------------------------------------------------------------


def test_a_collect_all_launch_hands_on_the_values_of_its_parts():
    parts = [devices.completed(torch.ones(2)), devices.completed(torch.zeros(3))]
    result = CollectiveQueue().submit(lambda: torch.futures.collect_all(parts)).wait()
    assert [t.tolist() for t in result] == [[1.0, 1.0], [0.0, 0.0, 0.0]]


def test_kernels_compile_only_for_devices_with_a_compiler(monkeypatch):
    monkeypatch.setenv(fused.ENV, "1")
    kernel = fused.Kernel(lambda x: (x.abs() + 1,), "probe_meta")
    (out,) = kernel(torch.empty(64, device="meta"))
    assert out.device.type == "meta"
    assert kernel.compiled is None and not any("probe_meta" in label for label in fused.choices)
