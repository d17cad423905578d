"""A rollback in-process over a skipped step: the state saved before the step is loaded into the
SAME model, optimizer and DDP hook state after every rank skipped it (one rank's gradient was
inf), and training goes on from there on clean gradients.

The reducer's ledger remembers the number of the exchange that carried the NaN marker; the
loaded state numbers exchanges from the save again, so the clean retake reuses that number. Its
error-feedback residual updates must be kept: the run must be bit-identical to one that never
saw the bad step, and to fresh objects resumed from the save. Covers LocalAdamW (which numbers
its own exchanges) with a sparsifying and a quantising codec, and the DDP comm hook
(``CompressionState``, whose ``step`` numbers them)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.optim_runs import all_equal, backward, params_of, tiny_model
from helpers.tiny_run import same
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from gradzip.optim import LocalAdamW
from gradzip.testing import run_ranks

pytestmark = pytest.mark.dist

STEPS = 6
BAD = 2  # the step one rank's gradient is inf in; at least two clean steps follow it
BAD_RANK = 2
CODECS = ("topk:ratio=0.5", "int8")
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-2, "weight_decay": 0.1}


def _residual_count(exchange_state: dict) -> int:
    return len(exchange_state["feedback"]["residuals"])


# ----- LocalAdamW --------------------------------------------------------------------------


def _train(rank: int, model, opt, steps) -> None:
    """Steps ``steps`` of ``opt`` on :func:`backward`'s gradients (int8 is multi-round: no
    ``payload_nbytes``, so not ``optim_runs.train``)."""
    for step in steps:
        opt.zero_grad()
        backward(model, rank, step)
        opt.step()


def _local_adamw(rank: int, world_size: int) -> dict:
    out = {}
    for spec in CODECS:
        def make(seed: int = 0, spec: str = spec):
            model = tiny_model(seed)
            return model, LocalAdamW(model.parameters(), compressor=spec, **HYPER)

        model, opt = make()
        _train(rank, model, opt, range(BAD))
        saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        _train(rank, model, opt, range(BAD, STEPS))
        clean = params_of(model)

        fresh, fresh_opt = make(9)
        fresh.load_state_dict(saved[0])
        fresh_opt.load_state_dict(copy.deepcopy(saved[1]))
        _train(rank, fresh, fresh_opt, range(BAD, STEPS))

        model, opt = make()
        _train(rank, model, opt, range(BAD))
        # its own save (a loaded optimizer shares the saved tensors: ``saved`` is spent above)
        own = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        opt.zero_grad()
        backward(model, rank, BAD)
        if rank == BAD_RANK:
            model[2].bias.grad[1] = float("inf")
        opt.step()
        skipped = opt.last_step_skipped
        model.load_state_dict(own[0])  # the rollback: the same objects
        opt.load_state_dict(own[1])
        _train(rank, model, opt, range(BAD, STEPS))

        out[spec] = {
            "saved_residuals": _residual_count(saved[1]["gradzip"]["exchange"]),
            "skipped": skipped,
            "moved": not all_equal(clean, params_of(tiny_model(0))),
            "resumed_equal": all_equal(params_of(fresh), clean),
            "rollback_equal": all_equal(params_of(model), clean),
            "rollback_state_equal": same(opt.state_dict(), fresh_opt.state_dict()),
        }
    return out


def test_local_adamw_rollback_over_a_skipped_step_keeps_the_retake_residuals():
    results = run_ranks(_local_adamw, 3)
    for rank, r in enumerate(results):
        for spec in CODECS:
            entry = r[spec]
            assert entry["saved_residuals"] > 0, (spec, rank)  # the residuals matter to the run
            assert entry["skipped"], (spec, rank)
            assert entry["moved"], (spec, rank)
            assert entry["resumed_equal"], (spec, rank)
            assert entry["rollback_equal"], f"{spec}: rank {rank} drifted after rolling back over the skipped step"
            assert entry["rollback_state_equal"], (spec, rank)


# ----- the DDP comm hook -------------------------------------------------------------------


HOOK_SPEC = "topk:ratio=0.5"


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1009 * rank + step)
    return torch.randn(5, 8, generator=gen), torch.randn(5, 5, generator=gen)


def _ddp_step(ddp, opt, rank: int, step: int, *, spoil: bool = False) -> bool:
    """One step; returns whether it was taken (skipped when the averaged gradient is not finite)."""
    x, y = _batch(rank, step)
    if spoil:
        x[0, 0] = float("inf")
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    if not all(bool(torch.isfinite(p.grad).all()) for p in ddp.parameters()):
        return False
    opt.step()
    return True


def _ddp_hook(rank: int, world_size: int) -> dict:
    def make():
        model = tiny_model(0)
        ddp = DDP(model)
        state = gradzip.CompressionState(HOOK_SPEC)
        ddp.register_comm_hook(state, gradzip.compression_hook)
        return model, ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    model, ddp, state, opt = make()
    for step in range(STEPS):
        _ddp_step(ddp, opt, rank, step)
    clean, clean_state = params_of(model), state.state_dict()

    model, ddp, state, opt = make()
    for step in range(BAD):
        _ddp_step(ddp, opt, rank, step)
    saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), state.state_dict()
    taken = _ddp_step(ddp, opt, rank, BAD, spoil=rank == BAD_RANK)
    model.load_state_dict(saved[0])  # the rollback: the same model, optimizer and hook state
    opt.load_state_dict(saved[1])
    state.load_state_dict(saved[2])
    for step in range(BAD, STEPS):
        _ddp_step(ddp, opt, rank, step)
    return {
        "saved_residuals": _residual_count(saved[2]["reducer"]),
        "skipped": not taken,
        "rollback_equal": all_equal(params_of(model), clean),
        "hook_state_equal": same(state.state_dict(), clean_state),
    }


def test_ddp_hook_rollback_over_a_skipped_step_keeps_the_retake_residuals():
    results = run_ranks(_ddp_hook, 3)
    for rank, r in enumerate(results):
        assert r["saved_residuals"] > 0, rank
        assert r["skipped"], rank
        assert r["rollback_equal"], f"rank {rank} drifted after rolling back the hook state over the skipped step"
        assert r["hook_state_equal"], rank
