"""A small MLP trained for a few DDP steps through gradzip's hook, the same way on every rank."""

from __future__ import annotations

import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip


def mlp(seed: int) -> torch.nn.Module:
    """20 -> 64 -> 32 -> 5 with ReLUs, initialised from ``seed`` (the global RNG is left as it was)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5)
        )


def train_replica(rank: int, world_size: int, spec: str, *, steps: int, pause_s: float):
    """``steps`` SGD steps of :func:`mlp` (seed 1) under DDP with several buckets and ``spec``'s hook.

    The last rank sleeps ``pause_s`` on odd steps before its backward (uneven compute: the hook's
    callbacks finish in different orders on different ranks).

    Returns:
        the final parameters flattened, ``(payload_bytes, dense_bytes)`` per step, and the hook
        state's step count.
    """
    model = mlp(1)
    ddp = DDP(model, bucket_cap_mb=0.004)
    state = gradzip.CompressionState(spec)
    ddp.register_comm_hook(state, gradzip.compression_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    sent = []
    for step in range(steps):
        x = torch.randn(8, 20, generator=gen)
        opt.zero_grad()
        loss = ddp(x).square().mean()
        if rank == world_size - 1:
            time.sleep(pause_s * (step % 2))
        loss.backward()
        opt.step()
        metrics = state.metrics.pop()
        sent.append((metrics["payload_bytes"], metrics["dense_bytes"]))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), sent, state.step
