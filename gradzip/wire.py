"""Wire format: bit packing, index dtypes and byte accounting.

Everything a compressor hands to a collective is a tuple of tensors; the bytes on the wire are
the sum of their ``numel * element_size``. Codes narrower than a byte are packed here so that a
1-bit method really sends one bit per element.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

PACKABLE_BITS = (1, 2, 4, 8)


def check_bits(bits: int, *, allowed: Iterable[int] = PACKABLE_BITS, name: str = "bits") -> int:
    """Validate a bit width.

    Raises:
        ValueError: if ``bits`` is not one of ``allowed``.
    """
    allowed = tuple(allowed)
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}; got {bits!r}")
    return bits


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits occupy once packed: ``ceil(numel * bits / 8)``."""
    check_bits(bits)
    return (numel * bits + 7) // 8


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack integer codes of ``bits`` bits each into bytes, little end first.

    Args:
        codes: any shape, integer dtype, every value in ``[0, 2**bits)``. Flattened.
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
    lanes = flat.view(-1, per_byte)
    packed = lanes[:, 0].clone()
    for lane in range(1, per_byte):
        packed |= lanes[:, lane] << (lane * bits)
    return packed


def unpack_bits(packed: Tensor, bits: int, numel: int) -> Tensor:
    """Inverse of :func:`pack_bits`.

    Args:
        packed: uint8 tensor of shape ``(ceil(numel * bits / 8),)``.
        bits: 1, 2, 4 or 8.
        numel: how many codes to return.

    Returns:
        uint8 tensor of shape ``(numel,)`` with values in ``[0, 2**bits)``.

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
        return packed[:numel]
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    lanes = (packed.view(-1, 1) >> shifts) & mask
    return lanes.reshape(-1)[:numel]


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
