"""Native codec loops (``gradzip.compressors.kernels.native``) against the eager torch codecs, bit for bit."""

from __future__ import annotations

import pytest
import torch
from helpers.codec_runs import bits_of, run_codec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradzip.compressors import build
from gradzip.compressors.kernels import fused, native, sums
from gradzip.compressors.kernels.dither import hash_key

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the native loops are unavailable")


def _native_equals_eager(spec: str, x: torch.Tensor, monkeypatch, *, compiled_too: bool = False) -> tuple[torch.Tensor, ...]:
    """Runs ``spec`` eagerly, then with the native loops on (compiled kernels off where the
    loops take over: a kernel compiled in the second run means a loop did not run, unless
    ``compiled_too``), and asserts the same bytes. Returns the payload."""
    monkeypatch.setenv(fused.ENV, "0")
    eager_payload, eager_out = run_codec(spec, x)
    monkeypatch.setenv(fused.ENV, "1")
    monkeypatch.setattr(fused, "compile_seconds", {})
    payload, out = run_codec(spec, x)
    assert compiled_too or not fused.compile_seconds, f"compiled instead of native: {sorted(fused.compile_seconds)}"
    assert len(payload) == len(eager_payload)
    for got, want in zip(payload, eager_payload, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(bits_of(got), bits_of(want))
    assert torch.equal(bits_of(out), bits_of(eager_out))
    return payload


def _gradient_like(numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen) * 1e-2


@pytest.mark.parametrize(
    ("spec", "numel"),
    [
        # bucket 64: 2 columns per slice, all in the zero-padded remainder of a vector step
        ("qsgd:bits=4,bucket=64", 64 * 5 + 13),
        ("qsgd:bits=1,bucket=512", 512 * 6 + 1),
        ("qsgd:bits=2,bucket=256", 256 * 9),
        # bucket 288: 9 columns per slice, one whole vector step and a remainder of one
        ("qsgd:bits=8,bucket=288", 288 * 7 + 100),
        ("terngrad", 2 * fused.BLOCK + 5),
        ("terngrad:clip=0", 3 * fused.BLOCK),
        ("natural", 2 * fused.BLOCK + 5),
        ("signsgd", 2 * fused.BLOCK + 5),
        ("efsignsgd", 3 * fused.BLOCK),
        ("topk:ratio=0.01", 300_007),
        ("dgc:ratio=0.01", 300_007),
        ("threshold:tau=0.015", 300_007),
    ],
)
def test_native_equals_eager(spec, numel, monkeypatch):
    payload = _native_equals_eager(spec, _gradient_like(numel, numel), monkeypatch)
    assert sum(t.numel() * t.element_size() for t in payload) == build(spec).payload_nbytes(numel)


def test_terngrad_without_an_element_at_the_bound(monkeypatch):
    """The scaler is max |g| (from the first pass's row maxima), the codes recomputed for it."""
    gen = torch.Generator().manual_seed(8)
    x = torch.rand(3 * fused.BLOCK + 5, generator=gen) * 2 - 1
    payload = _native_equals_eager("terngrad", x, monkeypatch)
    assert float(payload[1]) == float(x.abs().max())


@pytest.mark.parametrize("spec", ["natural", "qsgd:bits=4,bucket=512", "terngrad:clip=0"])
def test_extreme_values_equal_eager(spec, monkeypatch):
    """Zeros, subnormals, the largest floats and a run of exact powers of two: the same bytes."""
    x = _gradient_like(2 * fused.BLOCK, 5)
    x[:100] = 0.0
    x[100:200] = torch.finfo(torch.float32).tiny / 7
    x[200:210] = torch.finfo(torch.float32).max
    x[210:220] = -torch.finfo(torch.float32).max
    x[300:400] = 2.0 ** torch.arange(-50, 50, dtype=torch.float32)
    if spec.startswith("qsgd"):
        # values near the top of fp32 send QSGD to its fp64 path; keep its buckets in the frame
        x[200:220] = 1e30
    _native_equals_eager(spec, x, monkeypatch)


def test_natural_keeps_nan_and_inf_bits_as_eager(monkeypatch):
    x = _gradient_like(fused.BLOCK, 6)
    x[7], x[8], x[9] = float("nan"), float("inf"), -float("inf")
    _native_equals_eager("natural", x, monkeypatch)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    bits=st.sampled_from([1, 2, 4, 8]),
    words=st.integers(1, 24),
    rows=st.integers(1, 9),
    tail=st.integers(0, 40),
    seed=st.integers(0, 2**16),
)
def test_qsgd_native_equals_eager_for_any_bucket(bits, words, rows, tail, seed, monkeypatch):
    """Buckets of any multiple of 32: whole vector steps, remainders, or both."""
    bucket = 32 * words
    _native_equals_eager(f"qsgd:bits={bits},bucket={bucket}", _gradient_like(bucket * rows + tail, seed), monkeypatch)


