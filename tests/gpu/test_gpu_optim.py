"""The optimizers that own their communication and DiLoCo on CUDA with NCCL at world size 1: a
few steps each, parameters and every state tensor staying on the device and finite."""

from __future__ import annotations

import pytest
import torch

import gradzip
from gradzip.optim import DeMo, OneBitAdam, TSRAdam, ZeroOneAdam

DEVICE = torch.device("cuda", 0)

OPTIMIZERS = {
    "onebit_adam": lambda ps: OneBitAdam(ps, lr=1e-3, warmup_steps=2),
    "zeroone_adam": lambda ps: ZeroOneAdam(ps, lr=1e-3, var_freeze_step=2, local_step_scaler=2),
    "tsr_adam": lambda ps: TSRAdam(ps, lr=1e-3, approx_rank=4, update_gap=2),
    "demo": lambda ps: DeMo(ps, lr=1e-3),
}


def _model() -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)).to(DEVICE)


def _tensors(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


def _train(model, opt, steps: int) -> None:
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 64, generator=gen).to(DEVICE)).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_steps_on_cuda(nccl_group, name):
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    _train(model, opt, 5)
    assert all(p.is_cuda and p.isfinite().all() for p in model.parameters())
    # the step counters may live on the host, as torch.optim's do
    on_host = [t for t in _tensors(opt.state_dict()["state"]) if not t.is_cuda and t.numel() > 1]
    assert not on_host, f"{name}: state tensors left on the host: {[tuple(t.shape) for t in on_host]}"


@pytest.mark.parametrize("spec", ["none", "topk:ratio=0.1", "powersgd:approx_rank=2"])
def test_diloco_steps_on_cuda(nccl_group, spec):
    model = _model()
    opt = gradzip.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-3), spec, sync_every=2)
    _train(model, opt, 6)
    assert all(p.is_cuda and p.isfinite().all() for p in model.parameters())
