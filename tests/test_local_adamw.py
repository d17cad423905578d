"""Local AdamW: AdamW bit for bit on one rank; on real gloo ranks (2 and 3) the written-out
algorithm (each rank's own moments, Top-K of the update plus its residual, the mean of the
gathered picks), parameters bit-identical across ranks, bytes equal to the codec's formula, exact
resume, non-finite steps skipped on every rank without a trace, matrix codecs fed the
parameters' shapes, and bad settings."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.optim_runs import (
    backward,
    nan_in_rank0_bias,
    params_unchanged,
    resumed,
    skip_and_retake,
    tiny_model,
    train,
)

from gradzip.optim import LocalAdamW
from gradzip.testing import run_ranks

STEPS = 6
RESUME_AT = 3
# eps well above 0: the first AdamW update of every coordinate is +-lr otherwise, and Top-K of ties
# may pick any of them
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-2, "weight_decay": 0.1}
RATIO = 0.1


def numel() -> int:
    return sum(p.numel() for p in tiny_model().parameters())


def kept() -> int:
    return max(1, min(numel(), round(RATIO * numel())))


# ----- the single-process reference ------------------------------------------------------------


@torch.no_grad()
def reference_run(world_size: int, steps: int) -> list[torch.Tensor]:
    """The algorithm written out with plain tensors: per rank, AdamW's moments of its own
    gradient and its update; Top-K of update + residual over the whole model (one bucket); the
    mean of every rank's picks; weight decay, then the mean update, on the shared parameters."""
    model = tiny_model(0)
    lr, (b1, b2), eps, wd = HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]
    n = numel()
    m = [torch.zeros(n) for _ in range(world_size)]
    v = [torch.zeros(n) for _ in range(world_size)]
    e = [torch.zeros(n) for _ in range(world_size)]
    for step in range(1, steps + 1):
        total = torch.zeros(n)
        for rank in range(world_size):
            replica = copy.deepcopy(model)
            with torch.enable_grad():
                backward(replica, rank, step - 1)
            g = torch.cat([p.grad.reshape(-1) for p in replica.parameters()])
            m[rank] = b1 * m[rank] + (1 - b1) * g
            v[rank] = b2 * v[rank] + (1 - b2) * g * g
            u = -lr / (1 - b1**step) * m[rank] / ((v[rank] / (1 - b2**step)).sqrt() + eps)
            c = u + e[rank]
            idx = c.abs().topk(kept()).indices
            picked = torch.zeros(n)
            picked[idx] = c[idx]
            e[rank] = c - picked
            total += picked
        mean = total / world_size
        offset = 0
        for p in model.parameters():
            p.mul_(1 - lr * wd).add_(mean[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    return [p.detach().clone() for p in model.parameters()]


# ----- real ranks ------------------------------------------------------------------------------


def _optimizer(model: torch.nn.Module, **kwargs) -> LocalAdamW:
    # the default route: all_gather for Top-K, never two phases (the reference sums every pick)
    return LocalAdamW(model.parameters(), compressor=f"topk:ratio={RATIO}", **HYPER, **kwargs)


def _ranks(rank: int, world_size: int) -> dict:
    out: dict = {}
    model = tiny_model(0)
    opt = _optimizer(model)
    saves, bytes_log = [], []
    train(rank, model, opt, range(STEPS), resume_at=RESUME_AT, saves=saves, bytes_log=bytes_log)
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["bytes"] = bytes_log
    out["moment"] = opt.state[model[0].weight]["exp_avg"].clone()

    fresh = tiny_model(4)
    out["resumed"] = resumed(rank, saves[0], fresh, _optimizer(fresh), range(RESUME_AT, STEPS))

    # a NaN on rank 0 at step 2: every rank skips it and keeps nothing of it, then retakes the step
    def check(before, model, opt):
        after = opt.state_dict()
        same_state = all(torch.equal(before[1]["state"][k][name], after["state"][k][name])
                         for k in after["state"] for name in ("exp_avg", "exp_avg_sq"))
        same_residuals = repr(before[1]["gradzip"]["exchange"]) == repr(after["gradzip"]["exchange"])
        return opt.last_step_skipped, params_unchanged(before[0], model), same_state, same_residuals, opt.steps_taken

    model = tiny_model(0)
    opt = _optimizer(model)
    skips = skip_and_retake(rank, model, opt, range(STEPS), bad_steps=(2,), spoil=nan_in_rank0_bias,
                            check=check)
    out["skips"] = skips
    out["after_skips"] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_local_adamw_on_gloo_ranks_follows_the_reference(world_size):
    results = run_ranks(_ranks, world_size)
    reference = reference_run(world_size, STEPS)
    dense = 4 * numel()
    for r in results:
        for a, b in zip(r["params"], reference):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert all(torch.equal(a, b) for a, b in zip(r["resumed"], r["params"]))
        assert r["skips"] == [(True, True, True, True, 2)]
        assert all(torch.equal(a, b) for a, b in zip(r["after_skips"], r["params"]))
        flags = 4 * 4  # one fp32 flag for each of the 4 parameter tensors, in the uncompressed all_reduce
        for predicted, popped in r["bytes"]:
            # fp32 values, uint8 indices (83 elements)
            assert predicted == popped["payload_bytes"] == kept() * (4 + 1) + flags
            assert popped["dense_bytes"] == dense + flags
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], other["params"]))
    assert not torch.equal(results[0]["moment"], results[1]["moment"])  # the moments stay local


