"""Hostile inputs to DeMo's ``compact=True`` encoding (bfloat16 values, packed positions) and to
the packing helpers under it, each found to break once: a finite momentum past bfloat16's range
travelled as inf and every rank skipped every step; an fp16 momentum near 65504 rounded up to
65536 in bfloat16 and came back inf, poisoning the momentum; an fp16 sum over ranks overflowed to
NaN, whose sign 0 silently dropped the update; unpack_uint named the wrong sizes or none."""

from __future__ import annotations

import math

import pytest
import torch

from gradzip.compressors.kernels import wire
from gradzip.lab.cli import main
from gradzip.optim import DeMo, dct
from gradzip.optim.demo import compact_limit
from gradzip.testing import run_ranks

BF16_MAX = torch.finfo(torch.bfloat16).max


# ----- saturation at bfloat16's range ----------------------------------------------------------


def test_compact_limit_is_the_largest_bfloat16_value_the_dtype_holds():
    # bfloat16 has 8 significant bits: below 2**16 its largest values are 255 * 2**8 = 65280,
    # then 2**16 (past fp16's 65504); at the top of its range, (2 - 2**-7) * 2**127
    assert compact_limit(torch.float16) == 255 * 2**8
    assert torch.tensor(65504.0).bfloat16().item() == 2**16
    top = (2 - 2**-7) * 2.0**127
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        assert compact_limit(dtype) == top == BF16_MAX


def _one_value_chunks(dtype, grad, steps: int = 3, compact: bool = True):
    """A 1-D parameter in chunks of one element (each value its own DCT coefficient, exactly),
    every value kept, no momentum decay, lr 1: ``(skipped per step, parameter, momentum)``."""
    p = torch.nn.Parameter(torch.zeros(len(grad), dtype=dtype))
    opt = DeMo([p], lr=1.0, compression_decay=0.0, compression_topk=1, compression_chunk=1, compact=compact)
    skipped = []
    for _ in range(steps):
        p.grad = torch.tensor(grad, dtype=dtype)
        opt.step()
        skipped.append(opt.last_step_skipped)
    return skipped, p.detach(), opt.state[p].get("delta")


@pytest.mark.parametrize("dtype, big", [(torch.float32, 3.4e38), (torch.float64, 1e300), (torch.float16, 65504.0)],
                         ids=["fp32", "fp64", "fp16"])
def test_a_finite_momentum_past_bfloat16s_range_saturates_instead_of_skipping_or_poisoning(dtype, big):
    # fp32 and fp64: 3.4e38 and 1e300 were inf in bfloat16, so every step was skipped on every
    # rank, forever (the momentum never changed). fp16: 65504 rounded to 65536, inf back in fp16:
    # the momentum turned inf (that step taken), then every later step was skipped.
    skipped, p, delta = _one_value_chunks(dtype, [big, -big, 1.0, 0.0])
    assert skipped == [False, False, False]
    assert p.tolist() == [-3.0, 3.0, -3.0, 0.0]  # three sign steps of lr 1 against the gradient
    limit = compact_limit(dtype)
    # the saturated part is fed back: what is left is the value less the limit (decay 0)
    expected = torch.tensor([big, -big, 1.0, 0.0], dtype=dtype) - torch.tensor([limit, -limit, 1.0, 0.0], dtype=dtype)
    assert torch.isfinite(delta).all() and torch.equal(delta, expected)


def test_the_reference_encoding_never_saturated_and_still_does_not():
    skipped, p, delta = _one_value_chunks(torch.float32, [3.4e38, -3.4e38], compact=False)
    assert skipped == [False] * 3 and p.tolist() == [-3.0, 3.0] and torch.equal(delta, torch.zeros(2))


def test_a_tiny_momentum_that_underflows_bfloat16_is_kept_not_lost():
    # 1e-41 is an fp32 subnormal below bfloat16's smallest (about 9.2e-41): it travels as 0, no
    # step is taken there, and the momentum keeps all of it (what was sent, 0, is subtracted)
    skipped, p, delta = _one_value_chunks(torch.float32, [1e-41, 1.0], steps=1)
    assert torch.tensor(1e-41).bfloat16().item() == 0.0
    assert skipped == [False] and p.tolist() == [0.0, -1.0]
    assert torch.equal(delta, torch.tensor([1e-41, 0.0]))


# ----- real ranks ------------------------------------------------------------------------------


