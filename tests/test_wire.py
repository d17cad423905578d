"""The wire format: bit packing at 1, 2, 4 and 8 bits, lookups, index dtypes, byte buffers."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.compressors.kernels import wire
from gradzip.compressors.kernels.elementwise import pack_codes, sparse_flatnonzero, unpack_codes


def reference_pack(codes: list[int], bits: int) -> list[int]:
    """Code i at bit (i % (8 // bits)) * bits of byte i // (8 // bits), written out by hand."""
    per_byte = 8 // bits
    out = [0] * (-(-len(codes) // per_byte))
    for i, code in enumerate(codes):
        out[i // per_byte] |= code << ((i % per_byte) * bits)
    return out


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([1, 2, 4, 8]), data=st.data())
def test_pack_matches_hand_layout_and_unpacks_back(bits, data):
    codes = data.draw(st.lists(st.integers(0, (1 << bits) - 1), max_size=300))
    tensor = torch.tensor(codes, dtype=torch.uint8)
    packed = wire.pack_bits(tensor, bits)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == reference_pack(codes, bits)
    assert packed.numel() == wire.packed_nbytes(len(codes), bits)
    assert wire.unpack_bits(packed, bits, len(codes)).tolist() == codes


def test_every_byte_pattern_round_trips_at_every_width():
    for bits in (1, 2, 4):
        per_byte = 8 // bits
        byte = torch.arange(256)
        codes = torch.stack([(byte >> (lane * bits)) & ((1 << bits) - 1) for lane in range(per_byte)], 1).reshape(-1)
        assert torch.equal(wire.pack_bits(codes.to(torch.uint8), bits), byte.to(torch.uint8))
        assert torch.equal(wire.unpack_bits(byte.to(torch.uint8), bits, codes.numel()), codes.to(torch.uint8))


def test_pack_accepts_bool_and_misaligned_slices():
    flags = torch.rand(1001, generator=torch.Generator().manual_seed(0)) > 0.5
    assert torch.equal(wire.pack_bits(flags, 1), wire.pack_bits(flags.to(torch.uint8), 1))
    codes = torch.randint(0, 4, (40,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(wire.pack_bits(codes[3:], 2), wire.pack_bits(codes[3:].clone(), 2))


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([1, 2, 4, 8]), data=st.data())
def test_fast_code_packing_gives_the_wire_bytes(bits, data):
    codes = torch.tensor(data.draw(st.lists(st.integers(0, (1 << bits) - 1), max_size=200)), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert torch.equal(packed, wire.pack_bits(codes, bits))
    assert torch.equal(unpack_codes(packed, bits, codes.numel()), codes)


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([1, 2, 4, 8]), data=st.data())
def test_unpack_lookup_and_lut_map_codes(bits, data):
    codes = data.draw(st.lists(st.integers(0, (1 << bits) - 1), max_size=100))
    packed = wire.pack_bits(torch.tensor(codes, dtype=torch.uint8), bits)
    values = torch.linspace(-1.5, 2.5, 1 << bits, dtype=torch.float64)
    assert wire.unpack_lookup(packed, bits, len(codes), values).tolist() == [values[c].item() for c in codes]
    lut = torch.arange(1 << bits, dtype=torch.int16).sub(1 << (bits - 1)).to(torch.int8)
    mapped = wire.unpack_bits(packed, bits, len(codes), lut=lut)
    assert mapped.dtype == torch.int8 and mapped.tolist() == [lut[c].item() for c in codes]


def test_bad_widths_and_short_buffers_raise():
    with pytest.raises(ValueError, match="bits must be one of 1, 2, 4, 8"):
        wire.pack_bits(torch.zeros(4, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="bits"):
        wire.unpack_bits(torch.zeros(4, dtype=torch.uint8), 0, 4)
    with pytest.raises(ValueError, match="fewer than"):
        wire.unpack_bits(torch.zeros(1, dtype=torch.uint8), 2, 5)
    with pytest.raises(ValueError, match="2\\*\\*bits"):
        wire.unpack_lookup(torch.zeros(1, dtype=torch.uint8), 2, 4, torch.zeros(3))


def test_index_dtype_is_the_narrowest_that_holds_numel_minus_one():
    assert wire.index_dtype(256) == torch.uint8
    assert wire.index_dtype(257) == torch.int16
    assert wire.index_dtype(1 << 15) == torch.int16
    assert wire.index_dtype((1 << 15) + 1) == torch.int32
    assert wire.index_dtype(1 << 31) == torch.int32
    assert wire.index_dtype((1 << 31) + 1) == torch.int64
    for numel in (256, 1 << 15, 1 << 31):
        assert torch.iinfo(wire.index_dtype(numel)).max >= numel - 1


def test_byte_buffer_round_trips_mixed_dtypes():
    parts = (torch.arange(5, dtype=torch.uint8), torch.randn(3, dtype=torch.float64), torch.tensor([7], dtype=torch.int16))
    buffer = wire.to_bytes(parts)
    assert buffer.numel() == wire.nbytes(parts) == 5 + 24 + 2
    for got, want in zip(wire.from_bytes(buffer, parts), parts):
        assert torch.equal(got, want)


@settings(max_examples=40, deadline=None)
@given(numel=st.integers(0, 5000), density=st.sampled_from([0.0, 0.002, 0.02, 0.5, 1.0]), seed=st.integers(0, 2**16))
def test_sparse_flatnonzero_lists_the_true_positions_in_order(numel, density, seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(numel, generator=gen) < density
    expected = [i for i, flag in enumerate(mask.tolist()) if flag]
    assert sparse_flatnonzero(mask).tolist() == expected
    assert sparse_flatnonzero(mask.to(torch.uint8)).dtype == torch.int64
    assert sparse_flatnonzero(mask.to(torch.uint8)).tolist() == expected


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 62), data=st.data())
def test_pack_uint_any_width_roundtrips_in_exactly_ceil_bits_over_8_bytes(bits, data):
    codes = data.draw(st.lists(st.integers(0, 2**bits - 1), min_size=0, max_size=40))
    x = torch.tensor(codes, dtype=torch.int64)
    packed = wire.pack_uint(x, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == (len(codes) * bits + 7) // 8
    assert torch.equal(wire.unpack_uint(packed, bits, len(codes)), x)
    # the stream, read bit by bit independently: code i's bit j is stream bit i * bits + j
    stream = [(int(packed[b // 8]) >> (b % 8)) & 1 for b in range(len(codes) * bits)]
    assert all(stream[i * bits + j] == (c >> j) & 1 for i, c in enumerate(codes) for j in range(bits))


@pytest.mark.parametrize("numel, bits", [(1, 1), (2, 1), (3, 2), (64, 6), (65, 7), (4096, 12), (4097, 13)])
def test_index_bits_is_the_width_of_the_largest_index(numel, bits):
    assert wire.index_bits(numel) == bits


@pytest.mark.parametrize("bits", [0, 63, True, 2.0])
def test_pack_uint_refuses_a_width_outside_1_to_62(bits):
    with pytest.raises(ValueError, match="bits must be an integer in"):
        wire.pack_uint(torch.zeros(3, dtype=torch.int64), bits)