def _powersgd_ranks(rank: int, world_size: int) -> dict:
    model = tiny_model(0)
    opt = LocalAdamW(model.parameters(), compressor="powersgd:approx_rank=1", **HYPER)
    payloads = []
    for step in range(3):
        opt.zero_grad()
        backward(model, rank, step)
        opt.step()
        payloads.append(opt.metrics.pop()["payload_bytes"])
    return {"params": [p.detach().clone() for p in model.parameters()], "payloads": payloads}


def test_a_matrix_codec_sees_the_parameters_shapes():
    """PowerSGD at rank 1 sends P (m x 1) and Q (n x 1) per weight and the biases whole: 4 * (8 + 6
    + 6 + 5 + 6 + 5) bytes, where a flat bucket would have gone uncompressed; and a fp32 flag for
    each of the 4 tensors."""
    results = run_ranks(_powersgd_ranks, 3)
    for r in results:
        assert r["payloads"] == [4 * ((6 + 8) + 6 + (5 + 6) + 5) + 4 * 4] * 3
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[2]["params"]))


# ----- one process -----------------------------------------------------------------------------


def test_one_rank_is_torch_adamw_bit_for_bit():
    model, plain = tiny_model(0), tiny_model(0)
    opt = LocalAdamW(model.parameters(), compressor="topk:ratio=0.01", **HYPER)
    ref = torch.optim.AdamW(plain.parameters(), foreach=False, **HYPER)
    for step in range(STEPS):
        for m, o in ((model, opt), (plain, ref)):
            o.zero_grad()
            backward(m, 0, step)
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))


@pytest.mark.parametrize("kwargs, name", [
    ({"compressor": "auto"}, "compressor"),
    ({"compressor": "kimad"}, "compressor"),
    ({"compressor": "nosuchcodec"}, "nosuchcodec"),
    ({"compressor": "powersgd", "collective": "allgather"}, "collective"),
    ({"feedback_decay": 0.0}, "feedback_decay"),
    ({"compressor": "powersgd", "feedback_decay": 1.5}, r"feedback_decay must be in \(0, 1\]"),
    ({"lr": -1.0}, "lr"),
    ({"bucket_cap_mb": -1}, "bucket_cap_mb"),
])
def test_bad_settings_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LocalAdamW(tiny_model().parameters(), **kwargs)


def test_a_state_dict_of_another_codec_is_refused_before_loading():
    model = tiny_model(0)
    opt = LocalAdamW(model.parameters(), compressor="topk:ratio=0.1")
    backward(model, 0, 0)
    opt.step()
    other = LocalAdamW(tiny_model(0).parameters(), compressor="efsignsgd")
    with pytest.raises(ValueError, match="compressor"):
        other.load_state_dict(opt.state_dict())
    assert other.state_dict()["state"] == {} and other.steps_taken == 0


