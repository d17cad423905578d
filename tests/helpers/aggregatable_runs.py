"""Rank workers shared by the tests of the aggregatable reducers (SEPARATE, PowerSGD with
low-bit factors, the count sketch): several steps of one bucket through ``make_reducer``, a
resume from a mid-run state dict, and a few DDP steps through the hook."""

import math

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from gradzip.comm import make_reducer
from gradzip.testing import run_ranks


def bucket_grad(rank: int, step: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s bucket at ``step``: Gaussian, a different scale per rank."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(numel, generator=gen) * (1 + rank)


def reduce_steps(rank: int, world_size: int, spec: str, shapes: list, steps: int, resume_at: int) -> dict:
    """``steps`` steps of one bucket (key 0); then a fresh reducer loaded with the state dict
    taken before step ``resume_at`` replays the steps from there."""
    numel = sum(math.prod(s) for s in shapes)
    reducer = make_reducer(spec)
    outs, nbytes, saved = [], [], None
    for step in range(steps):
        if step == resume_at:
            saved = reducer.state_dict()
        outs.append(reducer.reduce(0, bucket_grad(rank, step, numel), step=step, shapes=shapes).wait().clone())
        nbytes.append(reducer.metrics.pop()["payload_bytes"])
    fresh = make_reducer(spec)
    fresh.load_state_dict(saved)
    resumed = [
        fresh.reduce(0, bucket_grad(rank, step, numel), step=step, shapes=shapes).wait().clone()
        for step in range(resume_at, steps)
    ]
    return {"outs": outs, "bytes": nbytes, "resumed": resumed}


def reduce_steps_each(rank: int, world_size: int, specs: list, shapes: list, steps: int, resume_at: int) -> dict:
    """:func:`reduce_steps` for each spec in one set of ranks: ``{spec: result}``."""
    return {spec: reduce_steps(rank, world_size, spec, shapes, steps, resume_at) for spec in specs}


def _mlp() -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(20, 48), torch.nn.ReLU(), torch.nn.Linear(48, 5))


def ddp_steps(rank: int, world_size: int, spec: str, steps: int = 4) -> torch.Tensor:
    """``steps`` SGD steps of a small MLP under DDP with gradzip's hook (two buckets); returns
    the flat parameters. ``spec`` may be a list: then ``{spec: parameters}``."""
    if isinstance(spec, list):
        return {s: ddp_steps(rank, world_size, s, steps) for s in spec}
    model = _mlp()
    ddp = DDP(model, bucket_cap_mb=0.002)
    ddp.register_comm_hook(gradzip.CompressionState(spec), gradzip.compression_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(8, 20, generator=gen)).square().mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def check_nonfinite(specs: list[str], world_size: int = 3) -> None:
    """tests/test_nonfinite.py's reducer contract for ``specs`` alone: an inf or NaN bucket on one
    rank gives all NaN on every rank, leaves no state behind, and extreme finite input stays
    finite and identical across ranks."""
    from test_nonfinite import _nonfinite_worker

    reports = run_ranks(_nonfinite_worker, world_size, [(spec, {}) for spec in specs], timeout_s=300)
    for spec in specs:
        _check_nonfinite_report(reports, f"{spec}/{{}}")


def _check_nonfinite_report(reports: list, name: str) -> None:
    for rank, report in enumerate(reports):
        entry = report[name]
        assert entry["bad_bucket_all_nan"], f"rank {rank} did not get the NaN marker"
        assert entry["state_unchanged"], f"rank {rank} state changed by a skipped step"
        assert entry["next_step_equal_to_twin"], f"rank {rank} differs from a run without the bad steps"
        assert entry["state_equal_to_twin"], f"rank {rank} state differs from a run without the bad steps"
        assert all(entry["extremes_finite"].values()), entry["extremes_finite"]
        for key, t in entry["out3"].items():
            assert torch.equal(t, reports[0][name]["out3"][key]), key
        for case, t in entry["extremes"].items():
            assert torch.equal(t, reports[0][name]["extremes"][case]), case