def test_candidate_scan_finds_exactly_the_positions_at_or_above_the_threshold(monkeypatch):
    monkeypatch.setenv(fused.ENV, "1")
    x = _gradient_like(100_003, 3)
    x[17] = float("nan")
    threshold = float(x.abs().nan_to_num(0).quantile(0.98))
    want = torch.nonzero(x.abs() >= threshold).view(-1)
    # room for fewer than pass: the scan is repeated with room for all
    found = native.at_least(x, threshold, expected=10)
    assert found is not None
    positions, values = found
    assert torch.equal(positions, want) and torch.equal(values, x[want])
    assert native.at_least(x, float("inf"), expected=10)[0].numel() == 0


@pytest.mark.parametrize("kind", ["plain", "abs", "square"])
def test_row_sums_equal_torch_bit_for_bit(kind, monkeypatch):
    """The native loop adds in the order of gradzip.compressors.kernels.sums, as torch does there."""
    monkeypatch.setenv(fused.ENV, "1")
    x = _gradient_like(3 * sums.ROW, 4) + 0.25
    x[5] = 2.0**60
    found = native.row_sums(x, sums.ROW, (kind,))
    assert found is not None
    assert torch.equal(found[0], sums.row_sums(x, kind))
    wide = x.double()
    exact = {"plain": wide.sum(), "abs": wide.abs().sum(), "square": (wide * wide).sum()}[kind]
    assert sums.total(found[0]) == pytest.approx(float(exact), rel=1e-12)
    # two kinds in fp64 are not a loop the library has
    assert native.row_sums(x, sums.ROW, ("plain", "square")) is None


def test_fp32_moments_equal_torch_bit_for_bit(monkeypatch):
    """TernGrad's moments of fp32 input, summed in fp32 in the same pairs by both paths."""
    monkeypatch.setenv(fused.ENV, "1")
    x = _gradient_like(5 * sums.ROW, 8) + 0.125
    found = native.row_sums(x, sums.ROW, ("plain", "square"), torch.float32)
    assert found is not None and all(t.dtype == torch.float32 for t in found)
    assert torch.equal(found[0], sums.row_sums(x, "plain", torch.float32))
    assert torch.equal(found[1], sums.row_sums(x, "square", torch.float32))
    assert sums.total(found[0]) == pytest.approx(float(x.double().sum()), rel=1e-5)
    assert native.row_sums(x, sums.ROW, ("abs",), torch.float32) is None


def test_scales_from_sums_equal_eager_near_a_rounding_midpoint(monkeypatch):
    """Sums whose exact value sits next to an fp32 rounding midpoint: any other order of the fp64
    additions rounds the scale the other way (found by trying to break the loops)."""
    x = torch.full((fused.BLOCK,), 192.0)
    x[0], x[1] = 2.0**60, 68717871104.0
    for spec in ("signsgd", "efsignsgd"):
        _native_equals_eager(spec, x, monkeypatch)
    x = torch.full((fused.BLOCK,), 14878202880.0)
    x[0], x[2], x[3] = 2.0**60, 2.0**49, 224274417713152.0
    _native_equals_eager("terngrad", x, monkeypatch)


@pytest.mark.parametrize("spec", ["uniform:bits=8", "qsgd:bits=8,bucket=64"])
def test_parameters_divide_as_torch_does(spec, monkeypatch):
    """torch computes a number over a tensor as the reciprocal times the number; a true division
    rounds differently in about a quarter of the groups, and now and then a code with it."""
    _native_equals_eager(spec, _gradient_like(655_360, 7), monkeypatch)