def test_the_first_moment_keeps_every_gradient_term():
    """cases.md C9: gradient 1.0 three times, beta1 0.9, from zero: the first moment is
    1 - 0.9**3 = 0.271 (an update out of place would lose the gradient's term)."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = LocalAdamW([p], compressor="topk:ratio=0.5", betas=(0.9, 0.999), weight_decay=0.0)
    for _ in range(3):
        p.grad = torch.ones(4)
        opt.step()
    torch.testing.assert_close(opt.state[p]["exp_avg"], torch.full((4,), 1 - 0.9**3))
    assert opt.steps_taken == 3 and float(opt.state[p]["step"]) == 3.0


def _mixed_ranks(rank: int, world_size: int) -> dict:
    """An fp32 and a bf16 parameter: two buckets (one dtype each), each update in its own dtype."""
    a = torch.nn.Parameter(torch.linspace(-1, 1, 12).view(3, 4))
    b = torch.nn.Parameter(torch.linspace(-1, 1, 8, dtype=torch.bfloat16))
    opt = LocalAdamW([a, b], compressor="topk:ratio=0.5", lr=1e-2)
    for step in range(3):
        gen = torch.Generator().manual_seed(17 * rank + step)
        a.grad = torch.randn(3, 4, generator=gen)
        b.grad = torch.randn(8, generator=gen).to(torch.bfloat16)
        opt.step()
    keys = sorted(opt.state_dict()["gradzip"]["exchange"]["feedback"]["residuals"])
    return {"a": a.detach().clone(), "b": b.detach().clone(), "keys": keys}


def test_parameters_of_two_dtypes_travel_in_a_bucket_each_and_keep_their_dtype():
    results = run_ranks(_mixed_ranks, 2)
    assert results[0]["keys"] == ["update 0", "update 1"]
    assert results[0]["b"].dtype == torch.bfloat16
    for name in ("a", "b"):
        assert torch.equal(results[0][name], results[1][name])
        assert bool(torch.isfinite(results[0][name].float()).all())


def _membership_ranks(rank: int, world_size: int) -> dict:
    """Four parameters; the third has no gradient on odd steps. A group with compress=False beside
    them is averaged exactly. Returns the residual keys, the parameters and the dense group's
    parameter next to the uncompressed mean written out."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6)) for _ in range(4)]
    dense = torch.nn.Parameter(torch.zeros(3))
    opt = LocalAdamW([{"params": params}, {"params": [dense], "compress": False}], compressor="topk:ratio=0.25",
                     lr=1e-2, eps=1e-2, weight_decay=0.0)
    expected = torch.zeros(3)
    for step in range(6):
        gen = torch.Generator().manual_seed(31 * rank + step)
        for i, p in enumerate(params):
            p.grad = None if (i == 2 and step % 2) else torch.randn(6, generator=gen)
        dense.grad = torch.full((3,), float(rank + 1))
        opt.step()
        # every rank's own AdamW step on a constant gradient g_r > 0 is -lr (bias-corrected
        # m / sqrt(v) = g / (g + eps)); the mean of the ranks' updates, uncompressed
        expected -= sum(1e-2 * g / (g + 1e-2) for g in range(1, world_size + 1)) / world_size
    keys = sorted(opt.state_dict()["gradzip"]["exchange"]["feedback"]["residuals"])
    return {"keys": keys, "params": [p.detach().clone() for p in params], "dense": dense.detach().clone(),
            "expected": expected}


def test_a_parameter_that_skips_a_step_keeps_its_bucket_and_a_dense_group_is_averaged_exactly():
    results = run_ranks(_membership_ranks, 3)
    for r in results:
        assert r["keys"] == ["update 0-3"]  # one residual: the membership never changed
        torch.testing.assert_close(r["dense"], r["expected"], rtol=1e-6, atol=1e-7)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], other["params"]))
        assert torch.equal(results[0]["dense"], other["dense"])


@pytest.mark.parametrize("group, name", [
    ({"maximize": True}, "maximize"),
    ({"amsgrad": True}, "amsgrad"),
    ({"compress": "no"}, "compress"),
    ({"eps": 0.0}, "eps"),
])
def test_settings_it_does_not_carry_out_are_refused(group, name):
    with pytest.raises(ValueError, match=name):
        LocalAdamW([{"params": tiny_model().parameters(), **group}])
    with pytest.raises(ValueError, match="real parameters"):
        LocalAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))])


def test_a_state_dict_of_another_collective_or_model_is_refused_before_loading():
    model = tiny_model(0)
    opt = LocalAdamW(model.parameters(), compressor="topk:ratio=0.1", collective="twophase")
    backward(model, 0, 0)
    opt.step()
    saved = opt.state_dict()
    other = LocalAdamW(tiny_model(0).parameters(), compressor="topk:ratio=0.1", collective="allgather")
    with pytest.raises(ValueError, match="collective"):
        other.load_state_dict(saved)
    wide = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5))  # 48 + 8 + 40 + 5 weights
    third = LocalAdamW(wide.parameters(), compressor="topk:ratio=0.1", collective="twophase")
    with pytest.raises(ValueError, match="do not fit"):
        third.load_state_dict(saved)
    for fresh in (other, third):
        assert fresh.state_dict()["state"] == {} and fresh.steps_taken == 0
