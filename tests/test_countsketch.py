"""The count sketch with a shared bitmap (TAGC-style): parameters, exact decoding of sparse
vectors, the aggregatable property, the reducer on 2-4 gloo ranks against a single-process
reference, bytes, exact resume, non-finite input and the DDP hook."""

import math

import pytest
import torch
from helpers.aggregatable_runs import bucket_grad, check_nonfinite, ddp_steps, reduce_steps
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.comm import make_reducer
from gradzip.compressors import Payload, build
from gradzip.compressors.countsketch import CountSketch, Hashes, Located, _first_true_row, peel, sketch
from gradzip.testing import run_ranks

SHAPES = [(12, 10), (10,), (6, 8), (3, 2)]
SPEC = "countsketch:ratio=0.1,width=3"
STEPS, RESUME_AT = 4, 2


@pytest.mark.parametrize(
    "params",
    [{"ratio": 0}, {"ratio": 1.5}, {"rows": 0}, {"rows": 16}, {"width": 0}, {"width": -1.0}, {"seed": -1}, {"start_step": -1}, {"min_numel": -1}, {"width": 1e308},
     {"width": float("nan")}, {"fill": "both"}, {"fill": None}],
)
def test_bad_parameters_raise_value_error_naming_them(params):
    with pytest.raises(ValueError, match=next(iter(params))):
        CountSketch(**params)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(numel=st.integers(1, 3000), sparsity=st.integers(1, 60), seed=st.integers(0, 10**6), rows=st.sampled_from([3, 5]))
def test_sparse_vector_decodes_exactly_from_a_large_enough_sketch(numel, sparsity, seed, rows):
    """``rows * cols`` at 4 cells per row per nonzero, far past the peeling threshold (about 1.23
    cells per nonzero for 3 rows): peeling resolves every coordinate, and the values come back
    up to fp32 rounding of the sketch."""
    gen = torch.Generator().manual_seed(seed)
    s = min(sparsity, numel)
    index = torch.randperm(numel, generator=gen)[:s].sort().values
    values = torch.randn(s, generator=gen) + torch.sign(torch.randn(s, generator=gen)) * 0.5
    hashes = Hashes.draw(seed, 0, "k", rows, 4 * s)
    where = Located.of(index, hashes)
    got = peel(sketch(values, where), where)[0]
    torch.testing.assert_close(got.float(), values, rtol=1e-5, atol=1e-6)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(rows=st.integers(1, 15), cols=st.integers(0, 40), seed=st.integers(0, 10**6))
def test_first_true_row_is_the_lowest_true_index_per_column(rows, cols, seed):
    mask = torch.rand(rows, cols, generator=torch.Generator().manual_seed(seed)) < 0.3
    expected = [next((r for r in range(rows) if mask[r, c]), 0) for c in range(cols)]
    assert _first_true_row(mask).tolist() == expected


@pytest.mark.parametrize("layout", ["random", "blocks"])
def test_the_defaults_decode_a_fifth_of_a_large_vector_exactly_at_every_draw(layout):
    """2.5 cells per kept entry, twice the peeling threshold: every hash draw resolves every
    kept coordinate, for a random support and for contiguous blocks (a linear hash left sets of
    8 coordinates colliding in all 3 rows here, in about a third of the draws)."""
    numel = 200_000
    gen = torch.Generator().manual_seed(0)
    if layout == "random":
        x = torch.randn(numel, generator=gen)
    else:
        x = torch.zeros(numel)
        index = torch.cat([torch.arange(b * 2500, b * 2500 + 500) for b in range(80)])
        x[index] = torch.randn(index.numel(), generator=gen) + 3
    codec = build("countsketch")
    kept = torch.where(codec.keep(x), x, torch.zeros_like(x))
    for step in range(8):
        got = codec.decompress(codec.compress(x, step=step, key="b"), like=x)
        torch.testing.assert_close(got, kept, rtol=1e-6, atol=1e-6, msg=f"step {step}")


def test_ties_keep_exactly_k_entries():
    codec = build("countsketch:ratio=0.2,width=2")
    x = torch.ones(1000)
    x[::2] = -1.0
    assert int(codec.keep(x).sum()) == 200
    got = codec.decompress(codec.compress(x, step=0, key="b"), like=x)
    torch.testing.assert_close(got, torch.where(codec.keep(x), x, torch.zeros_like(x)))


