"""TernGrad: 2-bit ternary codes with a per-row scale (see :mod:`.quant` for the shared wire layout)."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from functools import cache

import torch
from torch import Tensor

from gradzip.compressors import register
from gradzip.compressors.base import Compressor, Payload, check_int
from gradzip.compressors.kernels import native, wire
from gradzip.compressors.kernels.dither import hash_key, hashed_dither
from gradzip.compressors.kernels.fused import (
    BLOCK,
    WORD_BITS,
    abs_max_rows,
    decode_rows,
    encode_rows,
    reduce_rows,
)
from gradzip.compressors.kernels.placement import scalar
from gradzip.compressors.kernels.sums import ordered_sums
from gradzip.compressors.quant import (
    compute_dtype,
)
from gradzip.compressors.values import check_number


def _std(flat: Tensor) -> float:
    """The population standard deviation of ``flat`` (fp32 or fp64) from its sum and sum of
    squares, added in its own precision in the order of :mod:`gradzip.compressors.kernels.sums` (the
    same bits from the native loop, one read, and from torch; ``torch.std`` runs several times
    slower on CPU; the clipping bound needs no more digits than fp32 holds). Where the mean
    dwarfs the spread, so that the difference of moments loses its digits, ``torch.std``.
    Returns inf where the squares overflow."""
    numel = flat.numel()
    total, squares = ordered_sums(flat, ("plain", "square"), flat.dtype)
    mean = total / numel
    mean_square = squares / numel
    variance = mean_square - mean * mean
    if not math.isfinite(mean_square):
        return float("inf")
    if variance <= 1e-3 * mean * mean:
        return float(torch.std(flat, correction=0))
    return math.sqrt(variance)



@register
class TernGrad(Compressor):
    """TernGrad: ternary {-1, 0, +1} codes times one scaler per tensor (``terngrad``).

    Source: Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed
    Deep Learning" (NeurIPS 2017, arXiv 1705.07878). The tensor is first clipped to ``clip *
    sigma`` (``sigma`` its standard deviation; the paper's gradient clipping, ``clip=2.5``),
    then ``s = max |g|`` and ``Q(g_i) = s * sign(g_i) * b_i`` with ``b_i ~ Bernoulli(|g_i| /
    s)``. Layer-wise scaling means one scaler per tensor handed to the codec (a DDP bucket
    through the hook). Unbiased for the clipped tensor; with ``clip=0`` (no clipping) unbiased
    for the input. Not aggregatable; no error feedback (as in the paper).

    Args:
        clip: clipping bound in standard deviations, a number >= 0; 0 turns clipping off.
        seed: seed of the Bernoulli draws (drawn per (seed, step, key)).

    Shapes and dtypes: any shape, fp16, bf16, fp32 or fp64 in. Payload tensors: codes
    ``(ceil(n / 4),)`` uint8 (2 bits each: 0 zero, 1 plus, 2 minus), the scaler ``(1,)`` in
    fp32 (fp64 for fp64 input). Payload: ``ceil(n / 4) + itemsize(scale)`` bytes.

    Raises:
        ValueError: if ``clip`` is negative or not a finite number, or ``seed < 0``.
    """

    name = "terngrad"
    host_reads = "the standard deviation (the clipping bound) and whether an element reached the bound"

    def __init__(self, *, clip: float = 2.5, seed: int = 0) -> None:
        super().__init__(clip=clip, seed=seed)
        self.clip = check_number(clip, name="clip", low=0)
        self.seed = check_int(seed, name="seed", low=0)
        self.unbiased = self.clip == 0

    def payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """``ceil(n / 4) + itemsize(fp32, or fp64 for fp64 input)``."""
        return wire.packed_nbytes(numel, 2) + wire.dtype_nbytes(compute_dtype(dtype))

    def compress(self, x: Tensor, *, step: int = 0, key: Hashable = 0) -> Payload:
        """Args: x of any shape and floating dtype. Returns: ``Payload((codes, scaler (1,)))``."""
        flat = x.reshape(-1)
        numel = flat.numel()
        work = compute_dtype(flat.dtype)
        bound = float("inf")
        if self.clip > 0 and numel > 1:
            sigma = _std(flat if flat.dtype == work else flat.to(work))
            if not sigma < float("inf"):
                # Squares of values near the top of fp32 overflow; fp64 holds them.
                sigma = float(torch.std(flat.to(torch.float64), correction=0))
            if 0 < self.clip * sigma < torch.finfo(work).max:
                bound = self.clip * sigma
        finite_bound = math.isfinite(bound)
        bound = scalar(bound, work, flat.device)
        if numel == 0:
            return Payload((torch.empty(0, dtype=torch.uint8, device=flat.device), torch.zeros(1, dtype=work, device=flat.device)))
        keys = hash_key(self.seed, step, key, flat.device)
        encode = _terngrad_encoder(work)
        # The scaler, max of the clipped magnitudes, is the clipping bound or max |g|, whichever
        # is smaller: the bound as soon as one |g| reaches it, which a gradient's tail does. So
        # the codes are computed for the bound, with max |g| per row from the same loop, and
        # recomputed for max |g| only when no element reached the bound.
        if finite_bound:
            codes, row_max = encode_rows(
                encode,
                (flat,),
                (_terngrad_factor(bound.reshape(1), work), bound, *keys),
                group=BLOCK,
                out_bits=(2,),
                with_positions=True,
                row_stats=(_abs_max_by_lanes, _unchanged_params),
                native=native.terngrad_encoder(with_max=True),
            )
            scaler = torch.minimum(row_max.amax().to(work), bound).reshape(1)
            if bool(scaler == bound):
                return Payload((codes, scaler))
        else:
            top = native.abs_max(flat)
            if top is None:
                top = reduce_rows(abs_max_rows, flat, group=numel)[0]
            scaler = torch.minimum(top.to(work), bound).reshape(1)
        (codes,) = encode_rows(
            encode,
            (flat,),
            (_terngrad_factor(scaler, work), bound, *keys),
            group=BLOCK,
            out_bits=(2,),
            with_positions=True,
            native=native.terngrad_encoder(with_max=False),
        )
        return Payload((codes, scaler))

    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        """Returns: ``scaler * {0, +1, -1}[code]`` shaped and typed as ``like``."""
        packed, scaler = payload.tensors
        numel = like.numel()
        if numel == 0:
            return torch.empty_like(like, memory_format=torch.contiguous_format)
        decode = _terngrad_decoder(scaler.dtype, like.dtype)
        fast = native.terngrad_decode if like.dtype == scaler.dtype == torch.float32 else None
        values = decode_rows(decode, ((packed, 2),), (scaler.reshape(()),), group=BLOCK, numel=numel, native=fast)
        return values.view(like.shape)


def _terngrad_factor(scaler: Tensor, work: torch.dtype) -> Tensor:
    """``2**16 / s`` as a 0-d ``work`` tensor. b_i = [u_i < |g_i| / s] is compared as 2**16 u_i
    < |g_i| * (2**16 / s); a scaler so small that 2**16 / s overflows leaves inf * 0 = nan for
    zeros, which compares false."""
    return (2.0**16 / scaler.double()).clamp(max=torch.finfo(work).max).to(work).reshape(())


def _abs_max_by_lanes(rows: Tensor) -> tuple[Tensor]:
    """Per-row ``max |x|`` of a ``(rows, cols)`` view as a ``(rows, 1)`` column, reduced over
    the 16 column slices that the 2-bit fold encodes as the lanes of its words (the last takes
    any remainder): with loops of one length, the compiler puts the reduction in the encoding
    loop (one read of the tensor). Max is exact in any order."""
    slices = WORD_BITS // 2
    width = rows.shape[1] // slices
    if width == 0:
        return (rows.abs().amax(1, keepdim=True),)
    parts = [rows[:, i * width : rows.shape[1] if i == slices - 1 else (i + 1) * width].abs().amax(1, keepdim=True) for i in range(slices)]
    while len(parts) > 1:
        parts = [torch.maximum(parts[i], parts[i + 1]) if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return (parts[0],)


def _unchanged_params(_statistic: Tensor, *params: Tensor) -> tuple[Tensor, ...]:
    """Row parameters that do not depend on the row statistic (TernGrad's are per tensor)."""
    return params


@cache
def _terngrad_encoder(work: torch.dtype) -> Callable[..., tuple[Tensor]]:
    """TernGrad's encoding loop: ``(g, dither int16, 2**16 / s, bound) -> 2-bit codes``."""

    def encode(x: Tensor, factor: Tensor, bound: Tensor, key_low: Tensor, key_high: Tensor, pos: Tensor) -> tuple[Tensor]:
        magnitude = torch.minimum(x.to(work).abs(), bound)
        dither = hashed_dither(pos, key_low, key_high).to(work) + 0.5
        keep = (dither < magnitude * factor).to(torch.int32)
        # code = b_i << [g_i < 0]: 0 for zero, 1 for plus, 2 for minus.
        return (keep << (x < 0).to(torch.int32),)

    return encode


@cache
def _terngrad_decoder(work: torch.dtype, out: torch.dtype) -> Callable[..., Tensor]:
    """TernGrad's decoding loop: ``(2-bit codes, s) -> s * {0, +1, -1}[code]`` in ``out``."""

    def decode(code: Tensor, scaler: Tensor) -> Tensor:
        zero = torch.zeros((), dtype=work, device=code.device)
        values = torch.where(code == 1, scaler, torch.where(code == 2, -scaler, zero))
        return values.to(out)

    return decode
