"""TSR-Adam: a single-process reference of the algorithm against real gloo ranks (bit for bit),
bytes per step against the formula, exact resume across a refresh, non-finite steps skipped on
every rank, the identity with Adam on the projected gradient, and bad settings."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tsr_reference
from helpers.optim_runs import params_unchanged, resumed, skip_and_retake, train

from gradzip.optim import TSRAdam
from gradzip.testing import run_ranks

STEPS = 7
RESUME_AT = 3  # the next step refreshes the bases (update_gap 3: steps 0, 3, 6)
HYPER = {"lr": 2e-2, "weight_decay": 0.1, "approx_rank": 2, "update_gap": 3, "scale": 0.75, "oversampling": 2,
         "power_iters": 1, "seed": 5}


def tiny_model(seed: int = 0) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1009 * rank + step)
    return torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)


def backward(model: torch.nn.Module, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    torch.nn.functional.mse_loss(model(x), y).backward()


def expected_bytes(step: int) -> int:
    """The docstring's formula for the tiny model: cores 2 x 2 of both weights, the biases dense,
    and on refresh steps (1 + power_iters) * l * (m + n) with l = min(2 + 2, m, n) = 4."""
    core = 4 * (2 * 2 + 2 * 2 + 6 + 4)
    refresh = 4 * 2 * 4 * ((6 + 8) + (4 + 6)) if step % 3 == 0 else 0
    return core + refresh


# ----- the single-process reference ------------------------------------------------------------


def reference_run(world_size: int, steps: int) -> list[torch.Tensor]:
    """The algorithm of the paper written out (:mod:`helpers.tsr_reference`) on the fp32 wire."""
    return tsr_reference.reference_run(lambda: tiny_model(0), backward, HYPER, world_size=world_size, steps=steps)


# ----- real ranks ------------------------------------------------------------------------------


def _ranks(rank: int, world_size: int) -> dict:
    out: dict = {}
    model = tiny_model(0)
    opt = TSRAdam(model.parameters(), **HYPER)
    saves, bytes_log = [], []
    train(rank, model, opt, range(STEPS), resume_at=RESUME_AT, saves=saves, bytes_log=bytes_log, grad=backward)
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["bytes"] = bytes_log
    out["mean_bytes"] = opt.mean_payload_nbytes()

    fresh = tiny_model(9)
    opt2 = TSRAdam(fresh.parameters(), **{**HYPER, "seed": 0, "power_iters": 0})  # restored from the state_dict
    out["resumed"] = resumed(rank, saves[0], fresh, opt2, range(RESUME_AT, STEPS), grad=backward)

    # A non-finite gradient on rank 1 at a plain step (4) and at a refresh step (6): every rank
    # skips the step and keeps parameters and state as they were.
    def spoil(model, rank):
        if rank == 1:
            next(iter(model.parameters())).grad[0, 0] = float("inf")

    def check(before, model, opt):
        return (opt.last_step_skipped, params_unchanged(before[0], model), opt.steps_taken,
                _states_equal(before[1], opt.state_dict()))

    model = tiny_model(0)
    opt = TSRAdam(model.parameters(), **HYPER)
    skips = skip_and_retake(rank, model, opt, range(STEPS), bad_steps=(4, 6), spoil=spoil, check=check,
                            grad=backward)
    out["skips"] = skips
    out["after_skips"] = [p.detach().clone() for p in model.parameters()]
    return out


def _states_equal(a: dict, b: dict) -> bool:
    for key in a["state"]:
        for name, value in a["state"][key].items():
            other = b["state"][key][name]
            if isinstance(value, torch.Tensor) and not torch.equal(value, other):
                return False
            if not isinstance(value, torch.Tensor) and value != other:
                return False
    return True


def test_tsr_adam_on_two_gloo_ranks_equals_the_reference_bit_for_bit():
    results = run_ranks(_ranks, 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks compute with one thread; LAPACK's rounding may depend on it
    try:
        reference = reference_run(2, STEPS)
    finally:
        torch.set_num_threads(threads)
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], reference))
        assert all(torch.equal(a, b) for a, b in zip(r["resumed"], reference))
        # the steps skipped for inf leave no trace: the run ends where the clean run ends
        assert all(torch.equal(a, b) for a, b in zip(r["after_skips"], reference))
        assert r["skips"] == [(True, True, 4, True), (True, True, 6, True)]
        dense = 4 * sum(p.numel() for p in tiny_model().parameters())
        for step, (predicted, popped) in enumerate(r["bytes"]):
            assert predicted == popped["payload_bytes"] == expected_bytes(step)
            assert popped["sent_bytes"] == popped["payload_bytes"]  # ring all_reduce at 2 ranks: 2 (W - 1) / W = 1
            assert popped["dense_bytes"] == dense
        assert r["mean_bytes"] == pytest.approx(4 * (8 + 10) + 4 * 2 * 4 * 24 / 3)
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))


# ----- one process -----------------------------------------------------------------------------


def test_identity_bases_at_full_rank_are_adamw():
    """U = V = I at r = m = n: the core is the gradient and the step is AdamW's."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = torch.nn.Linear(5, 5)
    reference = copy.deepcopy(model)
    opt = TSRAdam(model.parameters(), lr=1e-2, approx_rank=5, update_gap=1000)
    opt.set_bases(model.weight, torch.eye(5), torch.eye(5))
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(6):
        for m, o in ((model, opt), (reference, adamw)):
            o.zero_grad()
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
            m(x).square().sum().backward()
            o.step()
    torch.testing.assert_close(model.weight, reference.weight, rtol=1e-6, atol=1e-7)
    assert torch.equal(model.bias, reference.bias)  # the bias is dense: AdamW bit for bit


