"""PowerSGD with fp16 factors (``factor_bits=16``) and int8 factors with shared scales per
column (``factor_bits=8``): bytes, ranks bit-identical at 2-4 gloo ranks and equal to a single-process
reference, exact resume, non-finite input and the DDP hook."""

import math

import pytest
import torch
from helpers.aggregatable_runs import bucket_grad, check_nonfinite, ddp_steps, reduce_steps_each

from gradzip.compressors import build
from gradzip.compressors.base import seeded_generator
from gradzip.compressors.int8sum import from_codes, to_codes
from gradzip.compressors.int8sum import levels_for as int8_levels
from gradzip.compressors.lowrank import PowerSGD
from gradzip.testing import run_ranks

# (12, 10) and (6, 8) are sent as factors at r = 2; (10,) and (3, 2) travel dense in fp32.
SHAPES = [(12, 10), (10,), (6, 8), (3, 2)]
SPEC = "powersgd:approx_rank=2,factor_bits=16"
SPEC8 = "powersgd:approx_rank=2,factor_bits=8"
STEPS, RESUME_AT = 4, 2


@pytest.mark.parametrize("bits", [4, 0, 64, "16"])
def test_bad_factor_bits_raise_value_error_naming_it(bits):
    with pytest.raises(ValueError, match="factor_bits"):
        PowerSGD(factor_bits=bits)


def test_payload_formula():
    codec = build(SPEC)
    assert codec.matrix_payload_nbytes((12, 10)) == (12 + 10) * 2 * 2
    assert codec.matrix_payload_nbytes((12, 10), torch.bfloat16) == (12 + 10) * 2 * 2
    assert codec.matrix_payload_nbytes((3, 2)) == 6 * 4
    assert build("powersgd:approx_rank=2").matrix_payload_nbytes((12, 10)) == (12 + 10) * 2 * 4
    assert build(SPEC8).matrix_payload_nbytes((12, 10)) == (12 + 10) * 2 + 2 * 2 * 4  # an fp32 scale per column
    assert build(SPEC8).matrix_payload_nbytes((3, 2)) == 6 * 4


def test_int8_levels_keep_the_sum_in_range():
    assert [int8_levels(w) for w in (1, 2, 4, 8, 127)] == [127, 63, 31, 15, 1]
    with pytest.raises(ValueError, match="world_size"):
        int8_levels(128)
    x = torch.linspace(-2.0, 2.0, 41)
    codes = to_codes(x, 2.0, 31)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == 31
    assert float((from_codes(codes, 2.0, 31) - x).abs().max()) <= 2.0 / 31 / 2 + 1e-6
    # a scale per column: each column uses all its levels; a zero column gives zero codes
    cols = torch.stack([x, x / 100, torch.zeros_like(x)], dim=1)
    scales = torch.tensor([2.0, 0.02, 0.0])
    codes = to_codes(cols, scales, 31)
    assert codes.abs().amax(dim=0).tolist() == [31, 31, 0]
    back = from_codes(codes, scales, 31)
    assert torch.all((back - cols).abs() <= scales / 31 / 2 + 1e-7)


