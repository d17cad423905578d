"""TSR-Adam's ``wire_bits=16`` and ``dense_int8`` on hostile inputs: a model with no low-rank weight,
zero-element and one-element parameters in mixed dtypes with ``bucket_cap_mb=0``, a bfloat16 sum
that overflows by rounding (ten ranks), a non-finite gradient on one of three ranks with a dense
parameter that has no gradient on some steps, a rollback into the same optimizer over a skipped
step, and world size 1. Expected values are computed here, not by the optimizer."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers.optim_runs import all_equal, backward, params_of, tiny_model, train

from gradzip.comm.queue import CollectiveQueue
from gradzip.metrics import StepMetrics
from gradzip.optim import TSRAdam
from gradzip.optim.collectives import mean_all_reduce
from gradzip.testing import run_ranks

HYPER = {"lr": 2e-2, "weight_decay": 0.1, "approx_rank": 2, "update_gap": 2, "oversampling": 2, "power_iters": 1,
         "seed": 3, "wire_bits": 16, "dense_int8": True}
BF16_MAX = torch.finfo(torch.bfloat16).max


# ----- two ranks: no low-rank weight; odd sizes and dtypes, one bucket each ----------------------


def _int8_mean_by_hand(grads: list[torch.Tensor]) -> torch.Tensor:
    """Two ranks' int8 mean of a tensor of at most 256 elements with no residual yet: one scale,
    the largest magnitude over both ranks; codes round(g / s * 63); decoded sum / 126 * s."""
    scale = max(float(g.abs().max()) for g in grads)
    codes = sum(torch.round(g / scale * 63) for g in grads)
    return torch.div(codes, 126).mul_(scale)


def _bias_grad(rank: int) -> torch.Tensor:
    return torch.tensor([0.5, -1.0, 2.0, 0.25, -3.0, 1.5]) * (rank + 1)


def _two_ranks(rank: int, world_size: int) -> dict:
    out: dict = {}
    # only dense parameters: no cores, so nothing but the int8 exchange is sent
    bias = torch.nn.Parameter(torch.linspace(-1, 1, 6))
    opt = TSRAdam([bias], **HYPER)
    bias.grad = _bias_grad(rank)
    out["dense_only_bytes"] = opt.payload_nbytes()
    opt.step()
    out["dense_only_popped"] = opt.metrics.pop()["payload_bytes"]
    out["dense_only"] = bias.detach().clone()
    out["dense_only_steps"] = opt.steps_taken

    # only a zero-element parameter, in the core buffer: nothing to send (gloo refuses a
    # zero-element collective), and the step is taken
    empty = torch.nn.Parameter(torch.zeros(0))
    opt = TSRAdam([empty], **{**HYPER, "dense_int8": False})
    empty.grad = torch.zeros(0)
    opt.step()
    out["empty"] = (opt.steps_taken, opt.metrics.pop()["payload_bytes"], opt.payload_nbytes())

    # bucket_cap_mb=0 over a low-rank fp64 weight, a 1-element fp64 bias (int8: 5 < 8 raw bytes), a
    # 1-element bf16 one (raw: 5 >= 2), a 300-element bf16 one and a zero-element fp32 one
    params = [torch.nn.Parameter(torch.randn(6, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)),
              torch.nn.Parameter(torch.ones(1, dtype=torch.float64)),
              torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.zeros(300, dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.zeros(0))]
    opt = TSRAdam(params, **{**HYPER, "bucket_cap_mb": 0})
    log = []
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * rank + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
        predicted = opt.payload_nbytes()
        opt.step()
        log.append((predicted, opt.metrics.pop()["payload_bytes"]))
    out["mixed_bytes"] = log
    out["mixed"] = [p.detach().clone() for p in params]
    out["mixed_dtypes"] = [p.dtype for p in params]
    return out


@pytest.mark.dist
def test_dense_only_and_odd_sized_mixed_dtype_parameters_on_two_ranks():
    results = run_ranks(_two_ranks, 2)
    # the bias alone: AdamW's step on the int8 mean, 6 codes and one fp32 scale on the wire
    expected = torch.nn.Parameter(torch.linspace(-1, 1, 6))
    adamw = torch.optim.AdamW([expected], lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], foreach=False)
    expected.grad = _int8_mean_by_hand([_bias_grad(0), _bias_grad(1)])
    adamw.step()
    # fp64 core 2 x 2 and sketches (1 + 1) * min(2 + 2, 6, 8) * (6 + 8) at 2 bytes (bfloat16) on
    # refresh steps 0 and 2; dense: 1 + 4 (fp64 as int8), 2 (bf16 raw), 300 + 4 * 2, 0
    core, sketch, dense = 2 * 4, 2 * 2 * 4 * 14, 5 + 2 + 308 + 0
    for r in results:
        assert r["dense_only_steps"] == 1
        assert r["empty"] == (1, 0, 0)
        assert r["dense_only_bytes"] == r["dense_only_popped"] == 6 + 4
        assert torch.equal(r["dense_only"], expected.detach())
        assert [p for p, _ in r["mixed_bytes"]] == [core + sketch + dense, core + dense, core + sketch + dense]
        assert all(predicted == popped for predicted, popped in r["mixed_bytes"])
        assert r["mixed_dtypes"] == [torch.float64, torch.float64, torch.bfloat16, torch.bfloat16, torch.float32]
        assert all(bool(torch.isfinite(p).all()) for p in r["mixed"])
        assert all_equal(r["mixed"], results[0]["mixed"])


# ----- ten ranks: a bfloat16 sum that overflows by rounding ------------------------------------


def _ten_ranks(rank: int, world_size: int) -> dict:
    flat = torch.full((4,), 3.4e38)
    mean, finite = mean_all_reduce(flat, key=("huge",), dense_bytes=0, group=None, queue=CollectiveQueue(),
                                   metrics=StepMetrics(), codec="test", wire_dtype=torch.bfloat16)
    bias = torch.nn.Parameter(torch.ones(3))
    opt = TSRAdam([bias], **{**HYPER, "dense_int8": False})
    bias.grad = torch.full((3,), 3.4e38)
    opt.step()
    return {"mean": mean, "finite": finite, "bias": bias.detach().clone(), "skipped": opt.skipped_steps}


@pytest.mark.dist
def test_a_bf16_sum_that_overflows_by_rounding_is_saturated_not_passed_on_as_inf():
    """Each rank's share is saturated at max / 10, which rounds up in bfloat16; ten of them sum to
    inf. The mean must be bfloat16's largest finite value (the contract of gradzip.comm.nonfinite),
    and a bias whose gradient is that large must take AdamW's step on it, not turn NaN."""
    results = run_ranks(_ten_ranks, 10)
    expected = torch.nn.Parameter(torch.ones(3))
    adamw = torch.optim.AdamW([expected], lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], foreach=False)
    expected.grad = torch.full((3,), BF16_MAX)
    adamw.step()
    assert bool(torch.isfinite(expected).all())
    for r in results:
        assert r["finite"] is True
        assert torch.equal(r["mean"], torch.full((4,), BF16_MAX))
        assert r["skipped"] == 0
        assert torch.equal(r["bias"], expected.detach())


