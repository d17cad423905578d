"""Sums in one defined order, so that every path gives the same bits.

A scale computed from a sum is sent on the wire (TernGrad's clipping bound from the standard
deviation, signSGD's mean magnitude). torch adds in an order that depends on the kernel, the
vector width and the thread count, and the same values added in another order differ in their
last bits, so the native loops and torch would send different scales now and then. Here the
order is part of the definition: the values in fp64 (the squares of fp32, fp16 and bf16 values
are exact there; or in fp32, where a sum's last digits do not matter), in rows of :data:`ROW` elements (the last padded with zeros), each row summed
pairwise in halves (element ``i`` plus element ``i + h`` for ``h = ROW / 2, ROW / 4, ..., 1``),
then the row sums the same way, padded with zeros to a power of two. torch computes it with
elementwise adds of halves (the same on every device); the native loop
(:func:`gradzip.compressors.kernels.native.row_sums`) does each row in cache, and the row sums are
added here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradzip.compressors.kernels import native
from gradzip.compressors.kernels.fused import BLOCK

#: elements per row of the pairwise sum (a power of two)
ROW = BLOCK
#: what is summed: the values, their magnitudes, their squares
KINDS = ("plain", "abs", "square")


def row_sums(flat: Tensor, kind: str, wide: torch.dtype = torch.float64) -> Tensor:
    """The pairwise sum of each row of :data:`ROW` elements of ``flat`` (1-D, any float dtype;
    the last row padded with zeros) in ``wide`` (fp64, or fp32 where a sum's last digits do
    not matter), as ``(ceil(n / ROW),)``."""
    assert kind in KINDS
    numel = flat.numel()
    rows = -(-numel // ROW)
    wide = flat.to(wide)
    if kind == "abs":
        wide = wide.abs()
    elif kind == "square":
        wide = wide * wide
    if rows * ROW != numel:
        wide = torch.cat([wide, wide.new_zeros(rows * ROW - numel)])
    table = wide.view(rows, ROW)
    half = ROW
    while half > 1:
        half //= 2
        table = table[:, :half] + table[:, half : 2 * half]
    return table[:, 0]


def total(sums: Tensor) -> float:
    """The pairwise sum of row sums (in their dtype), padded with zeros to a power of two."""
    return float(total_tensor(sums))


def total_tensor(sums: Tensor) -> Tensor:
    """:func:`total` as a 0-d tensor on the sums' device (nothing read on the host)."""
    count = sums.numel()
    if count == 0:
        return sums.new_zeros(())
    width = 1 << (count - 1).bit_length()
    if width != count:
        sums = torch.cat([sums, sums.new_zeros(width - count)])
    while sums.numel() > 1:
        half = sums.numel() // 2
        sums = sums[:half] + sums[half:]
    return sums[0]


def ordered_sums(flat: Tensor, kinds: tuple[str, ...], wide: torch.dtype = torch.float64) -> list[float]:
    """The sums of ``flat`` (1-D) of each kind in :data:`KINDS`, in the defined order and
    precision: the whole rows of fp32 CPU tensors by the native loop (one read for all kinds),
    the rest in torch."""
    numel = flat.numel()
    whole = numel - numel % ROW
    found = native.row_sums(flat[:whole], ROW, kinds, wide) if whole else None
    if found is None:
        return [total(row_sums(flat, kind, wide)) for kind in kinds]
    return [total_with_tail(rows, flat[whole:], kind, wide) for rows, kind in zip(found, kinds, strict=True)]


def total_with_tail(rows: Tensor, tail: Tensor, kind: str, wide: torch.dtype = torch.float64) -> float:
    """The total of the row sums of a tensor's whole rows (from the native loop) followed by
    its ``tail`` (fewer than :data:`ROW` elements, summed here)."""
    return total(torch.cat([rows, row_sums(tail, kind, wide)]) if tail.numel() else rows)
