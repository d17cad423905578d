"""``int8``: int8 codes on scales every rank shares, summed by all_reduce: parameters, the code
arithmetic, the reducer on 2-4 gloo ranks against a single-process reference (bytes, resume),
non-finite input and the DDP hook."""

import math

import pytest
import torch
from helpers.aggregatable_runs import bucket_grad, check_nonfinite, ddp_steps, reduce_steps
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.comm.traffic import allreduce_bytes
from gradzip.compressors import build
from gradzip.compressors.int8sum import Int8Sum, group_codes, group_scales, group_values, levels_for
from gradzip.testing import run_ranks

SHAPES = [(12, 10), (10,), (6, 8), (3, 2)]
STEPS, RESUME_AT = 4, 2


@pytest.mark.parametrize("params", [{"group": 0}, {"group": 1.5}, {"start_step": -1}, {"error_feedback": "yes"}])
def test_bad_parameters_raise_value_error_naming_them(params):
    with pytest.raises(ValueError, match=next(iter(params))):
        Int8Sum(**params)


def test_levels_keep_the_sum_of_every_rank_in_int8():
    assert [levels_for(w) for w in (1, 2, 3, 4, 8, 127)] == [127, 63, 42, 31, 15, 1]
    for w in (1, 2, 3, 4, 8, 127):
        assert w * levels_for(w) <= 127
    for bad in (0, 128):
        with pytest.raises(ValueError, match="127"):
            levels_for(bad)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(numel=st.integers(1, 400), group=st.integers(1, 64), levels=st.sampled_from([1, 7, 31, 127]),
       seed=st.integers(0, 10**6), scale=st.sampled_from([1e-38, 1e-30, 1.0, 1e30]), zeros=st.integers(0, 3))