def _fp16_wire(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """What one rank's factor contributes to the fp16 sum, back in float64."""
    limit = torch.finfo(torch.float16).max
    return (t / world_size).clamp(-limit, limit).to(torch.float16).double()


def _int8_round(factors, world_size):
    """Each rank's factor as its int8 codes carry it (a scale per column shared by the ranks,
    floor(127 / W) levels)."""
    levels = 127 // world_size
    out = [torch.zeros_like(f) for f in factors]
    for j in range(factors[0].shape[1]):
        scale = max(float(f[:, j].abs().max()) for f in factors)
        if scale > 0:
            for f, o in zip(factors, out):
                o[:, j] = torch.round(f[:, j] / scale * levels).clamp(-levels, levels) * scale / levels
    return out


def reference(world_size, codec, shapes, steps):
    """Every rank's output per step, from the method's definition in float64, each rank's
    factors rounded as the wire does (fp16: the wire's own fp16 sums round further)."""
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
            if codec.factor_bits == 16:
                p = sum(_fp16_wire(mat @ q, world_size) for mat in mats)
            else:
                p = sum(_int8_round([mat @ q for mat in mats], world_size))
            p_hat = torch.linalg.qr(p, mode="reduced").Q
            if codec.factor_bits == 16:
                own = [_fp16_wire(mat.T @ p_hat, world_size) * world_size for mat in mats]
            else:
                own = _int8_round([mat.T @ p_hat for mat in mats], world_size)
            q_mean = sum(own) / world_size
            for rank, (mat, q_own) in enumerate(zip(mats, own)):
                errors[(rank, i)] = mat - p_hat @ q_own.T
            q_memory[i] = q_mean
            out[lo:hi] = (p_hat @ q_mean.T).reshape(-1)
        outs.append(out.float())
    return outs


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_bit_identical_equal_reference_bytes_and_resume(world_size):
    runs = run_ranks(reduce_steps_each, world_size, [SPEC, SPEC8], SHAPES, STEPS, RESUME_AT)
    for spec in (SPEC, SPEC8):
        _check_against_reference(world_size, spec, [run[spec] for run in runs])


def _check_against_reference(world_size, spec, results):
    codec = build(spec)
    expected = reference(world_size, codec, SHAPES, STEPS)
    payload = sum(codec.matrix_payload_nbytes(s) for s in SHAPES)
    for res in results:
        assert res["bytes"] == [payload] * STEPS
        for step in range(STEPS):
            assert torch.equal(res["outs"][step], results[0]["outs"][step]), step
            # The wire's fp16 sums and fp32 products differ from the float64 reference by
            # rounding, about 1e-3 relative; an int8 code at a rounding boundary can differ by one.
            err = float((res["outs"][step] - expected[step]).norm() / expected[step].norm())
            assert err < 1e-2, (spec, step, err)
        for got, want in zip(res["resumed"], res["outs"][RESUME_AT:]):
            assert torch.equal(got, want), "a resumed run differs"


def test_low_bit_factors_decode_close_to_full_factors():
    full_spec = "powersgd:approx_rank=2"
    outs = run_ranks(reduce_steps_each, 2, [SPEC, SPEC8, full_spec], SHAPES, 1, 0)[0]
    full = outs[full_spec]["outs"][0]
    for spec, bound in [(SPEC, 5e-3), (SPEC8, 5e-2)]:
        assert float((outs[spec]["outs"][0] - full).norm() / full.norm()) < bound, spec


def test_nonfinite_input_marks_every_rank_and_leaves_no_state():
    check_nonfinite([SPEC, SPEC8])


def test_ddp_hook_two_ranks_bit_identical():
    params = run_ranks(ddp_steps, 2, [SPEC, SPEC8])
    for spec in (SPEC, SPEC8):
        assert torch.isfinite(params[0][spec]).all(), spec
        assert torch.equal(params[0][spec], params[1][spec]), spec


def _reduce_in(rank: int, world_size: int) -> dict:
    """Two steps of one bucket of ``SHAPES`` through plain PowerSGD, in float64 and in float32."""
    from gradzip.comm import make_reducer

    numel = sum(math.prod(s) for s in SHAPES)
    out = {}
    for dtype in (torch.float64, torch.float32):
        reducer = make_reducer("powersgd:approx_rank=2")
        out[dtype] = [reducer.reduce(0, bucket_grad(rank, step, numel).to(dtype), step=step, shapes=SHAPES).wait().clone()
                      for step in range(2)]
    return out


def test_float64_buckets_reduce_as_float32_ones_do():
    # a float64 bucket's factors are computed in float32 and go out as float64: saturating them
    # at float64's range once overflowed float32 (a RuntimeError, not a result)
    ranks = run_ranks(_reduce_in, 2)
    for wide, narrow in zip(ranks[0][torch.float64], ranks[0][torch.float32]):
        assert wide.dtype == torch.float64 and torch.isfinite(wide).all()
        torch.testing.assert_close(wide.float(), narrow, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0][torch.float64], ranks[1][torch.float64]))
