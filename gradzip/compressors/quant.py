"""Quantizers: a few bits per element plus a few scales.

A ``b``-bit code costs ``b`` bits on the wire: codes are packed per row of ``group``
(``bucket``) elements into 32-bit words, planar when the row length is a multiple of 32 (word
``j`` of a row holds codes ``j, j + W, ...``, sent as its four little-endian bytes, see
:func:`gradzip.compressors.kernels.fused.fold`; TernGrad and natural compression use rows of
:data:`gradzip.compressors.kernels.fused.BLOCK`), and as :func:`gradzip.compressors.kernels.wire.pack_bits` lays them out
otherwise and in a short last row. Arithmetic runs
in fp32 (fp64 for fp64 input, and for fp32 input whose scales sit near the ends of the fp32
range), so no finite input turns into inf or NaN: zeros, denormals, values near the dtype's
largest and a single huge outlier all decode to finite values. Stochastic rounding draws its
dither from :func:`gradzip.compressors.kernels.dither.hashed_dither` (exact to 2**-17 of a
quantization step). The elementwise loops are compiled (:mod:`gradzip.compressors.kernels.fused`);
compiled and eager runs give the same bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: rows of groups handled per step of the encoding loops (about 1 MiB of fp32: stays in cache)
CHUNK = 1 << 18

#: values of ``norm`` for QSGD
NORMS = ("max", "l2")
#: values of ``rounding`` for the uniform quantizer
ROUNDINGS = ("nearest", "stochastic")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 for fp64 input, else fp32 (half-precision arithmetic is slow on CPU and overflows)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def grouped(flat: Tensor, size: int) -> list[tuple[int, Tensor]]:
    """``flat`` as at most two 2-D views: the whole groups ``(n // size, size)`` and the tail.

    Returns:
        ``[(offset, view), ...]``; each view's rows are consecutive groups starting at ``offset``.
    """
    numel = flat.numel()
    whole = numel - numel % size
    parts = []
    if whole:
        parts.append((0, flat[:whole].view(-1, size)))
    if whole < numel:
        parts.append((whole, flat[whole:].view(1, -1)))
    return parts

def check_choice(value: str, *, name: str, allowed: tuple[str, ...]) -> str:
    """Raises: ValueError naming ``name`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def _magnitude_range(values: Tensor) -> tuple[float, float]:
    """``max |v|`` and the smallest nonzero ``|v|`` (1.0 if there is none) of a float tensor,
    NaN for the maximum if any value is NaN. Reductions only: a boolean-mask selection of the
    nonzero values would cost a ``nonzero`` and a gather, several times the reductions."""
    if values.numel() == 0:
        return 0.0, 1.0
    magnitude = values.abs()
    top = float(magnitude.amax())
    bottom = float(torch.where(magnitude > 0, magnitude, torch.inf).amin())
    return top, bottom if bottom < float("inf") else 1.0


def _fits_fp32(scales: Tensor, low: float) -> bool:
    """Whether per-group scales (any float dtype) are safe for fp32 arithmetic: none above a
    quarter of fp32's range, and no nonzero one so small that its reciprocal overflows."""
    top, bottom = _magnitude_range(scales)
    return top <= torch.finfo(torch.float32).max / 4 and bottom >= low
