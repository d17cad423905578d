"""Single-process tests of the core pieces: spec parser, cast / Top-K / PowerSGD codecs (payload
formulas, kept counts, empty tensors) and error feedback (invariant, shape changes, state)."""

import warnings

import pytest
import torch

from gradzip.compressors import build, kept_count, list_compressors
from gradzip.compressors.kernels import wire
from gradzip.compressors.lowrank import PowerSGD
from gradzip.feedback import ErrorFeedback

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def test_registry_has_main_job_codecs():
    assert {"none", "fp16", "bf16", "topk", "powersgd"} <= set(list_compressors())


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nosuchcodec", "unknown compressor 'nosuchcodec'; known:"),
        ("topk:ratio=0", "ratio must be in (0, 1]"),
        ("topk:ratio=-1", "ratio must be in (0, 1]"),
        ("topk:ratio=nan", "ratio must be a number in (0, 1]"),
        ("powersgd:approx_rank=-1", "approx_rank must be an integer >= 1"),
        ("powersgd:approx_rank=2.5", "approx_rank must be an integer >= 1"),
        ("powersgd:start_step=-1", "start_step must be an integer >= 0"),
        ("topk:foo=1", "topk has no parameter 'foo'; it takes ratio"),
        ("topk:ratio=0.1,ratio=0.2", "given twice"),
        ("topk:ratio", "expected key=value"),
        ("", "empty"),
    ],
)
def test_bad_specs_raise_value_error_naming_the_problem(spec, message):
    with pytest.raises(ValueError) as info:
        build(spec)
    assert message in str(info.value)


def test_spec_round_trips():
    for spec in ["none", "fp16", "topk:ratio=0.05", "powersgd:approx_rank=2,start_step=3,warm_start=false"]:
        codec = build(spec)
        again = build(codec.spec)
        assert type(again) is type(codec) and again.params == codec.params


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "topk:ratio=0.1"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("contiguous", [True, False])
def test_round_trip_shape_dtype_and_payload_formula(spec, dtype, contiguous):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 30, generator=gen).to(dtype)
    if not contiguous:
        x = x.t()
    codec = build(spec)
    payload = codec.compress(x, step=0, key="k")
    out = codec.decompress(payload, like=x)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert payload.nbytes == codec.payload_nbytes(x.numel(), x.dtype)
    assert torch.isfinite(out).all()


def test_identity_and_casts_decode_to_rounded_input():
    x = torch.tensor([1.0, 2.0, 3.0, 1e-4])
    assert torch.equal(build("none").decompress(build("none").compress(x), like=x), x)
    fp16 = build("fp16").compress(x)
    assert fp16.tensors[0].dtype == torch.float16 and fp16.nbytes == 8  # 2 bytes per element on the wire
    assert torch.equal(build("fp16").decompress(fp16, like=x), x.half().float())
    assert torch.equal(build("bf16").decompress(build("bf16").compress(x), like=x), x.bfloat16().float())


def test_topk_keeps_exactly_the_largest_magnitudes():
    x = torch.tensor([0.1, -5.0, 0.3, 4.0, -0.2, 0.0, 2.0, -3.0, 0.05, 1.0])
    codec = build("topk:ratio=0.4")
    out = codec.decompress(codec.compress(x), like=x)
    expected = torch.tensor([0.0, -5.0, 0.0, 4.0, 0.0, 0.0, 2.0, -3.0, 0.0, 0.0])
    assert torch.equal(out, expected)


def test_topk_kept_count_is_at_least_one_full_ratio_is_exact_and_empty_stays_empty():
    assert kept_count(1000, 0.01) == 10
    assert kept_count(10, 1e-6) == 1
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    payload = build("topk:ratio=0.01").compress(x)
    assert payload.tensors[0].numel() == 10
    assert build("topk:ratio=1e-6").compress(torch.ones(10)).tensors[0].numel() == 1
    full = build("topk:ratio=1.0")
    assert torch.equal(full.decompress(full.compress(x), like=x), x)
    empty = torch.empty(0)
    out = full.decompress(full.compress(empty), like=empty)
    assert out.shape == (0,)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="ratio"):
            build(f"topk:ratio={bad}")


def test_topk_index_dtype_is_the_narrowest():
    assert wire.index_dtype(256) == torch.uint8
    assert wire.index_dtype(257) == torch.int16
    assert wire.index_dtype(1 << 15) == torch.int16
    assert wire.index_dtype((1 << 15) + 1) == torch.int32
    payload = build("topk:ratio=0.01").compress(torch.randn(5000))
    assert payload.tensors[1].dtype == torch.int16
    assert payload.nbytes == 50 * (4 + 2)


def test_error_feedback_invariant_in_float64():
    gen = torch.Generator().manual_seed(1)
    codec = build("topk:ratio=0.05")
    feedback = ErrorFeedback()
    for step in range(5):
        grad = torch.randn(200, generator=gen, dtype=torch.float64)
        compensated = feedback.compensate("k", grad, step=step)
        decoded = codec.decompress(codec.compress(compensated), like=compensated)
        feedback.update("k", compensated, decoded, step=step)
        assert torch.equal(compensated, decoded + feedback.residuals["k"])
    # The residual carries what was dropped: compensated - decoded, computed independently.
    assert feedback.residual_norm("k") == pytest.approx(float((compensated - decoded).norm()))


