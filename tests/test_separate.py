"""SEPARATE (Zhao et al., ICLR 2025): the projection, its unbiasedness, the reducer on real gloo
ranks against a single-process reference, payload bytes, exact resume and the DDP hook."""

import math

import pytest
import torch
from helpers.aggregatable_runs import bucket_grad, check_nonfinite, ddp_steps, reduce_steps
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.compressors import build
from gradzip.compressors.separate import BLOCK_ROWS, Separate, project, projection_blocks
from gradzip.testing import run_ranks

# (12, 10) and (6, 8) are projected at r = 3; (10,) and (3, 2) (r >= n) travel dense.
SHAPES = [(12, 10), (10,), (6, 8), (3, 2)]
SPEC = "separate:approx_rank=3,ef_beta=0.9"
STEPS, RESUME_AT = 4, 2


def _full_projection(seed, step, key, n, r):
    return torch.cat([block for _, block in projection_blocks(seed, step, key, n, r)])


@pytest.mark.parametrize(
    "params", [{"approx_rank": 0}, {"ef_beta": 1.0}, {"ef_beta": -0.1}, {"ef_beta": "x"}, {"seed": -1}, {"start_step": -1}]
)
def test_bad_parameters_raise_value_error_naming_them(params):
    with pytest.raises(ValueError, match=next(iter(params))):
        Separate(**params)


def test_projection_is_shared_blockwise_and_fresh_each_step():
    n, r = BLOCK_ROWS + 37, 2  # two blocks
    a = _full_projection(5, 3, "k", n, r)
    assert a.shape == (n, r)
    assert torch.equal(a, _full_projection(5, 3, "k", n, r))
    assert not torch.equal(a, _full_projection(5, 4, "k", n, r))
    assert not torch.equal(a, _full_projection(5, 3, "j", n, r))
    g = torch.randn(3, n, dtype=torch.float64).float()
    torch.testing.assert_close(project(g, 5, 3, "k", r), (g.double() @ a.double()).float(), rtol=1e-4, atol=1e-4)
    # entries N(0, 1/r): the sample variance of 2 * 2085 draws is within 10% of 1/2
    assert abs(float(a.var()) * r - 1) < 0.1


@settings(max_examples=15, deadline=None, derandomize=True)
@given(m=st.integers(1, 3), n=st.integers(2, 30), r_frac=st.floats(0.0, 1.0), seed=st.integers(0, 1000))
def test_projection_is_unbiased_over_steps(m, n, r_frac, seed):
    """The mean of ``G A A^T`` over N draws tends to ``G``: its expected squared error is
    ``((n + 1) / r) ||G||^2 / N``. Derandomized examples and fixed seeds make this deterministic;
    the bound is 50x that expectation (a 2% event by Markov, so a correct codec passes), and a
    decode off by a factor (1 + d) misses it for |d| > sqrt(50 w / N), about 0.9 here at worst."""
    r = 1 + int(r_frac * (n - 2))
    codec = Separate(approx_rank=r, seed=seed)
    g = torch.randn(m, n, generator=torch.Generator().manual_seed(seed))
    draws = 2000
    total = torch.zeros(m, n)
    for step in range(draws):
        codec.decode(codec.encode(g, step=step, key="w"), n, step=step, key="w", out=(out := torch.empty(m, n)))
        total += out
    err = float((total / draws - g).square().sum())
    assert err <= 50 * ((n + 1) / r) * float(g.square().sum()) / draws


def test_payload_formula():
    codec = build("separate:approx_rank=4")
    assert codec.matrix_payload_nbytes((100, 30)) == 100 * 4 * 4
    assert codec.matrix_payload_nbytes((100, 3, 10), torch.bfloat16) == 100 * 4 * 2
    assert codec.matrix_payload_nbytes((100, 4)) == 400 * 4  # r >= n: dense
    assert codec.matrix_payload_nbytes((50,)) == 200


def reference(world_size, codec, shapes, steps):
    """Every rank's output per step, computed in one process from the method's definition."""
    offsets = [0] + list(torch.tensor([math.prod(s) for s in shapes]).cumsum(0).tolist())
    numel = offsets[-1]
    errors = {}
    outs = []
    for step in range(steps):
        grads = [bucket_grad(rank, step, numel) for rank in range(world_size)]
        out = torch.empty(numel)
        for i, shape in enumerate(shapes):
            lo, hi = offsets[i], offsets[i + 1]
            if not codec.compresses(shape):
                out[lo:hi] = sum(g[lo:hi] / world_size for g in grads)
                continue
            m, n = shape[0], math.prod(shape[1:])
            r = min(codec.approx_rank, n)
            a = _full_projection(codec.seed, step, (0, i), n, r).double()
            total = torch.zeros(m, r, dtype=torch.float64)
            for rank, g in enumerate(grads):
                c = g[lo:hi].view(m, n).double() + errors.get((rank, i), 0)
                total += c @ a / world_size
                errors[(rank, i)] = codec.ef_beta * errors.get((rank, i), 0) + (1 - codec.ef_beta) * (c - c @ a @ a.T)
            out[lo:hi] = (total @ a.T).float().reshape(-1)
        outs.append(out)
    return outs


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_bit_identical_equal_reference_bytes_and_resume(world_size):
    results = run_ranks(reduce_steps, world_size, SPEC, SHAPES, STEPS, RESUME_AT)
    codec = build(SPEC)
    expected = reference(world_size, codec, SHAPES, STEPS)
    payload = sum(codec.matrix_payload_nbytes(s) for s in SHAPES)
    assert payload < sum(math.prod(s) for s in SHAPES) * 4
    for res in results:
        assert res["bytes"] == [payload] * STEPS
        for step in range(STEPS):
            assert torch.equal(res["outs"][step], results[0]["outs"][step]), step
            torch.testing.assert_close(res["outs"][step], expected[step], rtol=1e-4, atol=1e-5)
        for got, want in zip(res["resumed"], res["outs"][RESUME_AT:]):
            assert torch.equal(got, want), "a resumed run differs"


def test_before_start_step_the_mean_is_exact():
    results = run_ranks(reduce_steps, 2, "separate:start_step=10", SHAPES, 2, 1)
    numel = sum(math.prod(s) for s in SHAPES)
    for step in range(2):
        mean = (bucket_grad(0, step, numel) + bucket_grad(1, step, numel)) / 2
        torch.testing.assert_close(results[0]["outs"][step], mean)
    assert results[0]["bytes"] == [numel * 4] * 2


def test_ddp_hook_two_ranks_bit_identical():
    params = run_ranks(ddp_steps, 2, "separate:approx_rank=2")
    assert torch.isfinite(params[0]).all()
    assert torch.equal(params[0], params[1])


def test_nonfinite_input_marks_every_rank_and_leaves_no_state():
    check_nonfinite(["separate:approx_rank=2"])


@pytest.mark.parametrize("name", ["separate", "countsketch"])
def test_auto_refuses_reducer_owning_codecs_it_cannot_probe(name):
    from gradzip.control.auto import AutoConfig, make_controller
    from gradzip.control.auto_reducer import AutoReducer

    cfg = AutoConfig(candidates=(name, "topk:ratio=0.1"))
    specs = cfg.candidate_specs()
    with pytest.raises(ValueError, match=name):
        AutoReducer(specs, make_controller(cfg, specs))
