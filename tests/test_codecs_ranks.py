"""Spawned gloo ranks: Random-K agrees across ranks whatever their global RNG, and every
codec of the family through real DDP training with bit-identical replicas."""

import pytest
import torch
from helpers.ddp_replicas import mlp, train_replica

from gradzip.comm import make_reducer
from gradzip.compressors import REGISTRY, build
from gradzip.testing import run_ranks

pytestmark = pytest.mark.dist

DDP_SPECS = sorted(n for n, cls in REGISTRY.items() if not cls.multi_round) + [
    "randomk:ratio=0.1,unbiased=true",
    "qsgd:bits=2,bucket=64,norm=l2",
    "uniform:bits=4,rounding=stochastic",
    "terngrad:clip=0",
    "threshold:tau=0.01,max_ratio=0.05",
    "topk:ratio=0.05+uniform:bits=8",
    "randomk:ratio=0.1+fp16",
    "powersgd:approx_rank=1",
]
RANDOM_K_SPECS = ("randomk:ratio=0.3", "randomk:ratio=0.3,unbiased=true")


def random_k_under_different_global_rngs(rank, world_size):
    """Random-K, numel 10, k 3, global RNGs seeded differently on each rank."""
    torch.manual_seed(1000 + 17 * rank)
    torch.rand(rank + 1)  # and advanced by different amounts
    out = {}
    for spec in RANDOM_K_SPECS:
        reducer = make_reducer(spec)
        grad = torch.arange(10.0) + 100.0 * rank
        out[spec] = reducer.reduce("w", grad, step=5).wait()
    return out


def test_random_k_agrees_across_ranks_with_different_global_rngs():
    world_size = 2
    results = run_ranks(random_k_under_different_global_rngs, world_size)
    mean = torch.arange(10.0) + 100.0 * (world_size - 1) / 2
    for spec in RANDOM_K_SPECS:
        codec = build(spec)
        indices = codec.indices(10, step=5, key="w")
        assert indices.numel() == 3 and indices.unique().numel() == 3
        selected = torch.zeros(10, dtype=torch.bool)
        selected[indices] = True
        scale = 10 / 3 if codec.unbiased else 1.0
        for rank_result in results:
            got = rank_result[spec]
            assert torch.equal(got, results[0][spec])
            assert torch.equal(got[~selected], torch.zeros(7))
            torch.testing.assert_close(got[selected], mean[selected] * scale)


def train_every_codec(rank, world_size, specs):
    """A few DDP steps per codec, several buckets, uneven compute; final parameters and bytes."""
    results = {}
    for spec in specs:
        params, sent, _ = train_replica(rank, world_size, spec, steps=4, pause_s=0.01)
        results[spec] = (params, sent, bool(torch.isfinite(params).all()))
    return results


def test_every_codec_trains_ddp_with_bit_identical_replicas_on_three_ranks():
    results = run_ranks(train_every_codec, 3, DDP_SPECS, timeout_s=240)
    initial = torch.cat([p.detach().reshape(-1) for p in mlp(1).parameters()])
    for spec in DDP_SPECS:
        params, sent, finite = results[0][spec]
        assert finite, spec
        assert not torch.equal(params, initial), spec  # it trained
        for other in results[1:]:
            assert torch.equal(other[spec][0], params), spec
        if spec != "none":
            payload, dense = sent[-1]
            assert payload < dense, spec