# ----- three ranks: non-finite on one rank, missing gradients, rollback, resume -----------------

STEPS = 5
BAD = 2  # a refresh step (update_gap 2)


def _grad(model: torch.nn.Module, rank: int, step: int) -> None:
    """The tiny model's gradient, without the first bias's on odd steps (its bucket changes)."""
    backward(model, rank, step)
    if step % 2 == 1:
        model[0].bias.grad = None


def _spoil(model: torch.nn.Module, rank: int) -> None:
    if rank == 2:
        model[2].bias.grad[1] = float("inf")


def _three_ranks(rank: int, world_size: int) -> dict:
    out: dict = {}
    model = tiny_model(0)
    opt = TSRAdam(model.parameters(), **HYPER)
    saves: list = []
    train(rank, model, opt, range(STEPS), resume_at=BAD, saves=saves, grad=_grad)
    out["clean"] = params_of(model)
    out["saved_residuals"] = len(saves[0][1]["gradzip"]["exchange"]["feedback"]["residuals"])

    fresh = tiny_model(9)
    fresh_opt = TSRAdam(fresh.parameters(), **HYPER)
    fresh.load_state_dict(saves[0][0])
    fresh_opt.load_state_dict(saves[0][1])
    train(rank, fresh, fresh_opt, range(BAD, STEPS), grad=_grad)
    out["resumed"] = params_of(fresh)

    # the bad step skipped by every rank and retaken in place; then the same with a rollback of
    # model and optimizer (the same objects) to the state saved before it
    for mode in ("retake", "rollback"):
        model = tiny_model(0)
        opt = TSRAdam(model.parameters(), **HYPER)
        record = None
        for step in range(STEPS):
            opt.zero_grad()
            _grad(model, rank, step)
            if step == BAD:
                before = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
                _spoil(model, rank)
                opt.step()
                record = (opt.last_step_skipped, opt.steps_taken, all_equal(list(before[0].values()), params_of(model)))
                if mode == "rollback":
                    model.load_state_dict(before[0])
                    opt.load_state_dict(before[1])
                opt.zero_grad()
                _grad(model, rank, step)
            opt.step()
        out[mode] = (record, params_of(model))
    return out


@pytest.mark.dist
def test_inf_on_one_of_three_ranks_leaves_no_trace_through_retake_rollback_and_resume():
    results = run_ranks(_three_ranks, 3)
    for r in results:
        assert r["saved_residuals"] > 0  # the int8 exchange had kept a rounding error by then
        assert not all_equal(r["clean"], params_of(tiny_model(0)))
        assert all_equal(r["clean"], results[0]["clean"])
        assert all_equal(r["resumed"], r["clean"])
        for mode in ("retake", "rollback"):
            record, params = r[mode]
            assert record == (True, BAD, True), mode  # skipped, counter unchanged, parameters untouched
            assert all_equal(params, r["clean"]), mode


# ----- world size 1 ----------------------------------------------------------------------------


@pytest.mark.unit
def test_world_size_one_trains_and_resumes_bit_exactly():
    model = tiny_model(0)
    opt = TSRAdam(model.parameters(), **HYPER)
    saves: list = []
    log: list = []
    train(0, model, opt, range(STEPS), resume_at=3, saves=saves, bytes_log=log)
    assert all(popped["payload_bytes"] == 0 for _, popped in log)  # nothing is sent
    assert saves[0][1]["gradzip"]["exchange"] == {"feedback": {"start_step": 0, "residuals": {}}}
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert not all_equal(params_of(model), params_of(tiny_model(0)))
    fresh = tiny_model(9)
    fresh_opt = TSRAdam(fresh.parameters(), **HYPER)
    fresh.load_state_dict(saves[0][0])
    fresh_opt.load_state_dict(saves[0][1])
    train(0, fresh, fresh_opt, range(3, STEPS))
    assert all_equal(params_of(fresh), params_of(model))
    assert math.isclose(opt.mean_payload_nbytes(), fresh_opt.mean_payload_nbytes())
