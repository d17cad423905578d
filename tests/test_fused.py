"""Compiled codec kernels (``gradzip.compressors.kernels.fused``) against their eager runs, bit for bit.

The native loops, which take over some of these kernels on fp32 CPU tensors, are off here
(``tests/test_native.py`` checks them), so that the compiled kernels run."""

from __future__ import annotations

import pytest
import torch
from helpers.codec_runs import bits_of, run_codec

from gradzip.compressors import build
from gradzip.compressors.kernels import fused, native
from gradzip.compressors.kernels.dither import hash_key, hashed_dither


@pytest.fixture(autouse=True)
def _compiled_kernels_only(monkeypatch):
    monkeypatch.setenv(native.ENV, "0")

#: (spec, numel, kernels that must have run compiled): whole rows plus a short last row; the
#: uniform group is not a multiple of 32
CASES = [
    ("qsgd:bits=4,bucket=64", 64 * 5 + 13, ("_qsgd_encoder_with_stats", "_qsgd_decoder")),
    ("qsgd:bits=2,bucket=32,norm=l2", 32 * 40 + 3, ("_qsgd_encoder", "_qsgd_decoder")),
    ("uniform:bits=2,group=20,rounding=stochastic", 20 * 7 + 5, ("min_max_rows", "_uniform_encoder_loose", "_uniform_decoder_loose")),
    ("terngrad", 2 * fused.BLOCK + 5, ("_terngrad_encoder_with_stats", "_terngrad_decoder")),
    ("terngrad:clip=0", 2 * fused.BLOCK + 5, ("abs_max_rows", "_terngrad_encoder", "_terngrad_decoder")),
    ("natural", 2 * fused.BLOCK + 5, ("_natural_encoder", "_natural_decoder")),
    ("signsgd", 2 * fused.BLOCK + 5, ("_nonnegative", "_signed_scale")),
    ("efsignsgd:group=64", 64 * 9 + 5, ("_nonnegative", "_signed_scale")),
    ("topk:ratio=0.01", 300_007, ("topk_candidates",)),
]


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "numel", "kernels"), CASES)
def test_compiled_equals_eager(spec, numel, kernels, monkeypatch):
    gen = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen) * 1e-2
    monkeypatch.setenv(fused.ENV, "0")
    eager_payload, eager_out = run_codec(spec, x)
    monkeypatch.setenv(fused.ENV, "1")
    payload, out = run_codec(spec, x)
    compiled = {name.split("[")[0] for name in fused.compile_seconds}
    assert set(kernels) <= compiled, f"not compiled: {set(kernels) - compiled}"
    assert len(payload) == len(eager_payload)
    for got, want in zip(payload, eager_payload, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(bits_of(got), bits_of(want))
    assert torch.equal(bits_of(out), bits_of(eager_out))
    assert sum(t.numel() * t.element_size() for t in payload) == build(spec).payload_nbytes(numel)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["qsgd:bits=4,bucket=64", "uniform:bits=4,group=32"])
def test_compiled_equals_eager_outside_the_fp32_frame(spec, monkeypatch):
    """Scales near the top of fp32 send the codecs to fp64 arithmetic (QSGD after its fused
    fp32 pass): still the same bytes compiled and eager, and finite."""
    gen = torch.Generator().manual_seed(7)
    x = (torch.rand(64 * 9 + 5, generator=gen) * 2 - 1) * 3e38
    monkeypatch.setenv(fused.ENV, "0")
    eager_payload, eager_out = run_codec(spec, x)
    monkeypatch.setenv(fused.ENV, "1")
    payload, out = run_codec(spec, x)
    for got, want in zip(payload, eager_payload, strict=True):
        assert torch.equal(bits_of(got), bits_of(want))
    assert torch.equal(bits_of(out), bits_of(eager_out))
    assert bool(torch.isfinite(out).all())


