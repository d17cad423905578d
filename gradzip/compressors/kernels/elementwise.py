"""Elementwise primitives that the codecs' hot loops use, fast on CPU.

On CPU, torch runs comparisons into bool tensors and float-to-uint8 casts about ten times
slower than one arithmetic pass (about 2.5 ns against 0.3 ns per element, single thread); NumPy's
vectorised loops do them at arithmetic speed. Each function here takes and returns torch
tensors, goes through NumPy views (no copies) for CPU tensors of the dtypes NumPy has, and
through torch everywhere else (other devices, bfloat16).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from gradzip.compressors.kernels import wire

_NUMPY_DTYPES = (
    torch.float16, torch.float32, torch.float64, torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64
)


def numpy_ok(*tensors: Tensor) -> bool:
    """Whether every tensor is a CPU tensor of a dtype NumPy shares memory with."""
    return all(t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES and not t.requires_grad for t in tensors)


def greater_equal(src: Tensor, value: float, out: Tensor) -> Tensor:
    """``out = src >= value`` (bool ``out`` of ``src``'s shape); returns ``out``."""
    if numpy_ok(src, out) and src.is_contiguous() and out.is_contiguous():
        np.greater_equal(src.numpy(), src.numpy().dtype.type(value), out=out.numpy())
        return out
    return torch.ge(src, value, out=out)


def less(src: Tensor, value: float | Tensor) -> Tensor:
    """``src < value`` (a number, or a tensor of ``src``'s shape) as a new bool tensor."""
    if isinstance(value, Tensor):
        if numpy_ok(src, value) and src.is_contiguous() and value.is_contiguous():
            return torch.from_numpy(np.less(src.numpy(), value.numpy()))
        return src < value
    if numpy_ok(src) and src.is_contiguous():
        return torch.from_numpy(np.less(src.numpy(), src.numpy().dtype.type(value)))
    return src < value


def flatnonzero(mask: Tensor) -> Tensor:
    """Positions (int64, ascending) of the true (nonzero) elements of a 1-D bool or uint8
    tensor (NumPy's counting nonzero on CPU, about 4x faster than torch's)."""
    if numpy_ok(mask) and mask.is_contiguous():
        return torch.from_numpy(np.flatnonzero(mask.numpy()).astype(np.int64, copy=False))
    return mask.nonzero().view(-1)


def sparse_flatnonzero(mask: Tensor) -> Tensor:
    """:func:`flatnonzero` for a mostly-false 1-D bool or 0/1 uint8 tensor, faster on CPU.

    NumPy's nonzero visits every byte; here the bytes are read as 64-bit words, the nonzero
    words found first (an eighth as many elements), and only those expanded. Where more than a
    quarter of the words hold a true byte it falls back to :func:`flatnonzero`.
    """
    if not (numpy_ok(mask) and mask.is_contiguous() and mask.element_size() == 1):
        return flatnonzero(mask)
    flags = mask.numpy().view(np.bool_)
    whole = flags.size - flags.size % 8
    words = flags[:whole].view(np.uint64)
    hit = np.flatnonzero(words != 0)
    if 4 * hit.size > words.size:
        return flatnonzero(mask)
    found = np.flatnonzero(words[hit].view(np.bool_))
    positions = (hit[found >> 3] << 3) + (found & 7)
    if whole < flags.size:
        positions = np.concatenate([positions, whole + np.flatnonzero(flags[whole:])])
    return torch.from_numpy(positions.astype(np.int64, copy=False))


def top_positions(values: Tensor, k: int) -> Tensor:
    """Positions (int64) of the ``k`` largest entries of a 1-D tensor, in no particular order.

    NumPy's introselect on CPU (linear time); ``torch.topk`` elsewhere.
    """
    if numpy_ok(values) and values.dtype != torch.float16:
        order = np.argpartition(values.numpy(), values.numel() - k)[values.numel() - k :]
        return torch.from_numpy(order.astype(np.int64, copy=False))
    return torch.topk(values, k, sorted=False).indices


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """:func:`gradzip.compressors.kernels.wire.pack_bits` with the same bytes; on CPU through NumPy, which ORs the
    ``8 // bits`` interleaved lanes of the codes (strided views, no index arrays)."""
    if bits == 1 and numpy_ok(codes):
        # packbits takes any nonzero byte as a 1, which codes in [0, 2) are.
        return torch.from_numpy(np.packbits(codes.reshape(-1).contiguous().numpy(), bitorder="little"))
    if bits not in (2, 4) or not numpy_ok(codes):
        return wire.pack_bits(codes, bits)
    flat = codes.reshape(-1).to(torch.uint8).contiguous().numpy()
    per_byte = 8 // bits
    if flat.size % per_byte:
        flat = np.concatenate([flat, np.zeros(per_byte - flat.size % per_byte, np.uint8)])
    packed = flat[0::per_byte].copy()
    for lane in range(1, per_byte):
        packed |= flat[lane::per_byte] << np.uint8(lane * bits)
    return torch.from_numpy(packed)


def unpack_codes(packed: Tensor, bits: int, numel: int) -> Tensor:
    """:func:`gradzip.compressors.kernels.wire.unpack_bits`: uint8 codes of shape ``(numel,)``; on CPU through
    NumPy (``unpackbits`` for 1 bit, strided shifts and masks for 2 and 4)."""
    if bits == 8 or not numpy_ok(packed) or packed.numel() < wire.packed_nbytes(numel, bits):
        return wire.unpack_bits(packed, bits, numel)
    source = packed.reshape(-1).contiguous().numpy()[: wire.packed_nbytes(numel, bits)]
    if bits == 1:
        return torch.from_numpy(np.unpackbits(source, count=numel, bitorder="little"))
    per_byte = 8 // bits
    codes = np.empty(source.size * per_byte, np.uint8)
    mask = np.uint8((1 << bits) - 1)
    for lane in range(per_byte):
        np.bitwise_and(source >> np.uint8(lane * bits), mask, out=codes[lane::per_byte])
    return torch.from_numpy(codes[:numel])
