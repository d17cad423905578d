"""DDP's bucket rebuild on real gloo ranks, in a plain DDP script (no warm-up backward).

The model's last layer has the shape of its first and its gradient is ready first, so after
DDP's rebuild a bucket slot that held the first layer holds the last one, with the same shape.
The hook's state must follow the tensors: Top-K's flat residuals equal an independent
per-parameter recursion over the layouts the hook met, PowerSGD's result does not depend on
DDP's bucketing at all, and both hold across ``load_state_dict`` in fresh processes (whose first
step meets DDP's first layout again). No residual warning is raised.

With ``find_unused_parameters=True`` DDP all-reduces its unused-parameter map once the last
bucket is hooked; PowerSGD's second rounds, issued as first rounds complete, must still reach
gloo in the same order on every rank (a mismatch aborts the process).
"""

import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from gradzip.keys import is_bucket_key
from gradzip.testing import run_ranks

pytestmark = pytest.mark.dist

TOPK = "topk:ratio=0.25"
POWERSGD = "powersgd:approx_rank=1"
STEPS, SAVE_AFTER = 5, 2
TINY_CAP_MB = 1e-6  # one parameter per bucket once DDP rebuilds (the first layout is one bucket)


def net() -> nn.Module:
    """Four 8x8 layers in forward order; the last has no bias, so its weight's gradient is ready
    first and lands where the first layer's weight was."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        layers = [nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh()]
        return nn.Sequential(*layers, nn.Linear(8, 8, bias=False))


def topk_state() -> gradzip.CompressionState:
    # all_gather: the residual is the whole bucket's Top-K error (the two-phase route's is per chunk)
    return gradzip.CompressionState(TOPK, collective="allgather")


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * rank + step))


def wrap(
    model: nn.Module, cap_mb: float, state: gradzip.CompressionState, records: list | None = None, **ddp_options
) -> DDP:
    """DDP through gradzip's hook; ``records`` gets (step, parameter names, raw bucket) per bucket."""
    names = {id(p): n for n, p in model.named_parameters()}

    def hook(state: gradzip.CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if records is not None:
            records.append((state.step, [names[id(p)] for p in bucket.parameters()], bucket.buffer().clone()))
        return gradzip.compression_hook(state, bucket)

    ddp = DDP(model, bucket_cap_mb=cap_mb, **ddp_options)
    ddp.register_comm_hook(state, hook)
    return ddp


def train(ddp: DDP, steps: range, pause_s: float = 0.0) -> None:
    """Plain SGD steps (no optimizer state to carry); the last rank pauses before some backward
    passes (callbacks then complete in other orders on different ranks)."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in steps:
        opt.zero_grad()
        loss = ddp(batch(dist.get_rank(), step)).square().mean()
        if dist.get_rank() == dist.get_world_size() - 1:
            time.sleep(pause_s * (step % 3))
        loss.backward()
        opt.step()


def reference_residuals(records: list, residuals: dict[str, torch.Tensor], sizes: dict[str, int]) -> dict:
    """Top-K with error feedback run per parameter over the buckets the hook met, from
    ``residuals`` (parameter name -> flat residual); returns the residuals after the last step."""
    codec = gradzip.build(TOPK)
    residuals = dict(residuals)
    for step, names, raw in records:
        compensated = raw + torch.cat([residuals.get(n, torch.zeros(sizes[n])) for n in names])
        decoded = codec.decompress(codec.compress(compensated, step=step, key=0), like=compensated)
        left = compensated - decoded
        offset = 0
        for n in names:
            residuals[n] = left[offset : offset + sizes[n]]
            offset += sizes[n]
    return residuals


def residuals_by_name(state: gradzip.CompressionState, model: nn.Module) -> dict[str, torch.Tensor]:
    """The hook's flat residuals cut per parameter, named through the state's numbering."""
    by_number = {state.numbering.numbers[p]: n for n, p in model.named_parameters() if p in state.numbering.numbers}
    out = {}
    for key, residual in state.reducer.feedback.residuals.items():
        assert is_bucket_key(key), key
        flat, offset = residual.reshape(-1), 0
        for number, numel in zip(key[1], key[2]):
            out[by_number[number]] = flat[offset : offset + numel].clone()
            offset += numel
    return out


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def first_run(rank: int, world_size: int, folder: str) -> dict:
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Top-K on the tiny-cap model: residuals against the per-parameter recursion; a state
        # saved after SAVE_AFTER steps for the fresh processes, then the run goes on.
        model = net()
        sizes = {n: p.numel() for n, p in model.named_parameters()}
        state, records = topk_state(), []
        train(wrap(model, TINY_CAP_MB, state, records), range(SAVE_AFTER))
        out["layouts"] = [[names for step, names, _ in records if step == s] for s in (0, 1)]
        saved = residuals_by_name(state, model)
        out["topk_saved_matches"] = _equal(saved, reference_residuals(records, {}, sizes))
        torch.save({"model": model.state_dict(), "hook": state.state_dict(), "reference": saved}, os.path.join(folder, f"topk{rank}.pt"))
        # PowerSGD bound to its model: the same checkpoint point, and the layout-free result.
        runs = {}
        for cap in (TINY_CAP_MB, 25):
            model = net()
            state = gradzip.CompressionState(POWERSGD).bind(model)
            ddp = wrap(model, cap, state)
            train(ddp, range(SAVE_AFTER))
            if cap == TINY_CAP_MB:
                torch.save({"model": model.state_dict(), "hook": state.state_dict()}, os.path.join(folder, f"powersgd{rank}.pt"))
            train(ddp, range(SAVE_AFTER, STEPS))
            runs[cap] = flat_params(model)
        out["powersgd_tiny"], out["powersgd_big"] = runs[TINY_CAP_MB], runs[25]
        # Top-K in one default-sized bucket: the same shape before and after the rebuild.
        model = net()
        state, records = topk_state(), []
        train(wrap(model, 25, state, records), range(3))
        out["one_bucket_orders"] = [names for step, names, _ in records if step in (0, 1)]
        out["one_bucket_matches"] = _equal(residuals_by_name(state, model), reference_residuals(records, {}, sizes))
        # PowerSGD under find_unused_parameters=True, with uneven ranks.
        model = net()
        train(wrap(model, TINY_CAP_MB, gradzip.CompressionState(POWERSGD), find_unused_parameters=True), range(20), pause_s=0.01)
        out["unused_map"] = flat_params(model)
    out["warnings"] = [str(w.message) for w in caught if "feedback" in str(w.message) or "residual" in str(w.message)]
    return out


def resumed_run(rank: int, world_size: int, folder: str) -> dict:
    """Fresh processes: load the checkpoints and train the remaining steps."""
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = torch.load(os.path.join(folder, f"topk{rank}.pt"), weights_only=True)
        model = net()
        model.load_state_dict(saved["model"])
        sizes = {n: p.numel() for n, p in model.named_parameters()}
        state, records = topk_state(), []
        state.load_state_dict(saved["hook"])
        train(wrap(model, TINY_CAP_MB, state, records), range(SAVE_AFTER, STEPS))
        out["topk_layouts"] = [names for step, names, _ in records if step == SAVE_AFTER]
        out["topk_matches"] = _equal(residuals_by_name(state, model), reference_residuals(records, saved["reference"], sizes))
        saved = torch.load(os.path.join(folder, f"powersgd{rank}.pt"), weights_only=True)
        model = net()
        model.load_state_dict(saved["model"])
        state = gradzip.CompressionState(POWERSGD).bind(model)
        state.load_state_dict(saved["hook"])
        train(wrap(model, TINY_CAP_MB, state), range(SAVE_AFTER, STEPS))
        out["powersgd"] = flat_params(model)
    out["warnings"] = [str(w.message) for w in caught if "feedback" in str(w.message) or "residual" in str(w.message)]
    return out


def _equal(got: dict, want: dict) -> bool:
    return set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_state_follows_parameters_through_the_rebuild_and_a_fresh_process_and_rounds_stay_ordered(tmp_path):
    first = run_ranks(first_run, 2, str(tmp_path))
    resumed = run_ranks(resumed_run, 2, str(tmp_path))
    for rank in range(2):
        out, again = first[rank], resumed[rank]
        # The rebuild moved the last layer's weight to the first layer's slot.
        first_layout, rebuilt = out["layouts"]
        assert len(first_layout) == 1 and first_layout[0][0] == "0.weight"
        assert len(rebuilt) == 7 and rebuilt[0] == ["6.weight"]
        assert out["one_bucket_orders"][0][0] == "0.weight" and out["one_bucket_orders"][-1][0] == "6.weight"
        assert out["topk_saved_matches"] and out["one_bucket_matches"]
        # PowerSGD: one parameter per bucket and one bucket for all give the same parameters.
        assert torch.equal(out["powersgd_tiny"], out["powersgd_big"])
        # Fresh processes meet the first layout again and carry on exactly.
        assert len(again["topk_layouts"][0]) == 7 and again["topk_matches"]
        assert torch.equal(again["powersgd"], out["powersgd_tiny"])
        assert out["warnings"] == [] and again["warnings"] == []
    assert torch.equal(first[0]["powersgd_tiny"], first[1]["powersgd_tiny"])
    assert torch.equal(first[0]["unused_map"], first[1]["unused_map"])
