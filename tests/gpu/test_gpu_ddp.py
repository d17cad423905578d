"""The DDP hook on CUDA with NCCL at world size 1: PyTorch's hooks as oracles, every codec
through a real backward pass, no host synchronisation where a codec declares none, and
PowerSGD against PyTorch's ``powerSGD_hook`` on the same inputs."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from gradzip.comm.countsketch import packed_bitmaps
from gradzip.compressors import REGISTRY, build

DEVICE = torch.device("cuda", 0)


def _mlp(seed: int, *, width: int = 256) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 10)
        )
    return model.to(DEVICE)


def _ddp(model: torch.nn.Module, state, hook) -> DDP:
    # Small buckets: several per backward pass, so hooks overlap and the queue orders them.
    ddp = DDP(model, device_ids=[0], bucket_cap_mb=0.1)
    ddp.register_comm_hook(state, hook)
    return ddp


def _batches(count: int, *, dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(32, 64, generator=gen) * 3).to(DEVICE, dtype) for _ in range(count)]


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _step_grads(ddp: DDP, x: torch.Tensor) -> list[torch.Tensor]:
    ddp.zero_grad()
    ddp(x).float().square().mean().backward()
    return _grads(ddp.module)


@pytest.mark.parametrize(("spec", "torch_hook"), [("none", default_hooks.allreduce_hook), ("fp16", default_hooks.fp16_compress_hook)])
def test_identity_and_fp16_equal_pytorch_hooks_bit_for_bit(nccl_group, spec, torch_hook):
    ours = _ddp(_mlp(0), gradzip.CompressionState(spec), gradzip.compression_hook)
    theirs = _ddp(_mlp(0), None, torch_hook)
    for x in _batches(4):
        for a, b in zip(_step_grads(ours, x), _step_grads(theirs, x), strict=True):
            assert torch.equal(a, b), f"{spec}: gradients differ from PyTorch's hook"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_codec_trains_through_the_hook(nccl_group, name, dtype):
    """Four steps of SGD through the hook: finite gradients of the right dtype on the device,
    bytes as the codec's metrics count them, and the step counter advancing once per pass."""
    model = _mlp(1).to(dtype)
    state = gradzip.CompressionState(name)
    ddp = _ddp(model, state, gradzip.compression_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for x in _batches(4, dtype=dtype):
        grads = _step_grads(ddp, x)
        assert all(g.device == DEVICE and g.dtype == dtype and g.isfinite().all() for g in grads), name
        figures = state.metrics.pop()
        assert figures["payload_bytes"] > 0 and figures["buckets"], name
        opt.step()
    assert state.step == 4


def test_countsketch_sends_byte_bitmaps_on_nccl(nccl_group):
    """NCCL has no bitwise-OR reduction: the count sketch's bitmaps travel one byte per element
    and are combined with MAX there (gloo ORs packed bits)."""
    assert not packed_bitmaps(nccl_group)
    codec = build("countsketch")
    state = gradzip.CompressionState("countsketch")
    ddp = _ddp(_mlp(2), state, gradzip.compression_hook)
    _step_grads(ddp, _batches(1)[0])
    buckets = state.metrics.pop()["buckets"]
    compressed = [b for b in buckets.values() if b["collective"] == "allreduce"]
    assert compressed
    for b in compressed:
        numel = b["dense_bytes"] // 4
        assert b["payload_bytes"] == codec.payload_nbytes(numel, packed=False)


@pytest.mark.parametrize("name", [n for n in sorted(REGISTRY) if not build(n).host_reads])
def test_hooks_without_host_reads_do_not_sync_in_backward(nccl_group, no_host_sync, name):
    """Backward with the hook under PyTorch's sync check: from the third step on (DDP rebuilds
    its buckets after the first), nothing in the hook may make the host wait for the device."""
    state = gradzip.CompressionState(name)
    ddp = _ddp(_mlp(3), state, gradzip.compression_hook)
    batches = _batches(4)
    for step, x in enumerate(batches):
        ddp.zero_grad()
        loss = ddp(x).square().mean()
        if step < 2:
            loss.backward()
            continue
        with no_host_sync():
            loss.backward()
    torch.cuda.synchronize()
    assert all(g.isfinite().all() for g in _grads(ddp.module))


def _rank_r_batches(count: int, rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(rank, 512, generator=gen).to(DEVICE) for _ in range(count)]


def test_powersgd_recovers_a_low_rank_gradient_as_pytorchs_hook_does(nccl_group):
    """One linear layer fed ``r`` samples has a gradient of rank at most ``r``: PowerSGD at rank
    ``r`` returns it exactly (to fp32 rounding) from any starting Q, on its first compressed step
    (no residual yet). gradzip's reducer and PyTorch's powerSGD_hook, both starting at step 2
    after two dense steps, must both do so on the same inputs. (Later steps are not exact: the
    error-feedback residual adds the directions of earlier gradients.)"""
    rank = 4

    def layer() -> torch.nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(9)
            return torch.nn.Linear(512, 384, bias=False).to(DEVICE)

    ours = _ddp(layer(), gradzip.CompressionState(f"powersgd:approx_rank={rank},start_step=2"), gradzip.compression_hook)
    torch_state = torch_powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2, min_compression_rate=1,
    )
    theirs = _ddp(layer(), torch_state, torch_powersgd.powerSGD_hook)
    dense = DDP(layer(), device_ids=[0])
    for step, x in enumerate(_rank_r_batches(3, rank)):
        (a,), (b,), (d,) = _step_grads(ours, x), _step_grads(theirs, x), _step_grads(dense, x)
        if step < 2:  # both send the gradient dense before their start step
            assert torch.equal(a, d) and torch.equal(b, d), f"step {step}: a dense step differs from DDP's"
            continue
        scale = d.norm()
        assert (a - d).norm() <= 1e-5 * scale, "gradzip's PowerSGD lost a rank-4 gradient"
        assert (b - d).norm() <= 1e-5 * scale, "PyTorch's powerSGD_hook lost a rank-4 gradient"


def test_powersgd_approximates_a_full_rank_gradient_as_well_as_pytorchs_hook(nccl_group):
    """A full-rank gradient: both rank-4 approximations (with error feedback and warm start, both
    compressing from step 2) lose a similar share of it (about 0.3 of its norm on this model, on
    the CPU); gradzip's may not be clearly worse."""
    ours = _ddp(_mlp(4), gradzip.CompressionState("powersgd:approx_rank=4,start_step=2"), gradzip.compression_hook)
    torch_state = torch_powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2, min_compression_rate=1,
    )
    theirs = _ddp(_mlp(4), torch_state, torch_powersgd.powerSGD_hook)
    dense = DDP(_mlp(4), device_ids=[0])
    errors = {"ours": [], "theirs": []}
    for x in _batches(12):
        a, b, d = _step_grads(ours, x), _step_grads(theirs, x), _step_grads(dense, x)
        norm = torch.cat([g.reshape(-1) for g in d]).norm()
        errors["ours"].append(float(torch.cat([(g - h).reshape(-1) for g, h in zip(a, d)]).norm() / norm))
        errors["theirs"].append(float(torch.cat([(g - h).reshape(-1) for g, h in zip(b, d)]).norm() / norm))
    ours_late, theirs_late = sum(errors["ours"][6:]) / 6, sum(errors["theirs"][6:]) / 6
    assert 0 < ours_late < 1 and ours_late <= 1.25 * theirs_late + 0.02, errors
