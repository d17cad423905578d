"""TSR-Adam's narrower wire: cores and sketches summed in bfloat16 (``wire_bits=16``) and the dense
parameters' gradients as int8 codes on shared scales with error feedback (``dense_int8``), on real
gloo ranks against a single-process reference written out here (bit for bit), bytes against the
formula, exact resume with the residuals, and non-finite steps that leave no trace."""

from __future__ import annotations

import pytest
import torch
from helpers import tsr_reference
from helpers.optim_runs import backward, params_unchanged, resumed, skip_and_retake, tiny_model, train

from gradzip.optim import TSRAdam
from gradzip.testing import run_ranks

STEPS = 7
RESUME_AT = 4  # after a refresh (update_gap 3: steps 0, 3, 6), with residuals in the memory
HYPER = {"lr": 2e-2, "weight_decay": 0.1, "approx_rank": 2, "update_gap": 3, "scale": 0.75, "oversampling": 2,
         "power_iters": 1, "seed": 5, "wire_bits": 16, "dense_int8": True}
LEVELS = 63  # int8 levels per rank at 2 ranks: floor(127 / 2)


def expected_bytes(step: int) -> int:
    """The formula for the tiny model (Linear(8, 6), Linear(6, 5)) at 16 bits: cores 2 x 2 of both
    weights, 2 bytes each; on refresh steps (1 + power_iters) * l * (m + n) sketch elements with
    l = min(2 + 2, m, n) = 4; the 11 bias elements in one int8 bucket: 11 codes and one fp32 scale."""
    core = 2 * (2 * 2 + 2 * 2)
    refresh = 2 * 2 * 4 * ((6 + 8) + (5 + 6)) if step % 3 == 0 else 0
    return core + refresh + 11 + 4


# ----- the single-process reference ------------------------------------------------------------


def _bf16_mean(parts: list[torch.Tensor]) -> torch.Tensor:
    """Two ranks' mean on a bfloat16 wire: each share divided by 2 in fp32 and rounded to bf16,
    their sum rounded to bf16 (the sum of two bf16 numbers is exact in fp32), back to fp32."""
    a, b = ((p / 2).to(torch.bfloat16).float() for p in parts)
    return (a + b).to(torch.bfloat16).float()


def _int8_bias_mean(residuals: list[torch.Tensor]):
    """The biases' mean as int8 codes on the larger magnitude of both ranks (error-compensated,
    rounded to nearest at 63 levels, the rounding kept per rank in ``residuals``)."""
    def mean(per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        compensated = [torch.cat(g) + residuals[r] for r, g in enumerate(per_rank)]
        scale = max(float(x.abs().max()) for x in compensated)
        codes = [torch.round(x / scale * LEVELS) for x in compensated]
        for r, (x, c) in enumerate(zip(compensated, codes)):
            residuals[r] = x - c / LEVELS * scale
        out = (codes[0] + codes[1]) / (LEVELS * len(per_rank)) * scale
        return list(out.split([g.numel() for g in per_rank[0]]))

    return mean


def reference_run(steps: int) -> list[torch.Tensor]:
    """Two ranks of the algorithm (:mod:`helpers.tsr_reference`) with sketches and cores averaged
    on a bf16 wire and the biases as int8 codes with error feedback, AdamW on the decoded mean."""
    return tsr_reference.reference_run(lambda: tiny_model(0), backward, HYPER, world_size=2, steps=steps,
                                       mean=_bf16_mean, bias_mean=_int8_bias_mean([torch.zeros(11), torch.zeros(11)]))


# ----- real ranks ------------------------------------------------------------------------------


def _ranks(rank: int, world_size: int) -> dict:
    out: dict = {}
    model = tiny_model(0)
    opt = TSRAdam(model.parameters(), **HYPER)
    saves, bytes_log = [], []
    train(rank, model, opt, range(STEPS), resume_at=RESUME_AT, saves=saves, bytes_log=bytes_log)
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["bytes"] = bytes_log
    out["mean_bytes"] = opt.mean_payload_nbytes()
    out["saved_has_residual"] = bool(saves[0][1]["gradzip"]["exchange"]["feedback"])

    fresh = tiny_model(9)
    out["resumed"] = resumed(rank, saves[0], fresh, TSRAdam(fresh.parameters(), **HYPER), range(RESUME_AT, STEPS))

    # A non-finite bias gradient on rank 1 at a plain step (4) and at a refresh step (6): every
    # rank skips the step, its residuals put back, and retakes it on the clean gradient.
    def spoil(model, rank):
        if rank == 1:
            model[2].bias.grad[0] = float("nan")

    def check(before, model, opt):
        return (opt.last_step_skipped, params_unchanged(before[0], model), opt.steps_taken,
                _same_feedback(before[1], opt))

    model = tiny_model(0)
    opt = TSRAdam(model.parameters(), **HYPER)
    out["skips"] = skip_and_retake(rank, model, opt, range(STEPS), bad_steps=(4, 6), spoil=spoil, check=check)
    out["after_skips"] = [p.detach().clone() for p in model.parameters()]
    return out


def _same_feedback(before: dict, opt: TSRAdam) -> bool:
    a = before["gradzip"]["exchange"]["feedback"]
    b = opt.state_dict()["gradzip"]["exchange"]["feedback"]
    flat_a, flat_b = _tensors(a), _tensors(b)
    return len(flat_a) == len(flat_b) > 0 and all(torch.equal(x, y) for x, y in zip(flat_a, flat_b))


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for key in sorted(obj, key=repr) for t in _tensors(obj[key])]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return []