def _fp16_sum(rank: int, world_size: int, compact: bool) -> dict:
    """A 2-element fp16 parameter in one chunk, both coefficients kept, the same gradient on every
    rank: coefficients (60000 +- 10000) / sqrt(2), 49497 and 35355; their sum over the ranks
    passes 65504."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    opt = DeMo([p], lr=1.0, compression_decay=0.0, compression_topk=2, compression_chunk=2, compact=compact)
    p.grad = torch.tensor([60000.0, 10000.0], dtype=torch.float16)
    opt.step()
    return {"skipped": opt.last_step_skipped, "p": p.detach().clone()}


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "reference-wire"])
def test_an_fp16_sum_over_ranks_that_overflows_fp16_still_steps_every_element(compact):
    # The mean is 60000 and 10000 back: a sign step of -1 on both. Summed in fp16 both sums were
    # inf, the inverse transform inf - inf = NaN at the second element, and sign(NaN) = 0: that
    # element silently did not move.
    coeffs = dct.encode(torch.tensor([60000.0, 10000.0], dtype=torch.float64), 2)
    assert (2 * coeffs.abs() > torch.finfo(torch.float16).max).all()
    for r in run_ranks(_fp16_sum, 2, compact):
        assert not r["skipped"]
        assert r["p"].tolist() == [-1.0, -1.0]


SHAPES = [(), (1,), (3, 5, 7), (4, 3, 3, 3), (97,), (128, 128), (6, 1)]
CHUNK, TOPK, STEPS = 128, 5, 4
SOMETIMES = 4  # SHAPES[4] has a gradient on even steps only


def _grads(shapes, rank: int, step: int, dtype=torch.float32) -> list:
    gen = torch.Generator().manual_seed(7919 * rank + step)
    return [torch.randn(s, generator=gen).to(dtype) if j != SOMETIMES or step % 2 == 0 else None
            for j, s in enumerate(shapes)]


def _odd_shapes(rank: int, world_size: int, dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    opt = DeMo(params, lr=1e-2, compression_decay=0.9, compression_topk=TOPK, compression_chunk=CHUNK, compact=True)
    out: dict = {"bytes": []}
    for step in range(STEPS):
        opt.zero_grad()
        for p, g in zip(params, _grads(SHAPES, rank, step, dtype)):
            p.grad = g
        predicted = opt.payload_nbytes()
        opt.step()
        popped = opt.metrics.pop()
        out["bytes"].append((predicted, popped["payload_bytes"] if world_size > 1 else None, opt.last_step_skipped))
    out["params"] = [p.detach().clone() for p in params]
    return out


def _expected_bytes(step: int) -> int:
    """Written out per shape at chunk 128, top-k 5: (chunks, chunk numel) -> k * chunks values of
    2 bytes and as many positions of ceil(log2(chunk numel)) bits."""
    layouts = [(1, 1), (1, 1), (1, 3 * 35), (1, 4 * 27), (1, 97), (1, 128 * 128), (1, 6)]
    bits = [1, 1, 7, 7, 7, 14, 3]
    total = 0
    for j, ((chunks, numel), b) in enumerate(zip(layouts, bits)):
        if j == SOMETIMES and step % 2:
            continue
        kept = chunks * min(TOPK, numel)
        total += 2 * kept + math.ceil(kept * b / 8)
    return total


@torch.no_grad()
def _reference(world_size: int) -> list:
    """The algorithm written out for fp32 parameters: each rank's momentum, top-k of its DCT per
    chunk, values rounded to bfloat16 (all well inside its range here) and subtracted, the mean
    over senders per position, the sign step."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    deltas = [[torch.zeros_like(p) for p in params] for _ in range(world_size)]
    for step in range(STEPS):
        grads = [_grads(SHAPES, rank, step) for rank in range(world_size)]
        for j, p in enumerate(params):
            if grads[0][j] is None:
                continue
            sums = counts = 0
            for rank in range(world_size):
                delta = deltas[rank][j].mul(0.9).add_(grads[rank][j], alpha=1e-2)
                coeffs = dct.encode(delta, CHUNK)
                idx = torch.topk(coeffs.abs(), min(TOPK, coeffs.shape[1]), dim=-1, sorted=False).indices
                val = torch.gather(coeffs, -1, idx).bfloat16().float()
                kept = torch.zeros_like(coeffs).scatter_(-1, idx, val)
                deltas[rank][j] = delta - dct.decode(kept, p.shape, CHUNK)
                sums = sums + kept
                counts = counts + torch.zeros_like(coeffs).scatter_(-1, idx, 1.0)
            p.add_(dct.decode(sums / counts.clamp(min=1), p.shape, CHUNK).sign(), alpha=-1e-2)
    return params