def test_too_small_a_sketch_does_not_decode_exactly():
    # Two coordinates in one cell of one row: peeling cannot start; the estimates are the cell.
    index, values = torch.tensor([3, 7]), torch.tensor([1.0, 2.0])
    hashes = Hashes.draw(0, 0, "k", 1, 1)
    where = Located.of(index, hashes)
    got = peel(sketch(values, where), where)[0]
    assert not torch.allclose(got.float(), values)


def _sparsified(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """Independent selection: entries at least the k-th largest magnitude, by sorting."""
    k = min(max(round(ratio * x.numel()), 1), x.numel())
    threshold = x.abs().sort(descending=True).values[k - 1]
    return torch.where((x.abs() >= threshold) & (x != 0), x, torch.zeros_like(x))


def test_sum_of_payloads_decodes_to_sum_of_sparsified_inputs_and_bytes_match():
    codec = build("countsketch:ratio=0.05,width=3")
    xs = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    payloads = [codec.compress(x, step=5, key="b") for x in xs]
    for p in payloads:
        assert p.nbytes == codec.payload_nbytes(1000) == 125 + 3 * 150 * 4
    bitmap = payloads[0].tensors[0] | payloads[1].tensors[0] | payloads[2].tensors[0]
    table = sum(p.tensors[1] for p in payloads)
    got = codec.decompress(Payload((bitmap, table), payloads[0].ctx), like=xs[0])
    torch.testing.assert_close(got, sum(_sparsified(x, 0.05) for x in xs), rtol=1e-5, atol=1e-5)


def reference(world_size, codec, shapes, steps):
    """Every rank's output per step from the definition (the sketch is large enough to peel
    completely): with ``fill="own"`` the mean of the sparsified error-compensated buckets, each
    residual what its own thresholding dropped; with ``fill="union"`` the mean of the
    compensated buckets on the union of the kept sets, each residual what lies off the union."""
    numel = sum(math.prod(s) for s in shapes)
    errors = [torch.zeros(numel) for _ in range(world_size)]
    outs = []
    for step in range(steps):
        compensated = [bucket_grad(rank, step, numel) + errors[rank] for rank in range(world_size)]
        kept = [_sparsified(c, codec.ratio) for c in compensated]
        if codec.fill == "union":
            union = torch.stack([k != 0 for k in kept]).any(dim=0)
            kept = [torch.where(union, c, torch.zeros_like(c)) for c in compensated]
        errors = [c - k for c, k in zip(compensated, kept)]
        outs.append(sum(k / world_size for k in kept))
    return outs


@pytest.mark.parametrize("fill", ["union", "own"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_bit_identical_equal_reference_bytes_and_resume(world_size, fill):
    spec = f"{SPEC},fill={fill}"
    results = run_ranks(reduce_steps, world_size, spec, SHAPES, STEPS, RESUME_AT)
    codec = build(spec)
    numel = sum(math.prod(s) for s in SHAPES)
    expected = reference(world_size, codec, SHAPES, STEPS)
    assert codec.payload_nbytes(numel) < numel * 4
    for res in results:
        assert res["bytes"] == [codec.payload_nbytes(numel)] * STEPS  # gloo: packed bitmap
        for step in range(STEPS):
            assert torch.equal(res["outs"][step], results[0]["outs"][step]), step
            torch.testing.assert_close(res["outs"][step], expected[step], rtol=1e-5, atol=1e-5)
        for got, want in zip(res["resumed"], res["outs"][RESUME_AT:]):
            assert torch.equal(got, want), "a resumed run differs"


def _narrow_sketch_steps(rank: int, world_size: int, spec: str, numel: int, steps: int) -> dict:
    """``steps`` steps of one bucket through a sketch too narrow to peel its support: every
    output, the unpeeled counts, and the residual left at the end."""
    reducer = make_reducer(spec)
    outs, unpeeled = [], []
    for step in range(steps):
        outs.append(reducer.reduce(0, bucket_grad(rank, step, numel), step=step).wait().clone())
        unpeeled.append(reducer.metrics.pop()["buckets"][0]["unpeeled"])
    return {"outs": outs, "unpeeled": unpeeled, "residual": reducer.state_dict()["feedback"]["residuals"][0]}


@pytest.mark.parametrize("fill", ["union", "own"])
def test_what_does_not_peel_is_counted_and_the_residual_keeps_only_what_was_not_sent(fill):
    """A sketch of 0.5 cells per kept entry cannot peel the union of 3 ranks' kept sets. Every
    rank counts the same unpeeled coordinates and returns the same bits, and its residual is
    what it did not sketch (off the union, or what its thresholding dropped), step after step,
    as the definition computes it (the estimates' errors are not fed back)."""
    numel, steps, world_size = 600, 5, 3
    spec = f"countsketch:ratio=0.2,width=0.5,fill={fill}"
    results = run_ranks(_narrow_sketch_steps, world_size, spec, numel, steps)
    errors = [torch.zeros(numel) for _ in range(world_size)]
    for step in range(steps):
        compensated = [bucket_grad(rank, step, numel) + errors[rank] for rank in range(world_size)]
        kept = [_sparsified(c, 0.2) != 0 for c in compensated]
        if fill == "union":
            kept = [torch.stack(kept).any(dim=0)] * world_size
        errors = [torch.where(k, torch.zeros_like(c), c) for c, k in zip(compensated, kept)]
    for rank, res in enumerate(results):
        assert all(n > 0 for n in res["unpeeled"]), res["unpeeled"]
        assert res["unpeeled"] == results[0]["unpeeled"]
        for got, first in zip(res["outs"], results[0]["outs"]):
            assert torch.equal(got, first)
        torch.testing.assert_close(res["residual"], errors[rank], rtol=1e-5, atol=1e-5)


def test_nonfinite_input_marks_every_rank_and_leaves_no_state():
    check_nonfinite(["countsketch:ratio=0.2,width=3", "countsketch:ratio=0.2,width=3,fill=own"])


def test_ddp_hook_two_ranks_bit_identical():
    params = run_ranks(ddp_steps, 2, "countsketch:ratio=0.1,width=3")
    assert torch.isfinite(params[0]).all()
    assert torch.equal(params[0], params[1])


def _small_and_large(rank: int, world_size: int, spec: str, small: int, large: int) -> dict:
    """One step of a small and a large bucket through one reducer: outputs and bytes of each."""
    reducer = make_reducer(spec)
    out = {}
    for key, numel in (("small", small), ("large", large)):
        got = reducer.reduce(key, bucket_grad(rank, 0, numel), step=0).wait().clone()
        bucket = reducer.metrics.pop()["buckets"][key]
        out[key] = (got, bucket["payload_bytes"], bucket["collective"])
    return out


def test_buckets_below_min_numel_travel_dense_and_larger_ones_are_sketched():
    """TAGC's policy by size: the 60-element bucket is averaged exactly and sends its raw bytes;
    the 300-element one is sketched and equals the mean of the inputs on the union of their kept
    sets."""
    spec = "countsketch:ratio=0.1,width=3,min_numel=100"
    results = run_ranks(_small_and_large, 3, spec, 60, 300)
    codec = build(spec)
    dense_mean = sum(bucket_grad(r, 0, 60) for r in range(3)) / 3
    union = torch.stack([_sparsified(bucket_grad(r, 0, 300), 0.1) != 0 for r in range(3)]).any(dim=0)
    sketched_mean = torch.where(union, sum(bucket_grad(r, 0, 300) for r in range(3)) / 3, torch.zeros(300))
    for res in results:
        got, nbytes, collective = res["small"]
        torch.testing.assert_close(got, dense_mean, rtol=1e-6, atol=1e-7)
        assert (nbytes, collective) == (60 * 4, "dense")
        got, nbytes, collective = res["large"]
        torch.testing.assert_close(got, sketched_mean, rtol=1e-5, atol=1e-5)
        assert (nbytes, collective) == (codec.payload_nbytes(300), "allreduce")
        assert nbytes < 300 * 4


def test_defaults_are_tagcs_a_fifth_kept_and_a_sketch_of_half_the_entries():
    codec = build("countsketch")
    numel = 1_200_000
    assert codec.ratio == 0.2 and codec.rows == 3 and codec.min_numel == 0
    assert codec.rows * codec.cols(numel) == numel // 2
    assert codec.payload_nbytes(numel) == numel // 8 + (numel // 2) * 4