@pytest.mark.parametrize("spec", ["uniform:bits=4,group=16", "uniform:bits=8,group=32", "uniform:bits=4,rounding=stochastic"])
def test_uniform_zeros_of_both_signs(spec, monkeypatch):
    """Groups whose minimum or maximum is a zero of either sign: the extremes are sent as +0.0
    whichever zero a reduction order finds (groups of 16 are not whole words: native extremes,
    compiled codes)."""
    gen = torch.Generator().manual_seed(12)
    x = -torch.rand(64 * 8, generator=gen).clamp(min=0.5) * torch.randint(0, 2, (64 * 8,), generator=gen)
    x[torch.rand(64 * 8, generator=gen) < 0.3] = -0.0
    compiled_too = "group=16" in spec
    payload = _native_equals_eager(spec, x, monkeypatch, compiled_too=compiled_too)
    assert not bool(torch.signbit(payload[2][payload[2] == 0]).any())
    _native_equals_eager(spec, torch.tensor([-0.0]), monkeypatch, compiled_too=True)


def test_switched_off_by_the_environment(monkeypatch):
    x = _gradient_like(4 * 512, 2).view(4, 512)
    monkeypatch.setenv(fused.ENV, "1")
    keys = list(hash_key(0, 1, "k"))
    assert native.qsgd_encoder(15, 4)(x, keys, 0) is not None
    monkeypatch.setenv(native.ENV, "0")
    assert native.qsgd_encoder(15, 4)(x, keys, 0) is None
    monkeypatch.setenv(native.ENV, "1")
    monkeypatch.setenv(fused.ENV, "0")
    assert native.qsgd_encoder(15, 4)(x, keys, 0) is None
    # other dtypes, other devices' layouts, non-contiguous inputs: not for the loops
    monkeypatch.setenv(fused.ENV, "1")
    assert native.qsgd_encoder(15, 4)(x.double(), keys, 0) is None
    assert native.qsgd_encoder(15, 4)(x.t().contiguous().t(), keys, 0) is None


def test_a_failed_build_warns_once_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("GRADZIP_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(native, "_compiler", lambda: ["false"])
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv(fused.ENV, "1")
    with pytest.warns(UserWarning, match="native codec loops unavailable"):
        assert native.library() is None
    assert native.library() is None
    x = _gradient_like(2 * fused.BLOCK, 9)
    monkeypatch.setenv(native.ENV, "1")
    codec = build("natural")
    out = codec.decompress(codec.compress(x, step=0, key=0), like=x)
    assert out.shape == x.shape and bool(torch.isfinite(out).all())


@pytest.mark.parametrize(
    ("spec", "numel"),
    [
        ("uniform:bits=8", 64 * 300 + 17),
        ("uniform:bits=4,rounding=stochastic", 64 * 300),
        ("uniform:bits=8,group=96,rounding=stochastic", 96 * 40 + 95),
        ("uniform:bits=2,group=128", 128 * 33 + 1),
    ],
)
def test_uniform_native_equals_eager(spec, numel, monkeypatch):
    payload = _native_equals_eager(spec, _gradient_like(numel, numel), monkeypatch)
    assert sum(t.numel() * t.element_size() for t in payload) == build(spec).payload_nbytes(numel)


def test_uniform_with_nan_and_huge_groups_equals_eager(monkeypatch):
    """A NaN group and groups near the top of fp32 (the frame sends those to fp64: compiled)."""
    x = _gradient_like(64 * 50, 11)
    x[70] = float("nan")
    monkeypatch.setenv(fused.ENV, "0")
    eager_payload, eager_out = run_codec("uniform:bits=8", x)
    monkeypatch.setenv(fused.ENV, "1")
    payload, out = run_codec("uniform:bits=8", x)
    for got, want in zip(payload, eager_payload, strict=True):
        assert torch.equal(bits_of(got), bits_of(want))
    assert torch.equal(bits_of(out), bits_of(eager_out))


def test_direct_calls_outside_what_the_loops_read(monkeypatch):
    """The wrappers refuse what their C loops would misread (found by calling them directly)."""
    monkeypatch.setenv(fused.ENV, "1")
    for factory in (native.qsgd_encoder, native.qsgd_decoder):
        with pytest.raises(ValueError, match="bits must be one of 1, 2, 4, 8; got 3"):
            factory(7, 3)
    with pytest.raises(ValueError, match="bits"):
        native.uniform_encoder(7, 3, False)
    with pytest.raises(ValueError, match="bits"):
        native.uniform_decoder(16)
    x = _gradient_like(64 * 100, 13)
    assert native.row_sums(x, 64, ("plain",), torch.float16) is None
    assert native.row_sums(x, 64, ("abs", "square")) is None
    assert native.qsgd_encoder(15, 4)(x.view(-1, 40)[:, :33].contiguous(), list(hash_key(0, 0, 0)), 0) is None
    assert native.abs_max(torch._efficientzerotensor(64)) is None


# ----- the count sketch's hashes and peeling ------------------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(numel=st.integers(1, 20_000), kept=st.floats(0.01, 1.0), rows=st.integers(1, 6),
       cells_per_kept=st.sampled_from([0.3, 0.9, 1.3, 2.0]), seed=st.integers(0, 2**16))