def test_odd_shapes_partial_gradients_and_14_bit_positions_on_3_ranks_match_the_reference():
    results = run_ranks(_odd_shapes, 3, torch.float32)
    reference = _reference(3)
    for r in results:
        for step, (predicted, popped, skipped) in enumerate(r["bytes"]):
            assert predicted == popped == _expected_bytes(step) and not skipped
        for a, b in zip(r["params"], reference):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # sums over ranks may round apart
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0]["params"], r["params"]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_parameters_send_the_formulas_bytes_and_stay_identical_across_ranks(dtype):
    results = run_ranks(_odd_shapes, 2, dtype)
    for r in results:
        assert r["bytes"] == [(_expected_bytes(s), _expected_bytes(s), False) for s in range(STEPS)]
        assert all(p.dtype == dtype and torch.isfinite(p).all() for p in r["params"])
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))


def test_odd_shapes_at_world_size_one_match_the_reference():
    r = _odd_shapes(0, 1, torch.float32)
    assert [s for _, _, s in r["bytes"]] == [False] * STEPS
    for a, b in zip(r["params"], _reference(1)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# ----- the packing helpers ---------------------------------------------------------------------


@pytest.mark.parametrize("bits", [13, 16, 18])
def test_wide_positions_roundtrip_at_their_exact_byte_count(bits):
    codes = torch.tensor([0, (1 << bits) - 1, 1 << (bits - 1), 12345 % (1 << bits), 1])
    packed = wire.pack_uint(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(5 * bits / 8)
    # bit i * bits + j of the stream is code i's bit j, little end first
    stream = [(int(c) >> j) & 1 for c in codes for j in range(bits)]
    assert [(int(packed[k // 8]) >> (k % 8)) & 1 for k in range(len(stream))] == stream
    assert torch.equal(wire.unpack_uint(packed, bits, 5), codes)


def test_pack_uint_takes_empty_and_non_contiguous_codes():
    empty = wire.pack_uint(torch.empty(0, dtype=torch.int64), 12)
    assert empty.dtype == torch.uint8 and empty.numel() == 0
    assert wire.unpack_uint(empty, 12, 0).shape == (0,)
    codes = torch.arange(24).view(4, 6).t()  # not contiguous: packed in its row-major order
    assert torch.equal(wire.pack_uint(codes, 5), wire.pack_uint(codes.contiguous(), 5))
    assert torch.equal(wire.unpack_uint(wire.pack_uint(codes, 5), 5, 24), codes.reshape(-1))


def test_codes_outside_the_width_keep_their_low_bits_as_documented():
    # a precondition, not checked (as for pack_bits): -1 and -3 are ...1111 and ...1101
    assert wire.unpack_uint(wire.pack_uint(torch.tensor([-1, -3, 16, 17]), 4), 4, 4).tolist() == [15, 13, 0, 1]


def test_pack_uint_refuses_float_codes_it_would_truncate():
    with pytest.raises(ValueError, match="codes must be of an integer or bool dtype; got torch.float32"):
        wire.pack_uint(torch.tensor([2.7, 7.0]), 4)
    assert wire.unpack_uint(wire.pack_uint(torch.tensor([True, False]), 1), 1, 2).tolist() == [1, 0]


@pytest.mark.parametrize("numel", [-1, 2.0, True])
def test_unpack_uint_refuses_a_numel_that_is_not_a_count(numel):
    with pytest.raises(ValueError, match="numel must be an integer >= 0"):
        wire.unpack_uint(torch.zeros(4, dtype=torch.uint8), 4, numel)


def test_unpack_uint_names_its_own_sizes_when_packed_is_short():
    # 3 codes of 4 bits need 2 bytes; the message named the 12 one-bit codes underneath
    with pytest.raises(ValueError, match=r"holds 1 bytes, fewer than the 2 needed for numel=3 at bits=4"):
        wire.unpack_uint(torch.zeros(1, dtype=torch.uint8), 4, 3)


def test_unpack_uint_refuses_packed_bytes_that_are_not_uint8():
    with pytest.raises(ValueError, match="packed must be a uint8 tensor; got torch.int8"):
        wire.unpack_uint(torch.full((4,), -1, dtype=torch.int8), 4, 3)


# ----- the command line ------------------------------------------------------------------------


def test_a_compact_flag_that_is_not_a_boolean_is_one_line_and_exit_code_2(capsys, tmp_path):
    argv = ["train", "--optimizer", "demo:compact=maybe", "--compressor", "none", "--out", str(tmp_path / "x")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "compact must be True or False; got 'maybe'" in err
    assert err.count("\n") == 1 and "Traceback" not in err
