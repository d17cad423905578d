"""FSDP2 with gradzip's reduce-scatter on CUDA with NCCL at world size 1: installed on every
``fully_shard`` module, it trains as plain FSDP does, bit for bit (at one rank FSDP has nothing
to reduce-scatter, so nothing is sent), in fp32 and under a bf16 mixed-precision policy."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from gradzip.fsdp import compress_reduce_scatter

DEVICE = torch.device("cuda", 0)


def _net(mp_policy: MixedPrecisionPolicy | None) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8)).to(DEVICE)
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in (net[0], net[2], net[4]):
        fully_shard(layer, **kwargs)
    fully_shard(net, **kwargs)
    return net


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "powersgd:approx_rank=2", "qsgd"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-policy"])
def test_fsdp_with_gradzip_trains_as_plain_fsdp(nccl_group, spec, bf16):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else None
    plain, ours = _net(policy), _net(policy)
    state = compress_reduce_scatter(ours, spec)
    optimizers = [torch.optim.SGD(net.parameters(), lr=0.05) for net in (plain, ours)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(16, 64, generator=gen).to(DEVICE)
        for net, opt in zip((plain, ours), optimizers, strict=True):
            opt.zero_grad()
            net(x).float().square().mean().backward()
            opt.step()
    for a, b in zip(plain.parameters(), ours.parameters(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor()), f"{spec}: parameters differ from plain FSDP"
    assert all(comm.calls == 0 for comm in state.comms.values())
    assert state.metrics.pop()["payload_bytes"] == 0
