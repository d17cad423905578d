"""Wire format: bit packing, index dtypes and byte accounting.

Everything a compressor hands to a collective is a tuple of tensors; the bytes on the wire are
the sum of their ``numel * element_size``. Codes narrower than a byte are packed here so that a
1-bit method really sends one bit per element.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from gradzip.compressors.kernels.placement import to_device
from gradzip.compressors.values import check_int, shown

PACKABLE_BITS = (1, 2, 4, 8)


def check_bits(bits: int, *, allowed: Iterable[int] = PACKABLE_BITS, name: str = "bits") -> int:
    """Validate a bit width.

    Raises:
        ValueError: if ``bits`` is not one of ``allowed``.
    """
    allowed = tuple(allowed)
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}; got {shown(bits)}")
    return bits


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits occupy once packed: ``ceil(numel * bits / 8)``."""
    check_bits(bits)
    return (numel * bits + 7) // 8


#: the integer dtype holding the codes of one packed byte (8 // bits bytes of one code each)
_LANE_WORD = {1: torch.int64, 2: torch.int32, 4: torch.int16}


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack integer codes of ``bits`` bits each into bytes, little end first.

    Code ``i`` lands in byte ``i // (8 // bits)`` at bit ``(i % (8 // bits)) * bits``.

    Args:
        codes: any shape, integer or bool dtype, every value in ``[0, 2**bits)``. Flattened.
        bits: 1, 2, 4 or 8.

    Returns:
        uint8 tensor of shape ``(ceil(numel * bits / 8),)`` on the device of ``codes``.

    Raises:
        ValueError: if ``bits`` is not 1, 2, 4 or 8.
    """
    check_bits(bits)
    flat = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return flat.clone() if flat.data_ptr() == codes.data_ptr() else flat
    per_byte = 8 // bits
    pad = (-flat.numel()) % per_byte
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    elif flat.storage_offset() % per_byte:
        flat = flat.clone()
    # The codes of one output byte sit in one word, a byte each; folding the word onto itself
    # (shift by 8 - bits, then twice that, ...) gathers them into its low byte in a few
    # whole-tensor integer ops instead of one op per lane.
    word = flat.view(_LANE_WORD[bits])
    shift = 8 - bits
    for _ in range(per_byte.bit_length() - 1):
        word = word | (word >> shift)
        shift *= 2
    return (word & 0xFF).to(torch.uint8)


def _unpack_table(bits: int, lut: tuple[int, ...] | None, device: torch.device) -> Tensor:
    """For every byte value, the word whose bytes are its ``8 // bits`` codes (mapped by ``lut``)."""
    key = (bits, lut, str(device))
    table = _UNPACK_TABLES.get(key)
    if table is None:
        byte = torch.arange(256, dtype=torch.int64)
        lanes = torch.stack([(byte >> (lane * bits)) & ((1 << bits) - 1) for lane in range(8 // bits)], 1)
        if lut is not None:
            lanes = torch.tensor(lut, dtype=torch.int64)[lanes]
        table = to_device(lanes.to(torch.uint8).contiguous().view(_LANE_WORD[bits]).reshape(-1), device)
        _UNPACK_TABLES[key] = table
    return table


#: unpacking tables by (bits, lut, device); a few hundred bytes each, built once
_UNPACK_TABLES: dict[tuple, Tensor] = {}


def unpack_bits(packed: Tensor, bits: int, numel: int, *, lut: Tensor | None = None) -> Tensor:
    """Inverse of :func:`pack_bits`.

    Args:
        packed: uint8 tensor of shape ``(ceil(numel * bits / 8),)`` (longer is allowed).
        bits: 1, 2, 4 or 8.
        numel: how many codes to return.
        lut: optional int8 or uint8 tensor of shape ``(2**bits,)``: return ``lut[code]``
            instead of the code, in the same pass (bits 1, 2 and 4).

    Returns:
        tensor of shape ``(numel,)``: uint8 codes in ``[0, 2**bits)``, or ``lut``'s values and
        dtype.

    Raises:
        ValueError: if ``bits`` is not supported or ``packed`` is too short for ``numel``.
    """
    check_bits(bits)
    if packed.numel() < packed_nbytes(numel, bits):
        raise ValueError(
            f"packed holds {packed.numel()} bytes, fewer than the {packed_nbytes(numel, bits)} "
            f"needed for numel={numel} at bits={bits}"
        )
    if bits == 8:
        codes = packed.reshape(-1)[:numel]
        return codes if lut is None else lut[codes.long()]
    # One table lookup per byte (a 256-entry table of words) expands all its codes at once.
    packed = packed.reshape(-1)[: packed_nbytes(numel, bits)]
    table = _unpack_table(bits, None if lut is None else tuple(lut.tolist()), packed.device)
    out_dtype = torch.uint8 if lut is None else lut.dtype
    return torch.index_select(table, 0, packed.long()).view(out_dtype)[:numel]


def unpack_lookup(packed: Tensor, bits: int, numel: int, values: Tensor) -> Tensor:
    """``values[code]`` for every code of :func:`pack_bits`, in one gather.

    A ``(256, 8 // bits)`` table maps each packed byte straight to the values of its codes, so
    decoding writes each output element once.

    Args:
        packed: uint8 tensor of shape ``(ceil(numel * bits / 8),)`` (longer is allowed).
        bits: 1, 2, 4 or 8.
        numel: how many codes to decode.
        values: ``(2**bits,)`` tensor of any dtype: the value of each code.

    Returns:
        tensor of shape ``(numel,)``, ``values``' dtype and device (contiguous).

    Raises:
        ValueError: if ``bits`` is not supported, ``values`` has the wrong length or
            ``packed`` is too short.
    """
    check_bits(bits)
    if values.numel() != 1 << bits:
        raise ValueError(f"values must hold 2**bits = {1 << bits} entries; got {values.numel()}")
    if packed.numel() < packed_nbytes(numel, bits):
        raise ValueError(
            f"packed holds {packed.numel()} bytes, fewer than the {packed_nbytes(numel, bits)} "
            f"needed for numel={numel} at bits={bits}"
        )
    byte = torch.arange(256, device=values.device)
    codes = torch.stack([(byte >> (lane * bits)) & ((1 << bits) - 1) for lane in range(8 // bits)], 1)
    table = values.reshape(-1)[codes]
    rows = packed.reshape(-1)[: packed_nbytes(numel, bits)].long()
    return torch.index_select(table, 0, rows).view(-1)[:numel]


def index_bits(numel: int) -> int:
    """Bits of one index into ``numel`` elements when packed: ``max(1, ceil(log2(numel)))``."""
    return max(1, (numel - 1).bit_length())


def pack_uint(codes: Tensor, bits: int) -> Tensor:
    """Pack integer codes of any width ``bits`` (1 to 62) into ``ceil(numel * bits / 8)`` bytes:
    code ``i``'s bit ``j`` is bit ``i * bits + j`` of the stream, little end first (for the 1,
    2, 4 and 8 bit widths :func:`pack_bits` lays them out the same, faster).

    Args:
        codes: any shape (flattened; empty gives no bytes), integer or bool dtype, every value
            in ``[0, 2**bits)``. Not checked, as for :func:`pack_bits` (a check would read the
            device on the host at every call): a code outside keeps only its low ``bits`` bits
            (-1 comes back as ``2**bits - 1``).
        bits: 1 to 62.

    Returns:
        uint8 tensor of shape ``(ceil(numel * bits / 8),)`` on the device of ``codes``.

    Raises:
        ValueError: if ``bits`` is outside [1, 62], or ``codes`` is not of an integer or bool
            dtype (a float code would be truncated silently).
    """
    check_int(bits, name="bits", low=1, high=62)
    if codes.is_floating_point() or codes.is_complex():
        raise ValueError(f"codes must be of an integer or bool dtype; got {codes.dtype}")
    planes = (codes.reshape(-1, 1).long() >> torch.arange(bits, device=codes.device)) & 1
    return pack_bits(planes, 1)


def unpack_uint(packed: Tensor, bits: int, numel: int) -> Tensor:
    """Inverse of :func:`pack_uint`.

    Args:
        packed: uint8 tensor of shape ``(ceil(numel * bits / 8),)`` (longer is allowed).
        bits: 1 to 62, as packed.
        numel: how many codes to return (>= 0).

    Returns:
        int64 tensor of shape ``(numel,)``, codes in ``[0, 2**bits)``, on ``packed``'s device.

    Raises:
        ValueError: if ``bits`` is outside [1, 62], ``numel`` is not an integer >= 0, or
            ``packed`` is not uint8 or too short for ``numel``.
    """
    check_int(bits, name="bits", low=1, high=62)
    check_int(numel, name="numel", low=0)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be a uint8 tensor; got {packed.dtype}")
    # checked here: unpack_bits below would name its own 1-bit count, not these
    needed = (numel * bits + 7) // 8
    if packed.numel() < needed:
        raise ValueError(f"packed holds {packed.numel()} bytes, fewer than the {needed} needed for numel={numel} at bits={bits}")
    planes = unpack_bits(packed, 1, numel * bits).long().view(numel, bits)
    return (planes << torch.arange(bits, device=packed.device)).sum(1)


def index_dtype(numel: int) -> torch.dtype:
    """The narrowest integer dtype that holds every index ``0 .. numel - 1``.

    uint8 up to 256 elements, int16 up to 2**15, int32 up to 2**31, else int64. (int16 rather
    than uint16 because the collectives of ``torch.distributed`` do not all accept uint16.)
    """
    if numel <= 1 << 8:
        return torch.uint8
    if numel <= 1 << 15:
        return torch.int16
    if numel <= 1 << 31:
        return torch.int32
    return torch.int64


def index_nbytes(numel: int) -> int:
    """Bytes of one index into a tensor of ``numel`` elements, see :func:`index_dtype`."""
    return torch.empty((), dtype=index_dtype(numel)).element_size()


def dtype_nbytes(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def nbytes(tensors: Iterable[Tensor]) -> int:
    """Bytes that ``tensors`` occupy on the wire: the sum of ``numel * element_size``."""
    return sum(t.numel() * t.element_size() for t in tensors)


def to_bytes(tensors: Iterable[Tensor]) -> Tensor:
    """Concatenate tensors into one flat uint8 buffer (their raw bytes), for one collective."""
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(parts)


def from_bytes(buffer: Tensor, like: Iterable[Tensor]) -> tuple[Tensor, ...]:
    """Split a uint8 buffer made by :func:`to_bytes` back into tensors shaped as ``like``."""
    out = []
    offset = 0
    for t in like:
        size = t.numel() * t.element_size()
        chunk = buffer[offset : offset + size]
        if chunk.storage_offset() % t.element_size():
            # A dtype view needs an aligned start; copy the few misaligned payload parts.
            chunk = chunk.clone()
        out.append(chunk.view(t.dtype).reshape(t.shape))
        offset += size
    assert offset == buffer.numel(), "buffer length does not match the payload layout"
    return tuple(out)