def test_bf16_cores_and_int8_dense_gradients_on_two_gloo_ranks_equal_the_reference_bit_for_bit():
    results = run_ranks(_ranks, 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks compute with one thread; LAPACK's rounding may depend on it
    try:
        reference = reference_run(STEPS)
    finally:
        torch.set_num_threads(threads)
    plain = tiny_model(0)
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], reference))
        assert not all(torch.equal(a, b) for a, b in zip(r["params"], plain.parameters()))
        assert r["saved_has_residual"]
        assert all(torch.equal(a, b) for a, b in zip(r["resumed"], reference))
        assert all(torch.equal(a, b) for a, b in zip(r["after_skips"], reference))
        assert r["skips"] == [(True, True, 4, True), (True, True, 6, True)]
        for step, (predicted, popped) in enumerate(r["bytes"]):
            assert predicted == popped["payload_bytes"] == expected_bytes(step)
        assert r["mean_bytes"] == pytest.approx(2 * 8 + 15 + 2 * 2 * 4 * 25 / 3)
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))


def test_a_state_dict_of_the_other_dense_exchange_is_refused_before_loading():
    model = tiny_model(0)
    saved = TSRAdam(model.parameters(), approx_rank=2, dense_int8=True).state_dict()
    plain = TSRAdam(model.parameters(), approx_rank=2)
    with pytest.raises(ValueError, match="dense_int8=True; this optimizer has dense_int8=False"):
        plain.load_state_dict(saved)
    with pytest.raises(ValueError, match="dense_int8=False; this optimizer has dense_int8=True"):
        TSRAdam(model.parameters(), approx_rank=2, dense_int8=True).load_state_dict(plain.state_dict())


@pytest.mark.parametrize("kwargs, message", [
    ({"wire_bits": 8}, "wire_bits must be one of 16, 32; got 8"),
    ({"wire_bits": 16.0}, "wire_bits must be one of 16, 32"),
    ({"dense_int8": "yes"}, "dense_int8"),
])
def test_bad_wire_settings_raise_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TSRAdam(tiny_model().parameters(), approx_rank=2, **kwargs)


def _three_ranks(rank: int, world_size: int) -> dict:
    model = tiny_model(0)
    opt = TSRAdam(model.parameters(), **HYPER)
    bytes_log: list = []
    train(rank, model, opt, range(STEPS), bytes_log=bytes_log)
    return {"params": [p.detach().clone() for p in model.parameters()], "bytes": bytes_log}


def test_three_ranks_end_bit_identical_and_send_the_formula():
    """At an odd world size the bf16 sums run in gloo's order and the int8 codes at 42 levels; the
    ranks still agree to the bit, and the bytes do not depend on the world size."""
    results = run_ranks(_three_ranks, 3)
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], results[0]["params"]))
        for step, (predicted, popped) in enumerate(r["bytes"]):
            assert predicted == popped["payload_bytes"] == expected_bytes(step)
    assert not all(torch.equal(a, b) for a, b in zip(results[0]["params"], tiny_model(0).parameters()))


def _uncompressed_group(rank: int, world_size: int) -> dict:
    model = tiny_model(0)
    weight, bias, last_weight, last_bias = model.parameters()
    opt = TSRAdam([{"params": [weight], "approx_rank": 2}, {"params": [bias], "compress": False},
                   {"params": [last_weight, last_bias], "approx_rank": None}],
                  lr=1e-2, oversampling=2, power_iters=0, update_gap=100, dense_int8=True)
    model.zero_grad()
    backward(model, rank, 0)
    grads = [p.grad.clone() for p in (bias, last_bias)]
    predicted = opt.payload_nbytes()
    opt.step()
    return {"predicted": predicted, "popped": opt.metrics.pop(), "grads": grads,
            "bias": bias.detach().clone(), "start": tiny_model(0)[0].bias.detach().clone()}


def test_a_group_with_compress_false_travels_uncompressed_under_dense_int8():
    """The bias of a ``compress=False`` group rides in the fp32 core buffer (its mean exact, AdamW's
    step on it), the other dense parameters go as int8: the core 2 x 2, one sketch of l = 4
    columns for the 6 x 8 weight, the 6 fp32 bias elements; 30 + 5 int8 codes and one scale."""
    results = run_ranks(_uncompressed_group, 2)
    expected = 4 * (2 * 2) + 4 * 4 * (6 + 8) + 4 * 6 + (30 + 5) + 4
    mean = (results[0]["grads"][0] / 2) + (results[1]["grads"][0] / 2)
    bias = torch.nn.Parameter(results[0]["start"].clone())
    bias.grad = mean
    torch.optim.AdamW([bias], lr=1e-2).step()
    for r in results:
        assert r["predicted"] == r["popped"]["payload_bytes"] == expected
        assert torch.equal(r["bias"], bias.detach())
