"""Single-process properties of every codec, Top-K's kept counts and edges, bad parameters, specs,
list and bench."""

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.compressors import REGISTRY, build, kept_count
from gradzip.compressors.kernels import wire
from gradzip.lab import cli
from gradzip.lab.bench import FIELDS, heavy_tailed_gradient, split_specs
from gradzip.lab.listing import codec_rows

# Every single-round codec with its defaults, and variants that take other code paths.
SPECS = sorted(n for n, cls in REGISTRY.items() if not cls.multi_round) + [
    "qsgd:bits=2,bucket=7,norm=l2",
    "qsgd:bits=8,bucket=64",
    "uniform:bits=4,group=5,rounding=stochastic",
    "uniform:bits=1",
    "randomk:ratio=0.3,unbiased=true",
    "terngrad:clip=0",
    "topk:ratio=0.3",
    "dgc:ratio=0.05",
    "threshold:tau=0.5,max_ratio=0.2",
    "topk:ratio=0.1+uniform:bits=8",
    "randomk:ratio=0.2+fp16",
    "dgc:ratio=0.1+qsgd:bits=2",
    "efsignsgd:group=4",
    "signsgd:group=64",
]
# Casting to a narrower float cannot represent the top of the wider range; those codecs are
# covered by test_casts_saturate_past_the_wire_range_and_match_a_plain_cast_within_it instead of
# the extreme-value test.
NARROWING = ("fp16", "bf16")
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _sample(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return heavy_tailed_gradient(numel, seed=seed, scale=1.0).to(dtype)


@settings(max_examples=30, deadline=None)
@given(
    spec=st.sampled_from(SPECS),
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 23), min_size=1, max_size=3),
    transpose=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_round_trip_keeps_shape_dtype_finiteness_and_payload_formula(spec, dtype, shape, transpose, seed):
    codec = build(spec)
    numel = math.prod(shape)
    x = _sample(numel, dtype, seed).reshape(shape)
    if transpose and x.dim() >= 2:
        x = x.transpose(0, -1)  # not contiguous
    payload = codec.compress(x, step=seed, key="k")
    assert payload.nbytes == codec.payload_nbytes(numel, dtype)
    y = codec.decompress(payload, like=x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.isfinite(y).all()
    zeros = torch.zeros_like(x)
    assert torch.equal(codec.decompress(codec.compress(zeros, step=seed), like=zeros), zeros)


@pytest.mark.parametrize("spec", SPECS)
def test_large_tensor_payload_equals_formula_and_decodes_close(spec):
    # Over 2**15 elements: int32 indices and the sampled-threshold selection of Top-K and DGC.
    codec = build(spec)
    x = _sample(40_001, torch.float32, 3)
    payload = codec.compress(x, step=1, key=0)
    assert payload.nbytes == codec.payload_nbytes(x.numel(), x.dtype)
    y = codec.decompress(payload, like=x)
    assert torch.isfinite(y).all()
    assert float((x - y).norm() / x.norm()) < 12.0  # unbiased Random-K at ratio 0.3 is the loosest


@pytest.mark.parametrize("spec", [s for s in SPECS if not any(n in s for n in NARROWING)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_finite_inputs_stay_finite(spec, dtype):
    codec = build(spec)
    info = torch.finfo(dtype)
    cases = {
        "top of range": torch.full((300,), info.max, dtype=dtype),
        "both ends": torch.linspace(-1, 1, 300, dtype=torch.float64).mul(info.max).to(dtype),
        "denormals": torch.full((300,), info.tiny / 4, dtype=dtype),
        "one outlier": _sample(300, dtype, 0).index_fill(0, torch.tensor([7]), info.max / 2),
        "tiny and huge groups": torch.cat([torch.full((150,), info.tiny, dtype=dtype), torch.full((150,), info.max / 3, dtype=dtype)]),
    }
    for name, x in cases.items():
        y = codec.decompress(codec.compress(x, step=2), like=x)
        assert torch.isfinite(y).all(), (name, y[~torch.isfinite(y)][:4])


def _mean_decode(spec: str, x: torch.Tensor, trials: int) -> torch.Tensor:
    codec = build(spec)
    total = torch.zeros_like(x, dtype=torch.float64)
    for step in range(trials):
        total += codec.decompress(codec.compress(x, step=step, key="u"), like=x).double()
    return total / trials


@pytest.mark.parametrize(
    "spec, std_bound",
    [
        # Random-K scaled by n / k: Var = x_i**2 (n / k - 1).
        ("randomk:ratio=0.25,unbiased=true", lambda x: x.abs() * math.sqrt(4 - 1)),
        # QSGD, max norm, s levels: |error| <= scale / s, so Var <= (scale / s)**2 / 4.
        ("qsgd:bits=2,bucket=16", lambda x: x.view(-1, 16).abs().amax(1, keepdim=True).expand(-1, 16).reshape(-1) / 3 / 2),
        ("qsgd:bits=1,bucket=16,norm=l2", lambda x: x.view(-1, 16).norm(dim=1, keepdim=True).expand(-1, 16).reshape(-1) / 2),
        # Natural compression: Var = (2^(e+1) - |x|)(|x| - 2^e) <= x**2 / 8.
        ("natural", lambda x: x.abs() / math.sqrt(8)),
        # TernGrad without clipping: Var = |x| (s - |x|) <= s**2 / 4.
        ("terngrad:clip=0", lambda x: x.abs().max().expand_as(x) / 2),
        ("uniform:bits=2,group=8,rounding=stochastic", lambda x: _group_step(x, 8, 3) / 2),
    ],
)
def test_unbiased_codecs_average_to_the_input(spec, std_bound):
    assert build(spec).unbiased
    trials = 600
    x = _sample(64, torch.float64, 11)
    mean = _mean_decode(spec, x, trials)
    # Five standard errors of the mean, plus the 2**-16 dither resolution.
    tolerance = 5 * std_bound(x) / math.sqrt(trials) + 2.0**-16 * x.abs().max() + 1e-12
    assert ((mean - x).abs() <= tolerance).all(), (mean - x).abs().max()


def _group_step(x, group, steps):
    view = x.view(-1, group)
    step = (view.amax(1, keepdim=True) - view.amin(1, keepdim=True)) / steps
    return step.expand(-1, group).reshape(-1)


@settings(max_examples=30, deadline=None)
@given(
    values=st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=1, max_size=200, unique_by=abs),
    ratio=st.floats(0.001, 1.0),
)
def test_topk_keeps_exactly_the_k_largest_magnitudes(values, ratio):
    x = torch.tensor(values, dtype=torch.float32)
    k = kept_count(x.numel(), ratio)
    y = build(f"topk:ratio={ratio}").decompress(build(f"topk:ratio={ratio}").compress(x), like=x)
    expected = torch.zeros_like(x)
    top = torch.topk(x.abs(), k).indices
    expected[top] = x[top]
    assert torch.equal(y, expected)


def test_topk_sampled_selection_is_exact_on_large_heavy_tailed_tensors():
    for seed, numel, ratio in [(0, 120_000, 0.01), (1, 100_003, 0.002), (2, 65_536, 0.1)]:
        x = _sample(numel, torch.float32, seed)
        codec = build(f"topk:ratio={ratio}")
        values, indices = codec.compress(x, step=seed).tensors
        k = kept_count(numel, ratio)
        assert values.numel() == k
        assert set(indices.long().tolist()) == set(torch.topk(x.abs(), k).indices.tolist())
        assert torch.equal(values, x[indices.long()])


def test_dgc_and_threshold_keep_at_most_k_exact_values():
    x = _sample(60_000, torch.float32, 5)
    for spec in ["dgc:ratio=0.01", "threshold:tau=2.0,max_ratio=0.01", "threshold:tau=50.0,max_ratio=0.5"]:
        codec = build(spec)
        y = codec.decompress(codec.compress(x), like=x)
        kept = y != 0
        assert int(kept.sum()) <= codec.values_numel(x.numel())
        assert torch.equal(y[kept], x[kept])
    codec = build("threshold:tau=50.0,max_ratio=0.5")
    y = codec.decompress(codec.compress(x), like=x)
    assert torch.equal(y != 0, x.abs() >= 50.0)  # under capacity: exactly the elements over tau


@pytest.mark.parametrize("spec", sorted({s for s in SPECS if build(s).aggregatable} | {"none", "fp16", "bf16"}))
def test_aggregatable_codecs_decode_the_sum_of_payloads_to_the_sum_of_decodes(spec):
    codec = build(spec)
    grads = [_sample(1000, torch.float32, seed) for seed in range(3)]
    payloads = [codec.compress(g, step=4, key=1) for g in grads]
    summed = tuple(torch.stack(parts).sum(0) for parts in zip(*(p.tensors for p in payloads)))
    from gradzip.compressors import Payload

    decoded_sum = codec.decompress(Payload(summed, payloads[0].ctx), like=grads[0])
    sum_of_decoded = sum(codec.decompress(p, like=grads[0]) for p in payloads)
    # Summing in a 16-bit payload dtype rounds once per add (2**-8 relative for bf16).
    rtol = 2e-2 if "bf16" in spec else 2e-3
    torch.testing.assert_close(decoded_sum, sum_of_decoded, rtol=rtol, atol=rtol)


def test_topk_keeps_ratio_times_numel_at_least_one_decodes_ratio_one_exactly_and_refuses_bad_ratios():
    x = _sample(1000, torch.float32, 0)
    assert build("topk:ratio=0.01").compress(x).tensors[0].numel() == 10
    assert build("topk:ratio=1e-6").compress(x[:10]).tensors[0].numel() == 1
    full = build("topk:ratio=1.0")
    assert torch.equal(full.decompress(full.compress(x), like=x), x)
    empty = torch.empty(0)
    out = build("topk:ratio=0.01").decompress(build("topk:ratio=0.01").compress(empty), like=empty)
    assert out.shape == (0,)
    for bad in ["0", "-1", "1.5", "nan"]:
        with pytest.raises(ValueError, match="ratio must be"):
            build(f"topk:ratio={bad}")


@pytest.mark.parametrize(
    "spec, name",
    [
        ("qsgd:bits=3", "bits must be one of 1, 2, 4, 8"),
        ("uniform:bits=16", "bits must be one of 1, 2, 4, 8"),
        ("uniform:group=0", "group must be an integer >= 1"),
        ("qsgd:bucket=-4", "bucket must be an integer >= 1"),
        ("uniform:rounding=up", "rounding must be one of nearest, stochastic"),
        ("qsgd:norm=l3", "norm must be one of max, l2"),
        ("randomk:ratio=2", "ratio must be in \\(0, 1\\]"),
        ("dgc:ratio=0", "ratio must be in \\(0, 1\\]"),
        ("threshold:max_ratio=0", "max_ratio must be in \\(0, 1\\]"),
        ("threshold:tau=-1", "tau must be a number >= 0"),
        ("terngrad:clip=-2", "clip must be a number >= 0"),
        ("randomk:unbiased=3", "unbiased must be true or false"),
        ("natural:seed=-1", "seed must be an integer >= 0"),
        ("fp16+topk", "every codec but the last must be a sparsifier"),
        ("topk+powersgd", "cannot be composed"),
    ],
)
def test_bad_parameters_raise_value_error_naming_parameter_and_range(spec, name):
    with pytest.raises(ValueError, match=name):
        build(spec)


def test_specs_are_canonical_short_and_round_trip():
    for spec in SPECS + ["powersgd:approx_rank=2,warm_start=false"]:
        codec = build(spec)
        assert build(codec.spec).spec == codec.spec
    assert build("topk:ratio=0.01").spec == "topk"
    assert build("topk:ratio=1").spec == build("topk:ratio=1.0").spec == "topk:ratio=1.0"
    assert build("qsgd:bits=4,bucket=512").spec == "qsgd"
    assert build("topk:ratio=0.01+uniform:bits=4").spec == "topk+uniform:bits=4"


def test_composition_payload_is_the_inner_payload_of_the_kept_values():
    codec = build("topk:ratio=0.01+uniform:bits=8")
    numel = 1 << 20
    k = kept_count(numel, 0.01)
    expected = k * wire.index_nbytes(numel) + build("uniform:bits=8").payload_nbytes(k)
    assert codec.payload_nbytes(numel) == expected
    assert not codec.aggregatable and codec.error_feedback
    assert build("randomk+fp16").aggregatable and build("randomk+fp16").needs_shared_seed


def test_payload_equals_formula_at_a_million_elements():
    x = _sample(1 << 20, torch.float32, 9)
    for spec in ["topk", "qsgd", "terngrad", "signsgd", "natural", "uniform:bits=4", "randomk", "dgc"]:
        codec = build(spec)
        assert codec.compress(x).nbytes == codec.payload_nbytes(x.numel()), spec


def test_stochastic_codecs_repeat_for_the_same_seed_step_and_key():
    x = _sample(500, torch.float32, 1)
    for spec in ["qsgd", "terngrad", "natural", "uniform:rounding=stochastic", "randomk", "dgc"]:
        codec = build(spec)
        a, b = codec.compress(x, step=3, key=2), codec.compress(x, step=3, key=2)
        assert all(torch.equal(p, q) for p, q in zip(a.tensors, b.tensors)), spec
        c = codec.compress(x, step=4, key=2)
        if spec != "dgc":  # DGC's sample moves only the threshold, often not the selection
            assert not all(torch.equal(p, q) for p, q in zip(a.tensors, c.tensors)), spec


def test_sign_codecs_send_zero_as_plus_scale():
    x = torch.tensor([0.0, -0.0, 2.0, -4.0])
    for spec in ["signsgd", "efsignsgd"]:
        codec = build(spec)
        assert codec.decompress(codec.compress(x), like=x).tolist() == [1.5, 1.5, 1.5, -1.5]


def test_sign_codecs_with_groups_scale_each_group_by_its_mean_magnitude():
    x = torch.tensor([1.0, -3.0, 0.0, 2.0, 10.0, -10.0, 5.0, 5.0, 7.0])
    for spec in ["signsgd:group=4", "efsignsgd:group=4"]:
        codec = build(spec)
        payload = codec.compress(x)
        # groups [1, -3, 0, 2], [10, -10, 5, 5], [7]: means 1.5, 7.5, 7; zero sent as +1
        assert payload.tensors[1].tolist() == [1.5, 7.5, 7.0]
        assert codec.decompress(payload, like=x).tolist() == [1.5, -1.5, 1.5, 1.5, 7.5, -7.5, 7.5, 7.5, 7.0]
        assert payload.nbytes == 2 + 3 * 4 == codec.payload_nbytes(9)
    with pytest.raises(ValueError, match="group"):
        build("efsignsgd:group=-1")


def test_sign_scale_of_fp64_values_near_the_top_of_the_range_is_their_mean():
    top = torch.finfo(torch.float64).max
    x = torch.tensor([top, -top, 0.0], dtype=torch.float64)
    for spec in ["signsgd", "efsignsgd"]:
        scale = build(spec).compress(x).tensors[1]
        assert scale.dtype == torch.float64
        torch.testing.assert_close(scale, torch.tensor([top / 3 * 2], dtype=torch.float64), rtol=1e-15, atol=0)


def test_list_shows_every_codec_and_powersgd_as_a_matrix(capsys):
    names = {row["codec"].split(":")[0] for row in codec_rows()}
    assert names == set(REGISTRY)
    powersgd = next(row for row in codec_rows() if row["codec"].startswith("powersgd"))
    assert powersgd["payload_bytes_1m"] == build("powersgd").matrix_payload_nbytes((1024, 1024))
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "1024 x 1024" in out and all(name in out for name in REGISTRY)
    # the columns line up whatever a codec's defaults (each row as long as the header, the
    # property columns at the header's places) and the schedules are named below the table
    table = out.split("\n\n")[0].splitlines()
    header, rows = table[0], table[2:]
    assert len(rows) == len(REGISTRY) and {len(r) for r in rows} == {len(header)}
    aggr = header.index("aggr")
    assert all(r[aggr : aggr + 4].strip() in ("yes", "-") for r in rows)
    assert all(name in out for name in ("auto", "kimad", "legacy", "edgc", "torch:powersgd"))


def test_bench_json_has_exactly_the_fields(capsys):
    assert split_specs("qsgd:bits=4,bucket=512,topk,uniform:bits=8+fp16") == [
        "qsgd:bits=4,bucket=512",
        "topk",
        "uniform:bits=8+fp16",
    ]
    with pytest.raises(ValueError, match="codec name"):
        split_specs("bits=4,topk")
    argv = ["bench", "--size-mb", "0.05", "--repeats", "1", "--codecs", "topk,qsgd:bits=2,bucket=64", "--json"]
    assert cli.main([*argv, "--input", "synthetic"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["codec"] for row in rows] == ["topk", "qsgd:bits=2,bucket=64"]
    for row in rows:
        assert tuple(row) == FIELDS
        assert row["payload_bytes"] == row["formula_bytes"] and row["gbps"] > 0
    assert cli.main(["bench", "--size-mb", "0", "--codecs", "topk"]) == 2


def test_bench_times_the_codecs_with_their_own_reducer(capsys):
    """PowerSGD, SEPARATE, Radius and the count sketch go through their reducers on a one-rank
    group: the bytes are the codec's formula for the bucket read as a rows x 1024 matrix and a
    flat remainder, and the group is gone afterwards."""
    import torch.distributed as dist

    from gradzip.compressors import build
    from gradzip.lab.bench import bucket_shapes

    specs = ["powersgd:approx_rank=2", "powersgd:approx_rank=2,factor_bits=8", "separate", "radius", "countsketch"]
    argv = ["bench", "--size-mb", "0.05", "--repeats", "2", "--codecs", ",".join(specs), "--json", "--input", "synthetic"]
    assert cli.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    numel = int(0.05 * (1 << 20)) // 4  # 13,107: a 12 x 1024 matrix and 819 elements flat
    assert bucket_shapes(numel) == [torch.Size((12, 1024)), torch.Size((819,))]
    expected = {
        "powersgd:approx_rank=2": (12 + 1024) * 2 * 4 + 819 * 4,
        # int8 factors with an fp32 scale per column of P and of Q (2 factors x 2 columns)
        "powersgd:approx_rank=2,factor_bits=8": (12 + 1024) * 2 * 1 + 2 * 2 * 4 + 819 * 4,
        "separate": 12 * 4 * 4 + 819 * 4,
        "radius": build("radius").payload_nbytes(numel),
        "countsketch": build("countsketch").payload_nbytes(numel),
    }
    assert [row["codec"] for row in rows] == specs
    for row in rows:
        assert row["payload_bytes"] == row["formula_bytes"] == expected[row["codec"]]
        assert row["gbps"] > 0 and 0 < row["rel_error"]
    assert not dist.is_initialized()


@pytest.mark.parametrize("spec,wire_dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_casts_saturate_past_the_wire_range_and_match_a_plain_cast_within_it(spec, wire_dtype):
    wire_max = torch.finfo(wire_dtype).max
    big = 1e5 if wire_dtype == torch.float16 else 3.4e38  # finite in fp32, rounds to inf in the wire dtype
    inside = _sample(64, torch.float32, 3) * 100
    x = torch.cat([inside, torch.tensor([big, -big, float(torch.finfo(torch.float32).max)])])
    assert torch.isinf(x.to(wire_dtype)[64:]).all()  # what a plain cast (PyTorch's hooks) sends
    (sent,) = build(spec).compress(x).tensors
    assert sent.dtype == wire_dtype
    assert torch.equal(sent[:64], inside.to(wire_dtype))  # bit for bit the plain cast in range
    assert sent[64:].tolist() == [wire_max, -wire_max, wire_max]


def test_dgc_lowers_an_overestimated_threshold_until_0_8_k_pass(monkeypatch):
    from gradzip.compressors import sparse

    x = _sample(200_000, torch.float32, 11)
    codec = build("dgc:ratio=0.01")
    k = codec.values_numel(x.numel())
    kth = float(torch.topk(x.abs(), k).values.min())
    # A sample far off: the estimate is 4x the true k-th magnitude, so only a few pass at first.
    monkeypatch.setattr(sparse, "sampled_threshold", lambda *args, **kwargs: 4 * kth)
    y = codec.decompress(codec.compress(x, step=1), like=x)
    kept = int((y != 0).sum())
    assert 0.8 * k <= kept <= k
    # What passed is the largest magnitudes: the kept set is exactly the top `kept`.
    assert torch.equal((y != 0).nonzero().view(-1), torch.topk(x.abs(), kept).indices.sort().values)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_natural_nonfinite_values_leave_their_neighbours_alone(dtype):
    """NaN and inf become the largest power of two, signed, and every other element decodes as
    it does without them (the dither is drawn per position). Whole rows of 8192 so that the
    codes sit in packed words beside those of other columns."""
    codec = build("natural")
    clean = _sample(3 * 8192 + 5, torch.float64, 4).to(dtype)
    hostile = clean.clone()
    where = torch.tensor([7, 8, 9, 8192 + 100, 3 * 8192 + 2])
    hostile[where] = torch.tensor([float("nan"), float("inf"), -float("inf"), -float("nan"), float("nan")], dtype=dtype)
    want = codec.decompress(codec.compress(clean, step=3, key="k"), like=clean)
    got = codec.decompress(codec.compress(hostile, step=3, key="k"), like=hostile)
    others = torch.ones_like(clean, dtype=torch.bool)
    others[where] = False
    assert torch.equal(got[others], want[others])
    largest = math.ldexp(1.0, math.frexp(torch.finfo(dtype).max)[1] - 1)
    signs = torch.where(torch.signbit(hostile[where]), -1.0, 1.0).double()
    assert torch.equal(got[where].double(), signs * largest)