def test_codes_round_to_the_nearest_level_of_each_groups_scale(numel, group, levels, seed, scale, zeros):
    """Scales near the bottom of fp32 (where ``levels / scale`` would overflow) and exact zeros
    beside them too."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale
    x[::zeros + 2] = 0.0 if zeros else x[::zeros + 2]
    scales = group_scales(x, group)
    # each scale is its group's largest magnitude, computed here by slicing
    want = torch.tensor([x[i : i + group].abs().max().item() for i in range(0, numel, group)])
    assert torch.equal(scales, want)
    codes = group_codes(x, scales, levels, group)
    assert codes.dtype == torch.int8 and codes.numel() == numel and int(codes.abs().max()) <= levels
    back = group_values(codes, scales, levels, group)
    step = scales.repeat_interleave(group)[:numel] / levels
    assert bool(torch.isfinite(back).all())
    assert bool(((back - x).abs() <= step / 2 * (1 + 1e-5) + torch.finfo(torch.float32).tiny).all())


def test_a_group_larger_than_the_tensor_is_one_group_of_the_tensor():
    x = torch.randn(10)
    assert torch.equal(group_scales(x, 10**12), x.abs().max().reshape(1))
    codec = build("int8:group=1000000000000")
    assert codec.payload_nbytes(10) == 10 + 4
    assert codec.compress(x).nbytes == 14


def test_payload_formula_and_lone_payload_bytes():
    codec = build("int8:group=100")
    x = torch.randn(1001)
    payload = codec.compress(x)
    assert payload.nbytes == codec.payload_nbytes(1001) == 1001 + 4 * 11
    got = codec.decompress(payload, like=x)
    assert (got - x).abs().max() <= x.abs().max() / 127 / 2 * (1 + 1e-5)


def reference(world_size: int, codec: Int8Sum, numel: int, steps: int) -> list[torch.Tensor]:
    """Every rank's output per step from the definition: error-compensated buckets, the largest
    magnitude over ranks per group, codes rounded at floor(127 / W) levels, their integer sum."""
    levels = 127 // world_size
    errors = [torch.zeros(numel) for _ in range(world_size)]
    outs = []
    for step in range(steps):
        xs = [bucket_grad(r, step, numel) + errors[r] for r in range(world_size)]
        n_groups = math.ceil(numel / codec.group)
        scale = torch.zeros(numel)
        for g in range(n_groups):
            span = slice(g * codec.group, (g + 1) * codec.group)
            scale[span] = max(x[span].abs().max().item() for x in xs)
        codes = [torch.round(x / scale * levels) for x in xs]
        total = sum(codes)
        assert total.abs().max() <= 127
        outs.append(total / (levels * world_size) * scale)
        errors = [x - c / levels * scale for x, c in zip(xs, codes)]
    return outs


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_bit_identical_equal_reference_bytes_and_resume(world_size):
    spec = "int8:group=16"
    results = run_ranks(reduce_steps, world_size, spec, SHAPES, STEPS, RESUME_AT)
    codec = build(spec)
    numel = sum(math.prod(s) for s in SHAPES)
    expected = reference(world_size, codec, numel, STEPS)
    assert codec.payload_nbytes(numel) == numel + 4 * math.ceil(numel / 16) < numel * 4
    for res in results:
        assert res["bytes"] == [codec.payload_nbytes(numel)] * STEPS
        for step in range(STEPS):
            assert torch.equal(res["outs"][step], results[0]["outs"][step]), step
            torch.testing.assert_close(res["outs"][step], expected[step], rtol=1e-5, atol=1e-6)
        for got, want in zip(res["resumed"], res["outs"][RESUME_AT:]):
            assert torch.equal(got, want), "a resumed run differs"


def _sent(rank: int, world_size: int, numel: int) -> tuple[int, int]:
    from gradzip.comm import make_reducer

    reducer = make_reducer("int8:group=64")
    reducer.reduce(0, bucket_grad(rank, 0, numel), step=0).wait()
    figures = reducer.metrics.pop()
    return figures["payload_bytes"], figures["sent_bytes"]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bytes_per_worker_are_the_two_all_reduces(world_size):
    """The payload does not depend on the world size; the bytes sent are two ring all_reduces:
    the fp32 scales and the int8 codes."""
    numel = 1000
    for payload, sent in run_ranks(_sent, world_size, numel):
        assert payload == numel + 4 * 16
        assert sent == allreduce_bytes(4 * 16, world_size) + allreduce_bytes(numel, world_size)


def _dtype_steps(rank: int, world_size: int, dtype: torch.dtype, numel: int) -> list:
    from gradzip.comm import make_reducer

    reducer = make_reducer("int8:group=16")
    return [reducer.reduce(0, bucket_grad(rank, step, numel).to(dtype), step=step).wait() for step in range(3)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_other_gradient_dtypes_take_the_fp32_arithmetic(dtype):
    """An fp64 or fp16 bucket is compensated and coded in fp32 and comes back in its own dtype:
    the fp32 reference's values, cast."""
    numel, world_size = 208, 2
    results = run_ranks(_dtype_steps, world_size, dtype, numel)
    levels, errors = 127 // world_size, [torch.zeros(numel) for _ in range(world_size)]
    for step in range(3):
        xs = [bucket_grad(r, step, numel).to(dtype).float() + errors[r] for r in range(world_size)]
        scale = torch.stack([x.view(-1, 16).abs().amax(1) for x in xs]).amax(0).repeat_interleave(16)
        codes = [torch.round(x / scale * levels) for x in xs]
        want = (sum(codes) / (levels * world_size) * scale).to(dtype)
        errors = [x - c / levels * scale for x, c in zip(xs, codes)]
        for res in results:
            assert res[step].dtype == dtype
            torch.testing.assert_close(res[step], want, rtol=1e-3, atol=1e-3)


def test_nonfinite_input_marks_every_rank_and_leaves_no_state():
    check_nonfinite(["int8:group=4"])


def test_ddp_hook_two_ranks_bit_identical():
    params = run_ranks(ddp_steps, 2, "int8:group=32")
    assert torch.isfinite(params[0]).all()
    assert torch.equal(params[0], params[1])


def test_decoding_fp32_codes_leaves_them_as_they_were():
    """Codes held as whole numbers in fp32 (as the reducers hold them before the int8 copy),
    their count a multiple of the group so no padding copies them: decoding must not rewrite them."""
    steps = torch.tensor([3.0, -2.0, 1.0, 0.0, 5.0, -5.0, 2.0, 4.0])
    kept = steps.clone()
    scales = torch.tensor([2.0, 4.0])
    values = group_values(steps, scales, 5, 4)
    assert torch.equal(steps, kept)
    assert torch.equal(values, torch.tensor([1.2, -0.8, 0.4, 0.0, 4.0, -4.0, 1.6, 3.2]))