def test_terngrad_without_an_element_at_the_bound(monkeypatch):
    """Uniform values never reach 2.5 standard deviations: the scaler is max |g|, the codes
    are recomputed for it, compiled as eager."""
    gen = torch.Generator().manual_seed(8)
    x = torch.rand(3 * fused.BLOCK + 5, generator=gen) * 2 - 1
    monkeypatch.setenv(fused.ENV, "0")
    eager_payload, eager_out = run_codec("terngrad", x)
    monkeypatch.setenv(fused.ENV, "1")
    payload, out = run_codec("terngrad", x)
    assert float(payload[1]) == float(x.abs().max())
    for got, want in zip(payload, eager_payload, strict=True):
        assert torch.equal(bits_of(got), bits_of(want))
    assert torch.equal(bits_of(out), bits_of(eager_out))


@pytest.mark.slow
def test_warm_up_compiles_before_the_first_bucket(monkeypatch):
    """After :func:`fused.warm_up` a bucket of another size compiles nothing more."""
    monkeypatch.setenv(fused.ENV, "1")
    spec = "uniform:bits=4,group=48"
    assert fused.warm_up(build(spec)) > 0.0
    compiled = dict(fused.compile_seconds)
    assert {"min_max_rows", "_uniform_encoder", "_uniform_decoder"} <= {name.split("[")[0] for name in compiled}
    codec = build(spec)
    x = torch.randn(48 * 2000 + 7, generator=torch.Generator().manual_seed(1))
    codec.decompress(codec.compress(x, step=0, key="bucket"), like=x)
    assert fused.compile_seconds == compiled
    monkeypatch.setenv(fused.ENV, "0")
    assert fused.warm_up(build(spec)) == 0.0


def test_compile_failure_falls_back_to_eager(monkeypatch):
    def broken(*_args, **_kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setenv(fused.ENV, "1")
    kernel = fused.Kernel(lambda a, b: (a * b + 1,), "test_kernel")
    a, b = torch.arange(6.0), torch.full((6,), 2.0)
    with pytest.warns(UserWarning, match="running it eagerly"):
        (out,) = kernel(a, b)
    assert torch.equal(out, a * 2 + 1)
    assert kernel.failed
    (again,) = kernel(a, b)
    assert torch.equal(again, out)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_fold_is_planar_in_words_and_unfold_inverts_it(bits):
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 64), generator=gen)
    words = fused.fold(codes, bits)
    per = 32 // bits
    width = 64 // per
    assert words.shape == (3, 64 * bits // 32) and words.dtype == torch.int32
    # word j of a row holds codes j, j + width, ... (lowest lane in the lowest bits), as unsigned
    expected = sum(codes[:, lane * width : (lane + 1) * width] << (lane * bits) for lane in range(per))
    assert torch.equal(words.long() & 0xFFFFFFFF, expected)
    assert torch.equal(fused.unfold(words, bits).long(), codes)
    # on the wire: each word's four bytes, least significant first
    data = fused.words_to_bytes(words)
    assert data.dtype == torch.uint8 and data.numel() == 3 * 64 * bits // 8
    assert [int(b) for b in data[:4]] == [(int(expected[0, 0]) >> (8 * i)) & 0xFF for i in range(4)]
    assert torch.equal(fused.bytes_to_words(data), words.view(-1))
    # a view that starts off a 4-byte boundary is read back as well (copied)
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), data])[1:]
    assert torch.equal(fused.bytes_to_words(shifted), words.view(-1))


def test_hashed_dither_is_uniform_and_keyed():
    positions = torch.arange(1 << 18, dtype=torch.int32)
    u = hashed_dither(positions, *hash_key(0, 1, "a"))
    assert int(u.min()) >= 0 and int(u.max()) < 1 << 16
    # 16 equal bins: counts within 5 standard deviations of the binomial mean
    counts = torch.bincount(u >> 12, minlength=16).double()
    expected = positions.numel() / 16
    assert float((counts - expected).abs().max()) < 5 * (expected * 15 / 16) ** 0.5
    # neighbours uncorrelated, other keys give other streams
    centred = u.double() - u.double().mean()
    assert abs(float((centred[1:] * centred[:-1]).mean() / centred.var())) < 0.01
    other = hashed_dither(positions, *hash_key(0, 2, "a"))
    assert float((u == other).double().mean()) < 0.001
