"""PowerSGD with fp16 factors (``factor_bits=16``): bytes, ranks bit-identical at 2-4 gloo ranks
and equal to a single-process reference, exact resume, non-finite input and the DDP hook."""

import math

import pytest
import torch
from aggregatable_runs import bucket_grad, check_nonfinite, ddp_steps, reduce_steps

from gradzip.compressors import build
from gradzip.compressors.base import seeded_generator
from gradzip.compressors.lowrank import PowerSGD
from gradzip.testing import run_ranks

# (12, 10) and (6, 8) are sent as factors at r = 2; (10,) and (3, 2) travel dense in fp32.
SHAPES = [(12, 10), (10,), (6, 8), (3, 2)]
SPEC = "powersgd:approx_rank=2,factor_bits=16"
STEPS, RESUME_AT = 4, 2


@pytest.mark.parametrize("bits", [8, 0, 64, "16"])
def test_bad_factor_bits_raise_value_error_naming_it(bits):
    with pytest.raises(ValueError, match="factor_bits"):
        PowerSGD(factor_bits=bits)


def test_payload_formula():
    codec = build(SPEC)
    assert codec.matrix_payload_nbytes((12, 10)) == (12 + 10) * 2 * 2
    assert codec.matrix_payload_nbytes((12, 10), torch.bfloat16) == (12 + 10) * 2 * 2
    assert codec.matrix_payload_nbytes((3, 2)) == 6 * 4
    assert build("powersgd:approx_rank=2").matrix_payload_nbytes((12, 10)) == (12 + 10) * 2 * 4


def _fp16_wire(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """What one rank's factor contributes to the fp16 sum, back in float64."""
    limit = torch.finfo(torch.float16).max
    return (t / world_size).clamp(-limit, limit).to(torch.float16).double()


def reference(world_size, codec, shapes, steps):
    """Every rank's output per step, from the method's definition in float64, fp16 rounding of
    each rank's factors applied as the wire does (the wire's own fp16 sums round further)."""
    offsets = [0] + list(torch.tensor([math.prod(s) for s in shapes]).cumsum(0).tolist())
    numel = offsets[-1]
    errors, q_memory, outs = {}, {}, []
    for step in range(steps):
        grads = [bucket_grad(rank, step, numel) for rank in range(world_size)]
        out = torch.empty(numel, dtype=torch.float64)
        for i, shape in enumerate(shapes):
            lo, hi = offsets[i], offsets[i + 1]
            if not codec.compresses(shape):
                out[lo:hi] = sum(g[lo:hi].double() / world_size for g in grads)
                continue
            n, m = shape[0], math.prod(shape[1:])
            r = codec.effective_rank(n, m)
            q = q_memory.get(i)
            if q is None:
                q = torch.randn(m, r, generator=seeded_generator(codec.seed, 0, (0, i))).double()
            mats = [g[lo:hi].view(n, m).double() + errors.get((rank, i), 0) for rank, g in enumerate(grads)]
            p = sum(_fp16_wire(mat @ q, world_size) for mat in mats)
            p_hat = torch.linalg.qr(p, mode="reduced").Q
            sent = [_fp16_wire(mat.T @ p_hat, world_size) for mat in mats]
            q_mean = sum(sent)
            for rank, (mat, q_sent) in enumerate(zip(mats, sent)):
                errors[(rank, i)] = mat - p_hat @ (q_sent * world_size).T
            q_memory[i] = q_mean
            out[lo:hi] = (p_hat @ q_mean.T).reshape(-1)
        outs.append(out.float())
    return outs


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_bit_identical_equal_reference_bytes_and_resume(world_size):
    results = run_ranks(reduce_steps, world_size, SPEC, SHAPES, STEPS, RESUME_AT)
    codec = build(SPEC)
    expected = reference(world_size, codec, SHAPES, STEPS)
    payload = sum(codec.matrix_payload_nbytes(s) for s in SHAPES)
    for res in results:
        assert res["bytes"] == [payload] * STEPS
        for step in range(STEPS):
            assert torch.equal(res["outs"][step], results[0]["outs"][step]), step
            # fp16 factors: the wire's fp16 sums and fp32 QR differ from the reference by
            # fp16 rounding, about 1e-3 relative.
            err = float((res["outs"][step] - expected[step]).norm() / expected[step].norm())
            assert err < 1e-2, (step, err)
        for got, want in zip(res["resumed"], res["outs"][RESUME_AT:]):
            assert torch.equal(got, want), "a resumed run differs"


def test_fp16_factors_decode_close_to_fp32_factors():
    low = run_ranks(reduce_steps, 2, SPEC, SHAPES, 1, 0)[0]["outs"][0]
    full = run_ranks(reduce_steps, 2, "powersgd:approx_rank=2", SHAPES, 1, 0)[0]["outs"][0]
    assert float((low - full).norm() / full.norm()) < 5e-3


def test_nonfinite_input_marks_every_rank_and_leaves_no_state():
    check_nonfinite(SPEC)


def test_ddp_hook_two_ranks_bit_identical():
    params = run_ranks(ddp_steps, 2, SPEC)
    assert torch.isfinite(params[0]).all()
    assert torch.equal(params[0], params[1])
