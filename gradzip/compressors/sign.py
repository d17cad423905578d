"""Sign codecs: one bit per element plus one scale.

Both send ``sign(x)``, one bit per element, and the scale ``||x||_1 / n`` (the mean magnitude),
and decode ``scale * sign(x)``. The bits are packed per row of 8192 elements (of ``G`` with
``group=G``) into 32-bit words, planar within the row, as
:func:`gradzip.compressors.kernels.fused.fold` lays them out (rows whose length is not a multiple of
32, and a short last row, as :func:`gradzip.compressors.kernels.wire.pack_bits` does); with ``group=G`` one scale per group of ``G`` consecutive
elements (the mean magnitude of the group) instead of one for the whole tensor. An exact zero (either sign of zero) is sent as +1, since one bit
has room for two signs only: it decodes to ``+scale``. An all-zero tensor has scale 0 and decodes
to exact zeros.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch
from torch import Tensor

from gradzip.compressors import register
from gradzip.compressors.base import Compressor, Payload, check_int, clamped_group
from gradzip.compressors.kernels import native, wire
from gradzip.compressors.kernels.fused import BLOCK, decode_rows, encode_rows, reduce_rows
from gradzip.compressors.kernels.placement import scalar
from gradzip.compressors.kernels.sums import ordered_sums, row_sums, total_tensor, total_with_tail

#: elements summed per step (1 MiB of fp32: stays in cache)
SUM_CHUNK = 1 << 18


def mean_magnitude(flat: Tensor) -> Tensor:
    """``||x||_1 / n`` as a ``(1,)`` tensor in ``flat``'s dtype, 0 for an empty tensor.

    The magnitudes are added in fp64 in the order of :mod:`gradzip.compressors.kernels.sums` (fp16,
    bf16 and fp32 magnitudes cannot overflow it, and the native sign encoder adds them in the
    same order, so both paths send the same scale); a total that overflows fp64 (fp64 values
    near its top) is redone in chunks with each term divided by ``n``. The mean is at most the
    largest magnitude, so it is finite in the input dtype.

    Args:
        flat: 1-D float tensor.
    """
    numel = flat.numel()
    if numel == 0:
        return flat.new_zeros(1)
    if flat.device.type != "cpu":
        return _device_mean_magnitude(flat)
    (total,) = ordered_sums(flat, ("abs",))
    if math.isinf(total):
        # fp64 magnitudes near the top of its range: their sum overflows even in fp64, so each
        # chunk is summed divided by n (a second pass, for such tensors only).
        mean = sum(
            float(flat[start : start + SUM_CHUNK].abs().to(torch.float64).div_(numel).sum())
            for start in range(0, numel, SUM_CHUNK)
        )
        return torch.tensor(mean, dtype=torch.float64).clamp(max=torch.finfo(flat.dtype).max).to(flat.dtype).reshape(1)
    return _mean_of(total, numel, flat.dtype)


def _device_mean_magnitude(flat: Tensor) -> Tensor:
    """:func:`mean_magnitude` with nothing read on the host: the same sum in the same order (so
    the same bits as on the CPU); for fp64 input the sum of magnitudes divided by ``n`` first
    is formed too and taken where the plain one overflows (the CPU adds those chunks in another
    order: equal to rounding)."""
    numel = flat.numel()
    total = total_tensor(row_sums(flat, "abs"))
    # A device tensor as divisor: CUDA divides by a Python number as a multiplication by its
    # reciprocal, which can differ from the CPU's division in the last bit.
    mean = total / scalar(numel, torch.float64, flat.device)
    if flat.dtype == torch.float64:
        divided = total_tensor(row_sums(flat.abs().div_(numel), "plain"))
        mean = torch.where(torch.isinf(total), divided, mean)
    return mean.clamp(max=torch.finfo(flat.dtype).max).to(flat.dtype).reshape(1)


def _mean_of(total: float, numel: int, dtype: torch.dtype) -> Tensor:
    """``total / numel`` (a finite fp64 sum of magnitudes) as a ``(1,)`` tensor in ``dtype``."""
    mean = torch.tensor(total, dtype=torch.float64) / numel
    # Rounding in the sum can put the mean a hair above the largest finite value of a half dtype.
    return mean.clamp(max=torch.finfo(dtype).max).to(dtype).reshape(1)


def group_mean_magnitudes(flat: Tensor, group: int) -> Tensor:
    """The mean magnitude of each group of ``group`` consecutive elements of ``flat`` (the last
    group may be shorter), as ``(ceil(n / group),)`` in ``flat``'s dtype.

    Summed in fp32 (fp64 for fp64 input), redone in fp64 with each term divided by the group's
    size where a group sum overflows; each mean is at most its group's largest magnitude, so it
    is finite in the input dtype.
    """
    if flat.numel() == 0:
        return flat.new_zeros(0)
    wide = torch.float64 if flat.dtype == torch.float64 else torch.float32

    if flat.device.type != "cpu":
        # No finiteness check read on the host: fp64 sums of fp32, fp16 or bf16 magnitudes
        # cannot overflow, and fp64 values are divided first. The sums' order is the device's.
        wide = torch.float64

    def row_means(rows: Tensor) -> tuple[Tensor]:
        if rows.device.type != "cpu":
            if rows.dtype == torch.float64:
                return (rows.abs().div(rows.shape[1]).sum(1),)
            return (rows.abs().sum(1, dtype=wide) / rows.shape[1],)
        mean = rows.abs().sum(1, dtype=wide) / rows.shape[1]
        if not bool(torch.isfinite(mean).all()):
            # Divided before summing: fp64 holds an fp32 sum, but not one of fp64 values near its top.
            mean = rows.abs().to(torch.float64).div_(rows.shape[1]).sum(1)
        return (mean,)

    (mean,) = reduce_rows(row_means, flat, group=group)
    return mean.clamp(max=torch.finfo(flat.dtype).max).to(flat.dtype)


class _ScaledSign(Compressor):
    twophase_cost = (
        "a second 1-bit compression keeps only the signs of each chunk's mean (EF-signSGD on the "
        "demo job, 3 workers: 25.5% above none on two phases, 11.3% on all_gather)"
    )

    def __init__(self, *, group: int = 0) -> None:
        super().__init__(group=group)
        self.group = check_int(group, name="group", low=0)

    def payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """``ceil(n / 8) + itemsize(dtype)``; with ``group=G``, ``ceil(n / 8) + ceil(n / G) *
        itemsize(dtype)``."""
        scales = -(-numel // clamped_group(self.group, numel)) if self.group else 1
        return wire.packed_nbytes(numel, 1) + scales * wire.dtype_nbytes(dtype)

    def compress(self, x: Tensor, *, step: int = 0, key: Hashable = 0) -> Payload:
        """Args: x of any shape and floating dtype. Returns: ``Payload((sign bits, scales))``:
        one scale ``(1,)``, or ``(ceil(n / group),)`` with ``group``."""
        flat = x.reshape(-1)
        numel = flat.numel()
        if numel == 0 or self.group:
            scales = group_mean_magnitudes(flat, self._row(numel)) if self.group else mean_magnitude(flat)
            if numel == 0:
                return Payload((torch.empty(0, dtype=torch.uint8, device=flat.device), scales))
            (signs,) = encode_rows(_nonnegative, (flat,), (), group=self._row(numel), out_bits=(1,))
            return Payload((signs, scales))
        # One scale: the native encoder sums the magnitudes of the rows it packs (one read).
        found: list[Tensor] = []
        fast = native.sign_encoder(found) if flat.dtype == torch.float32 else None
        (signs,) = encode_rows(_nonnegative, (flat,), (), group=BLOCK, out_bits=(1,), native=fast)
        if found:
            tail = flat[numel - numel % BLOCK :]
            return Payload((signs, _mean_of(total_with_tail(found[0], tail, "abs"), numel, flat.dtype)))
        return Payload((signs, mean_magnitude(flat)))

    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        """Returns: ``+scale`` where the bit is 1, ``-scale`` where it is 0, shaped as ``like``.

        Raises:
            ValueError: if the payload holds fewer sign bytes than ``like`` needs.
        """
        packed, scales = payload.tensors
        numel = like.numel()
        if numel == 0:
            return torch.empty_like(like, memory_format=torch.contiguous_format)
        scales = scales.to(like.dtype).reshape(-1)
        params = (scales,) if self.group else (scales.reshape(()),)
        fast = native.sign_decode if like.dtype == torch.float32 and not self.group else None
        values = decode_rows(_signed_scale, ((packed.reshape(-1), 1),), params, group=self._row(numel), numel=numel, native=fast)
        return values.view(like.shape)

    def _row(self, numel: int) -> int:
        """Elements per row of packed bits: a scale's group (no longer than the tensor, so that
        a group larger than it is not padded out), or BLOCK with one scale."""
        return clamped_group(self.group, numel) if self.group else BLOCK


def _nonnegative(x: Tensor) -> tuple[Tensor]:
    """The sign bit sent: 1 for ``x >= 0`` (both zeros), 0 below zero and for NaN."""
    return ((x >= 0).to(torch.int32),)


def _signed_scale(code: Tensor, scale: Tensor) -> Tensor:
    """``+scale`` for bit 1, ``-scale`` for bit 0: ``(2 b - 1) * scale`` is exact, and as
    arithmetic it runs in vectors where a select on the bit did not."""
    return (code.to(scale.dtype) * 2 - 1) * scale


@register
class SignSGD(_ScaledSign):
    """signSGD: the sign of each element, scaled by the mean magnitude (``signsgd``).

    Source: Bernstein, Wang, Azizzadenesheli & Anandkumar, "signSGD: Compressed Optimisation
    for Non-Convex Problems" (ICML 2018, arXiv 1802.04434). Each rank sends ``sign(x)`` (1 bit
    per element, zero sent as +1) and ``||x||_1 / n``; the reducer averages the decoded
    ``scale * sign(x)`` over ranks (the paper's majority vote would take the sign of the sum of
    signs instead). Biased; not aggregatable; no error feedback (see ``efsignsgd``).

    Args:
        group: elements per scale; 0 (default) for one scale for the whole tensor.

    Shapes and dtypes: any shape, fp16, bf16, fp32 or fp64 in. Payload tensors: sign bits
    ``(ceil(n / 8),)`` uint8, the scales ``(1,)`` (``(ceil(n / group),)`` with ``group``) in the
    input dtype. Payload: ``ceil(n / 8) + itemsize(dtype)`` bytes, ``ceil(n / 8) + ceil(n /
    group) * itemsize(dtype)`` with ``group``.

    Raises:
        ValueError: if ``group`` is not an integer >= 0.
    """

    name = "signsgd"


@register
class EFSignSGD(_ScaledSign):
    """EF-signSGD: scaled sign with error feedback (``efsignsgd``).

    Source: Karimireddy, Rebjock, Stich & Jaggi, "Error Feedback Fixes SignSGD and other
    Gradient Compression Schemes" (ICML 2019, arXiv 1901.09847). Compresses ``p = g + e`` to
    ``(||p||_1 / n) * sign(p)`` (zero sent as +1) and keeps ``e = p - that`` as the residual;
    the reducer averages the decoded tensors. Biased; not aggregatable; error feedback on.
    The paper scales each layer by its own mean magnitude; ``group=G`` gives every ``G``
    consecutive elements of a bucket their own scale, which keeps a layer of small gradients
    from being sent at the scale of a layer of large ones (it matters most in the two-phase
    exchange, which compresses the averaged chunks a second time).

    Args:
        group: elements per scale; 0 (default) for one scale for the whole tensor.

    Shapes, dtypes and payload: as ``signsgd``, ``ceil(n / 8) + itemsize(dtype)`` bytes, or
    ``ceil(n / 8) + ceil(n / group) * itemsize(dtype)`` with ``group``.

    Raises:
        ValueError: if ``group`` is not an integer >= 0.
    """

    name = "efsignsgd"
    error_feedback = True