def test_fixed_bases_step_adam_on_the_projected_gradient():
    """With fixed orthonormal bases U (m x r), V (n x r) and no weight decay, W_t = W_0 + U X_t V^T
    where X runs torch.optim.Adam (from 0) on the projected gradients U^T G V."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        model = torch.nn.Linear(7, 6, bias=False)
        left = torch.linalg.qr(torch.randn(6, 3)).Q
        right = torch.linalg.qr(torch.randn(7, 3)).Q
    w0 = model.weight.detach().clone()
    opt = TSRAdam(model.parameters(), lr=1e-2, weight_decay=0.0, approx_rank=3, update_gap=1000)
    opt.set_bases(model.weight, left, right)
    core = torch.zeros(3, 3, requires_grad=True)
    adam = torch.optim.Adam([core], lr=1e-2)
    for step in range(8):
        opt.zero_grad()
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(step))
        model(x).sin().sum().backward()
        core.grad = left.T @ model.weight.grad @ right
        opt.step()
        adam.step()
        torch.testing.assert_close(model.weight.detach() - w0, left @ core.detach() @ right.T, rtol=1e-5, atol=1e-7)


def test_state_dict_resumes_bit_exactly_across_a_refresh_single_rank():
    def run(model, opt, steps):
        for step in steps:
            opt.zero_grad()
            x = torch.randn(3, 8, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            opt.step()

    model = tiny_model(1)
    opt = TSRAdam(model.parameters(), **HYPER)
    run(model, opt, range(2))
    saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    run(model, opt, range(2, 8))
    again = tiny_model(2)
    again.load_state_dict(saved[0])
    opt2 = TSRAdam(again.parameters(), **HYPER)
    opt2.load_state_dict(saved[1])
    assert opt2.state[next(iter(again.parameters()))]["refreshed_at"] == 0
    run(again, opt2, range(2, 8))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"approx_rank": 7}, "approx_rank"),  # larger than the 6 rows of the first weight
        ({"approx_rank": 0}, "approx_rank"),
        ({"update_gap": 0}, "update_gap"),
        ({"scale": 0.0}, "scale"),
        ({"oversampling": -1}, "oversampling"),
        ({"power_iters": -1}, "power_iters"),
        ({"lr": 0.0}, "lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
    ],
)
def test_bad_settings_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        TSRAdam(tiny_model().parameters(), **{"approx_rank": 2, **kwargs})


def test_rank_error_names_the_shape_and_dense_groups_take_any_shape():
    with pytest.raises(ValueError, match=r"shape \(6, 8\); give the weights of other sizes parameter groups"):
        TSRAdam(tiny_model().parameters(), approx_rank=7)
    model = tiny_model()
    opt = TSRAdam([{"params": [model[0].weight], "approx_rank": None}, {"params": [model[2].weight], "approx_rank": 4}])
    assert not opt.is_low_rank(model[0].weight, opt.param_groups[0])
    with pytest.raises(ValueError, match="takes dense steps"):
        opt.set_bases(model[0].weight, torch.eye(6), torch.eye(8))
    with pytest.raises(ValueError, match="left and right must be"):
        opt.set_bases(model[2].weight, torch.eye(4), torch.eye(6))


def test_bf16_weights_refresh_their_bases_in_fp32_and_keep_their_dtype():
    """CPU LAPACK has no bf16 QR or SVD: the refresh computes them in fp32 and keeps the weight's dtype."""
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 12, generator=gen).to(torch.bfloat16))
    opt = TSRAdam([{"params": [w], "approx_rank": 4, "update_gap": 2}], lr=1e-3)
    before = w.detach().clone()
    for _ in range(3):
        w.grad = torch.randn(16, 12, generator=gen).to(torch.bfloat16)
        opt.step()
    state = opt.state[w]
    assert w.dtype == state["left"].dtype == state["right"].dtype == torch.bfloat16
    eye = torch.eye(4)
    assert torch.allclose(state["left"].float().T @ state["left"].float(), eye, atol=0.05)
    assert bool(torch.isfinite(w).all()) and not torch.equal(w.detach(), before)


def _weight_space_momenta(moment_transfer: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(U m V^T after the step, beta1 * that before it + (1 - beta1) * G) per step, full rank,
    bases refreshed every 2 steps from the gradient."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = torch.nn.Linear(5, 5, bias=False)
    opt = TSRAdam(model.parameters(), lr=1e-2, betas=(0.9, 0.999), approx_rank=5, update_gap=2,
                  moment_transfer=moment_transfer)
    pairs, before = [], torch.zeros(5, 5)
    for step in range(6):
        opt.zero_grad()
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
        model(x).sin().sum().backward()
        grad = model.weight.grad.clone()
        opt.step()
        state = opt.state[model.weight]
        after = state["left"] @ state["exp_avg"] @ state["right"].T
        pairs.append((after, 0.9 * before + 0.1 * grad))
        before = after
    return pairs


def test_moment_transfer_keeps_the_momentum_across_a_refresh():
    """At full rank the bases are orthogonal, so carried over to the new bases the momentum in
    weight space is AdamW's, ``beta1 M + (1 - beta1) G``, on refresh steps too; kept as numbers in
    the old core coordinates (the reference code's way, the default) it is not."""
    for after, expected in _weight_space_momenta(True):
        torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-6)
    kept = _weight_space_momenta(False)
    assert not torch.allclose(kept[2][0], kept[2][1], rtol=1e-4, atol=1e-6)  # step 2 refreshes