def test_error_feedback_does_not_modify_the_gradient():
    grad = torch.ones(4)
    feedback = ErrorFeedback()
    feedback.update("k", torch.full((4,), 2.0), torch.zeros(4), step=0)
    out = feedback.compensate("k", grad, step=1)
    assert torch.equal(grad, torch.ones(4)) and torch.equal(out, torch.full((4,), 3.0))


def test_error_feedback_restarts_a_key_whose_shape_changed_with_a_warning_and_checks_start_step():
    feedback = ErrorFeedback(start_step=1)
    g100 = torch.ones(100)
    comp = feedback.compensate(0, g100, step=0)
    feedback.update(0, comp, torch.zeros(100), step=0)
    assert 0 not in feedback.residuals  # before start_step nothing is remembered
    comp = feedback.compensate(0, g100, step=1)
    feedback.update(0, comp, torch.zeros(100), step=1)
    assert feedback.residuals[0].shape == (100,)
    with pytest.warns(UserWarning, match="changed shape"):
        comp = feedback.compensate(0, torch.ones(120), step=2)
    assert torch.equal(comp, torch.ones(120))  # restarted at zero
    feedback.update(0, comp, torch.zeros(120), step=2)
    assert list(feedback.residuals) == [0] and feedback.residuals[0].shape == (120,)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="start_step"):
            ErrorFeedback(start_step=bad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        feedback.compensate(0, torch.ones(120), step=3)  # same shape: no warning


def test_error_feedback_state_dict_round_trip():
    feedback = ErrorFeedback()
    feedback.update("a", torch.arange(3.0), torch.zeros(3), step=0)
    other = ErrorFeedback()
    other.load_state_dict(feedback.state_dict())
    assert torch.equal(other.residuals["a"], torch.arange(3.0))


def test_powersgd_payload_formula_and_rank_clamp():
    codec = PowerSGD(approx_rank=4)
    assert codec.matrix_payload_nbytes((100, 50)) == (100 + 50) * 4 * 4
    assert codec.matrix_payload_nbytes((8, 3, 3)) == (8 + 9) * 4 * 4
    # (n + m) r >= n m travels uncompressed, and the rank clamps to min(n, m).
    assert not codec.compresses((8, 4)) and codec.effective_rank(8, 4) == 4
    assert not PowerSGD(approx_rank=2).compresses((3, 3))
    assert not codec.compresses((10,))
    assert codec.matrix_payload_nbytes((8, 4), torch.bfloat16) == 32 * 2


def test_wire_packing_round_trip_all_widths():
    gen = torch.Generator().manual_seed(0)
    for bits in (1, 2, 4, 8):
        for numel in (0, 1, 7, 8, 9, 1001):
            codes = torch.randint(0, 2**bits, (numel,), generator=gen, dtype=torch.uint8)
            packed = wire.pack_bits(codes, bits)
            assert packed.dtype == torch.uint8 and packed.numel() == (numel * bits + 7) // 8
            assert torch.equal(wire.unpack_bits(packed, bits, numel), codes)
    with pytest.raises(ValueError, match="bits must be one of"):
        wire.pack_bits(torch.zeros(3, dtype=torch.uint8), 3)


def test_wire_bytes_buffer_round_trip_with_mixed_dtypes():
    parts = (torch.tensor([1, 2, 3], dtype=torch.uint8), torch.tensor([1.5, -2.0]), torch.tensor([7], dtype=torch.int16))
    buf = wire.to_bytes(parts)
    assert buf.numel() == wire.nbytes(parts) == 3 + 8 + 2
    back = wire.from_bytes(buf, parts)
    assert all(torch.equal(a, b) for a, b in zip(parts, back))


def test_compression_state_pickles_without_its_group_and_keeps_residuals():
    import pickle

    from gradzip import CompressionState

    state = CompressionState("topk:ratio=0.1", process_group=object())
    state.step = 7
    state.reducer.feedback.update(3, torch.arange(4.0), torch.zeros(4), step=0)
    clone = pickle.loads(pickle.dumps(state))
    assert clone.process_group is None
    assert clone.compressor.spec == "topk:ratio=0.1" and clone.step == 7
    assert torch.equal(clone.reducer.feedback.residuals[3], torch.arange(4.0))
    with pytest.raises(ValueError, match="checkpoint holds compressor state"):
        CompressionState("fp16").load_state_dict(state.state_dict())


def test_an_unknown_key_lists_the_ddp_warmup_options_where_the_codec_takes_them():
    from gradzip.choice import parse_compressor

    with pytest.raises(ValueError) as info:
        parse_compressor("topk:ratoi=0.01")
    assert str(info.value) == ("topk has no parameter 'ratoi'; it takes ratio, start_step; as a DDP hook's codec "
                               "also warmup_steps, warmup_stages, clip_norm (DGC's sparsity warm-up)")
    parse_compressor("topk:ratio=0.01,warmup_steps=5")  # which are indeed taken
    with pytest.raises(ValueError) as info:  # no ratio, no warm-up: not offered
        parse_compressor("powersgd:ratioo=2")
    assert str(info.value).endswith("it takes approx_rank, start_step, warm_start, seed, factor_bits")