def test_count_sketch_decode_in_c_equals_the_torch_rounds(numel, kept, rows, cells_per_kept, seed, monkeypatch):
    # Sketches below and above the peeling threshold, so that both the peeled values and the
    # coordinates left to the median estimates are compared.
    from gradzip.compressors.countsketch import Hashes, Located, _peel_rounds, peel, sketch

    gen = torch.Generator().manual_seed(seed)
    index = torch.randperm(numel, generator=gen)[: max(1, int(kept * numel))].sort().values
    values = torch.randn(index.numel(), generator=gen) * torch.rand(index.numel(), generator=gen) ** 3
    hashes = Hashes.draw(seed, 3, ("bucket", 0), rows, max(1, int(cells_per_kept * index.numel() / rows)))
    monkeypatch.setenv(fused.ENV, "1")
    where = Located.of(index, hashes)  # hashed in C
    table = sketch(values, where)
    cols, signs = where.cols, where.signs
    monkeypatch.setenv(native.ENV, "0")
    torch_where = Located.of(index, hashes)
    assert torch.equal(cols, torch_where.cols) and torch.equal(signs, torch_where.signs)
    torch_values, torch_peeled = peel(table, torch_where)
    monkeypatch.setenv(native.ENV, "1")
    got_values, got_peeled = peel(table, where)
    assert torch.equal(got_peeled, torch_peeled) and torch.equal(bits_of(got_values), bits_of(torch_values))
    # and the rounds themselves: the same remainders, counts and open coordinates
    flat = (cols + (torch.arange(rows) * hashes.cols).reshape(-1, 1)).contiguous()
    states = []
    for rounds in (native.peel, _peel_rounds):
        rest, counts = table.double().reshape(-1).clone(), torch.zeros(table.numel(), dtype=torch.int32)
        counts.index_add_(0, flat.reshape(-1), torch.ones(flat.numel(), dtype=torch.int32))
        out = torch.zeros(index.numel(), dtype=torch.float64)
        left = rounds(flat, signs.double(), rest, counts, out)
        states.append((bits_of(rest), counts, bits_of(out), left))
    for got, want in zip(*states, strict=True):
        assert torch.equal(got, want)


def test_count_sketch_loops_leave_odd_inputs_to_torch():
    cells = torch.zeros(2, 3, dtype=torch.int64)
    signs, values = torch.ones(2, 3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    rest, counts = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.int32)
    assert native.peel(cells, signs.float(), rest, counts, values) is None  # fp32 signs
    assert native.peel(cells + 4, signs, rest, counts, values) is None  # a cell past the table
    assert native.peel(cells, signs, rest, counts.long(), values) is None
    assert native.hash_cells(torch.ones(2, 8, dtype=torch.int64), torch.tensor([-1]), 5) is None
    assert native.hash_cells(torch.ones(2, 4, dtype=torch.int64), torch.tensor([1]), 5) is None
    assert torch.equal(rest, torch.zeros(4, dtype=torch.float64)) and not counts.any()  # nothing changed
