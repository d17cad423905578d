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
    Kernel,
    abs_max_rows,
    decode_rows,
    encode_rows,
    min_max_rows,
    reduce_rows,
)
from gradzip.compressors.kernels.sums import ordered_sums

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


def row_chunks(offset: int, view: Tensor) -> list[tuple[int, int, Tensor]]:
    """Split a ``(rows, size)`` group view from :func:`grouped` into cache-sized row blocks.

    Returns:
        ``[(first_row, element_offset, block), ...]`` with ``first_row`` counted within ``view``.
    """
    rows, size = view.shape
    step = max(1, CHUNK // size)
    return [(r, offset + r * size, view[r : r + step]) for r in range(0, rows, step)]


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


def _frame_statistics(low: Tensor, high: Tensor) -> Tensor:
    """``max |low|, |high|``, then the largest and the smallest nonzero group spread ``high -
    low`` (in fp64; inf if none is nonzero), as one fp64 ``(3,)`` tensor. NaN propagates into
    the maxima. Maxima and minima only, so compiled and eager agree."""
    top = torch.maximum(low.abs().amax(), high.abs().amax()).to(torch.float64)
    spread = (high.to(torch.float64) - low.to(torch.float64)).abs()
    return torch.stack([top, spread.amax(), torch.where(spread > 0, spread, torch.inf).amin()])


#: the uniform quantizer's frame statistics in one compiled pass over the group ends (about ten
#: separate small reductions took a tenth of a round trip)
_frame_stats = Kernel(_frame_statistics, "uniform_frame")


@register
class QSGD(Compressor):
    """QSGD: stochastic quantization to ``s = 2**bits - 1`` levels per bucket (``qsgd:bits=,bucket=``).

    Source: Alistarh, Grubic, Li, Tomioka & Vojnovic, "QSGD: Communication-Efficient SGD via
    Gradient Quantization and Encoding" (NeurIPS 2017, arXiv 1610.02132). Each bucket ``v`` of
    ``bucket`` consecutive elements is sent as its scale ``||v||`` and, per element, a sign and
    a level ``l`` in ``0..s``, rounded up from ``|v_i| / ||v|| * s`` with probability equal to
    the fraction: ``Q(v_i) = ||v|| * sign(v_i) * l / s``. Unbiased (``E[Q(v)] = v``, up to the
    2**-17 dither resolution); variance per bucket at most ``bucket * ||v||**2 / (4 s**2)``
    with ``norm=max``, ``min(bucket / s**2, sqrt(bucket) / s) * ||v||_2**2`` with ``norm=l2``
    (the paper's bound). Not aggregatable (buckets have their own scales per rank); no error
    feedback needed. An exact zero has level 0.

    Args:
        bits: bits of the level, 1, 2, 4 or 8 (``s`` = 1, 3, 15 or 255 levels above zero).
        bucket: elements per bucket, >= 1.
        norm: ``max`` (``||v||_inf``, the default: levels span the values actually present
            and decoded values never exceed the input's range) or ``l2`` (``||v||_2``, the
            paper's analysis; decoded values are clamped to the dtype's finite range).
        seed: seed of the rounding dither (drawn per (seed, step, key)).

    Shapes and dtypes: any shape, fp16, bf16, fp32 or fp64 in. Payload tensors: signs
    ``(ceil(n / 8),)`` uint8, levels ``(ceil(n * bits / 8),)`` uint8, scales ``(ceil(n /
    bucket),)`` in the input dtype for ``norm=max``, fp32 (fp64 for fp64 input) for ``l2``.
    Payload: ``ceil(n / 8) + ceil(n * bits / 8) + ceil(n / bucket) * itemsize(scale)`` bytes.

    Raises:
        ValueError: if ``bits`` is not 1, 2, 4 or 8, ``bucket < 1``, ``norm`` is not max or
            l2, or ``seed < 0``.
    """

    name = "qsgd"
    unbiased = True

    def __init__(self, *, bits: int = 4, bucket: int = 512, norm: str = "max", seed: int = 0) -> None:
        super().__init__(bits=bits, bucket=bucket, norm=norm, seed=seed)
        self.bits = wire.check_bits(bits)
        self.bucket = check_int(bucket, name="bucket", low=1)
        self.norm = check_choice(norm, name="norm", allowed=NORMS)
        self.seed = check_int(seed, name="seed", low=0)
        self.levels = (1 << self.bits) - 1

    def scale_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The scales' wire dtype: the input's for ``max`` (exact), fp32 or fp64 for ``l2``."""
        return dtype if self.norm == "max" else compute_dtype(dtype)

    def payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """``ceil(n / 8) + ceil(n * bits / 8) + ceil(n / bucket) * itemsize(scale)``."""
        buckets = -(-numel // self.bucket)
        return (
            wire.packed_nbytes(numel, 1)
            + wire.packed_nbytes(numel, self.bits)
            + buckets * wire.dtype_nbytes(self.scale_dtype(dtype))
        )

    def _scales(self, flat: Tensor) -> Tensor:
        if self.norm == "max":
            return reduce_rows(abs_max_rows, flat, group=self.bucket)[0]
        parts = [torch.linalg.vector_norm(view, dim=1, dtype=torch.float64) for _offset, view in grouped(flat, self.bucket)]
        scales = torch.cat(parts)
        wire_dtype = self.scale_dtype(flat.dtype)
        limit = torch.finfo(wire_dtype).max
        rounded = scales.clamp(max=limit).to(wire_dtype)
        # Round the scale up, never down, so that |v_i| / scale stays <= 1.
        low = rounded.to(torch.float64) < scales.clamp(max=limit)
        return torch.where(low, torch.nextafter(rounded, torch.full_like(rounded, torch.inf)), rounded)

    def compress(self, x: Tensor, *, step: int = 0, key: Hashable = 0) -> Payload:
        """Args: x of any shape and floating dtype. Returns: ``Payload((signs, levels, scales))``."""
        flat = x.reshape(-1)
        numel = flat.numel()
        if numel == 0:
            empty = torch.empty(0, dtype=torch.uint8, device=flat.device)
            return Payload((empty, empty, torch.empty(0, dtype=self.scale_dtype(flat.dtype), device=flat.device)))
        keys = hash_key(self.seed, step, key)
        if flat.dtype == torch.float32 and self.norm == "max":
            # fp32 arithmetic assumed: scales, parameters and codes in one loop over the
            # tensor; kept unless the scales need fp64.
            signs, levels, scales = encode_rows(
                _qsgd_encoder(self.levels, torch.float32),
                (flat,),
                keys,
                group=self.bucket,
                out_bits=(1, self.bits),
                with_positions=True,
                row_stats=(_abs_max_column, _qsgd_params(self.levels, torch.float32)),
                native=native.qsgd_encoder(self.levels, self.bits),
            )
            if _fits_fp32(scales, low=self.levels * 2.0**-100):
                return Payload((signs, levels, scales))
        scales = self._scales(flat)
        work = compute_dtype(flat.dtype)
        if work == torch.float32 and not _fits_fp32(scales, low=self.levels * 2.0**-100):
            work = torch.float64
        params = _qsgd_params(self.levels, work)(scales, *keys)
        signs, levels = encode_rows(
            _qsgd_encoder(self.levels, work), (flat,), params, group=self.bucket, out_bits=(1, self.bits), with_positions=True
        )
        return Payload((signs, levels, scales))

    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        """Returns: ``scale * sign * level / s`` shaped and typed as ``like``."""
        signs, packed, scales = payload.tensors
        numel = like.numel()
        if numel == 0:
            return torch.empty_like(like, memory_format=torch.contiguous_format)
        work = compute_dtype(like.dtype)
        if work == torch.float32 and not _fits_fp32(scales, low=self.levels * 2.0**-100):
            work = torch.float64
        clamp = self.norm == "l2"
        decode = _qsgd_decoder(self.levels, work, like.dtype, clamp)
        codes = ((signs, 1), (packed, self.bits))
        fast = native.qsgd_decoder(self.levels, self.bits) if like.dtype == work == torch.float32 and not clamp else None
        values = decode_rows(decode, codes, (scales.to(work),), group=self.bucket, numel=numel, native=fast)
        return values.view(like.shape)


def _abs_max_column(rows: Tensor) -> tuple[Tensor]:
    """Per-row ``max |x|`` of a ``(rows, cols)`` view, as a ``(rows, 1)`` column."""
    return (rows.abs().amax(1, keepdim=True),)


@cache
def _qsgd_params(levels: int, work: torch.dtype) -> Callable[..., tuple[Tensor, ...]]:
    """QSGD's parameters from the bucket scales (any shape): ``(scales, *keys) -> (2**16 s /
    scale, *keys)`` in ``work``."""
    tiny = torch.finfo(work).tiny * (1 << 10)

    def params(scales: Tensor, *keys: Tensor) -> tuple[Tensor, ...]:
        wide = scales.to(work)
        # Buckets with a scale below tiny (only fp64 denormals) send level 0: an exact zero
        # would otherwise need a reciprocal beyond the dtype's range.
        inverse = torch.where(wide >= tiny, levels / wide.clamp(min=tiny), torch.zeros_like(wide))
        # In units of 2**-16 of a level: the dither, plus 2**16 * |v| * s / scale below.
        return (inverse * (1 << 16), *keys)

    return params


@cache
def _qsgd_encoder(levels: int, work: torch.dtype) -> Callable[..., tuple[Tensor, Tensor]]:
    """QSGD's encoding loop: ``(x, dither int16, 2**16 s / scale per row) -> (signs, levels)``."""

    def encode(x: Tensor, inverse: Tensor, key_low: Tensor, key_high: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        # level = floor(|v| * s / scale + u): rounds up with probability frac(|v| * s / scale).
        dither = hashed_dither(pos, key_low, key_high).to(work) + 0.5
        units = x.to(work).abs() * inverse + dither
        level = (units * 2.0**-16).clamp(max=levels).to(torch.int32)
        return (x < 0).to(torch.int32), level

    return encode


@cache
def _qsgd_decoder(levels: int, work: torch.dtype, out: torch.dtype, clamp: bool) -> Callable[..., Tensor]:
    """QSGD's decoding loop: ``(signs, levels, scale per row) -> values`` in ``out``."""
    limit = torch.finfo(out).max

    def decode(negative: Tensor, level: Tensor, scales: Tensor) -> Tensor:
        # level * (1 / s) rounds to at most 1, so the product with the scale never exceeds it.
        magnitude = level.to(work) * (1.0 / levels)
        values = torch.where(negative != 0, -magnitude, magnitude) * scales
        if clamp:
            values = values.clamp(-limit, limit)
        return values.to(out)

    return decode


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

    def __init__(self, *, clip: float = 2.5, seed: int = 0) -> None:
        super().__init__(clip=clip, seed=seed)
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 <= clip < float("inf"):
            raise ValueError(f"clip must be a finite number >= 0; got {clip!r}")
        self.clip = float(clip)
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
        bound = torch.tensor(bound, dtype=work)
        if numel == 0:
            return Payload((torch.empty(0, dtype=torch.uint8, device=flat.device), torch.zeros(1, dtype=work)))
        keys = hash_key(self.seed, step, key)
        encode = _terngrad_encoder(work)
        # The scaler, max of the clipped magnitudes, is the clipping bound or max |g|, whichever
        # is smaller: the bound as soon as one |g| reaches it, which a gradient's tail does. So
        # the codes are computed for the bound, with max |g| per row from the same loop, and
        # recomputed for max |g| only when no element reached the bound.
        if bool(torch.isfinite(bound)):
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
        zero = torch.zeros((), dtype=work)
        values = torch.where(code == 1, scaler, torch.where(code == 2, -scaler, zero))
        return values.to(out)

    return decode


@register
class Uniform(Compressor):
    """Blockwise min-max integer quantization (``uniform:bits=8|4,group=64,rounding=``).

    Each group of ``group`` consecutive elements is sent as its minimum and maximum and one
    ``bits``-bit code per element on the ``L = 2**bits - 1`` evenly spaced points between them;
    small groups keep a single outlier from flattening the codes of the rest of the tensor
    (the scheme of Dettmers et al., "8-bit Optimizers via Block-wise Quantization", arXiv
    2110.02861, with linear codes). ``rounding=nearest`` is biased (error at most half a step
    ``(max - min) / (2 L)`` per element); ``rounding=stochastic`` is unbiased up to the 2**-17
    dither resolution. Not aggregatable; used with error feedback when biased.

    Args:
        bits: 1, 2, 4 or 8.
        group: elements per group, >= 1.
        rounding: ``nearest`` or ``stochastic``.
        seed: seed of the stochastic rounding dither (drawn per (seed, step, key)).

    Shapes and dtypes: any shape, fp16, bf16, fp32 or fp64 in. Payload tensors: codes
    ``(ceil(n * bits / 8),)`` uint8, minima and maxima ``(ceil(n / group),)`` each in the input
    dtype (a zero among them as +0.0). Payload: ``ceil(n * bits / 8) + 2 * ceil(n / group) * itemsize(dtype)`` bytes.

    Raises:
        ValueError: if ``bits`` is not 1, 2, 4 or 8, ``group < 1``, ``rounding`` is not
            nearest or stochastic, or ``seed < 0``.
    """

    name = "uniform"

    def __init__(self, *, bits: int = 8, group: int = 64, rounding: str = "nearest", seed: int = 0) -> None:
        super().__init__(bits=bits, group=group, rounding=rounding, seed=seed)
        self.bits = wire.check_bits(bits)
        self.group = check_int(group, name="group", low=1)
        self.rounding = check_choice(rounding, name="rounding", allowed=ROUNDINGS)
        self.seed = check_int(seed, name="seed", low=0)
        self.steps = (1 << self.bits) - 1
        self.unbiased = self.rounding == "stochastic"
        self.error_feedback = not self.unbiased

    def payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """``ceil(n * bits / 8) + 2 * ceil(n / group) * itemsize(dtype)``."""
        return wire.packed_nbytes(numel, self.bits) + 2 * -(-numel // self.group) * wire.dtype_nbytes(dtype)

    def _frame(self, low: Tensor, high: Tensor, dtype: torch.dtype) -> tuple[torch.dtype, float]:
        """Arithmetic dtype and a power-of-two prescale keeping ``high - low`` and its
        reciprocal finite."""
        work = compute_dtype(dtype)
        if low.numel() == 0:
            return work, 1.0
        stats = native.frame(low, high)
        top, spread_top, spread_bottom = stats if stats is not None else _frame_stats(low, high).tolist()
        if work == torch.float32 and not (
            top <= torch.finfo(torch.float32).max / 4
            and spread_top <= torch.finfo(torch.float32).max / 4
            and spread_bottom >= self.steps * 2.0**-100
        ):
            work = torch.float64
        prescale = 1.0
        if top > torch.finfo(work).max / 4:
            prescale = 2.0**-4
        return work, prescale

    def compress(self, x: Tensor, *, step: int = 0, key: Hashable = 0) -> Payload:
        """Args: x of any shape and floating dtype. Returns: ``Payload((codes, minima, maxima))``."""
        flat = x.reshape(-1)
        numel = flat.numel()
        if numel == 0:
            return Payload((torch.empty(0, dtype=torch.uint8, device=flat.device), flat.new_empty(0), flat.new_empty(0)))
        extremes = native.min_max(flat, self.group)
        low, high = extremes if extremes is not None else reduce_rows(min_max_rows, flat, group=self.group)
        work, prescale = self._frame(low, high, flat.dtype)
        prescale_w = torch.tensor(prescale, dtype=work)
        stochastic = self.rounding == "stochastic"
        fp32 = work == flat.dtype == torch.float32
        group_params = native.uniform_params(low, high, prescale, self.steps, stochastic) if fp32 else None
        if group_params is None:
            group_params = _uniform_params(self.steps, work, self.rounding)(low, high, prescale_w)
        params = (prescale_w, *group_params, *hash_key(self.seed, step, key))
        (codes,) = encode_rows(
            _uniform_encoder(self.steps, work, self.rounding),
            (flat,),
            params,
            group=self.group,
            out_bits=(self.bits,),
            with_positions=stochastic,
            native=native.uniform_encoder(self.steps, self.bits, stochastic) if fp32 else None,
        )
        return Payload((codes, low, high))

    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        """Returns: ``min + code * (max - min) / L`` shaped and typed as ``like``."""
        packed, low, high = payload.tensors
        numel = like.numel()
        if numel == 0:
            return torch.empty_like(like, memory_format=torch.contiguous_format)
        work, prescale = self._frame(low, high, like.dtype)
        fp32 = work == like.dtype == torch.float32
        group_params = native.uniform_decode_params(low, high, prescale, self.steps) if fp32 else None
        if group_params is None:
            group_params = _uniform_decode_params(self.steps, work)(low, high, torch.tensor(prescale, dtype=work))
        decode = _uniform_decoder(work, like.dtype)
        params = (*group_params, torch.tensor(1 / prescale, dtype=work))
        fast = native.uniform_decoder(self.bits) if fp32 else None
        return decode_rows(decode, ((packed, self.bits),), params, group=self.group, numel=numel, native=fast).view(like.shape)


@cache
def _uniform_params(steps: int, work: torch.dtype, rounding: str) -> Kernel:
    """The uniform quantizer's encoding parameters from the group minima and maxima, compiled:
    ``(low, high, prescale) -> (offset, L / spread)`` per group in ``work``."""
    unit = 1.0 if rounding == "nearest" else 2.0**16
    tiny = torch.finfo(work).tiny * (1 << 10)

    def params(low: Tensor, high: Tensor, prescale: Tensor) -> tuple[Tensor, Tensor]:
        low_w, high_w = low.to(work) * prescale, high.to(work) * prescale
        spread = high_w - low_w
        # A group whose spread is below tiny (fp64 denormals) is sent as its minimum.
        inverse = torch.where(spread >= tiny, steps / spread.clamp(min=tiny), torch.zeros_like(spread))
        # code = floor((x - min) * L / (max - min) + shift), shift 1/2 (nearest) or the dither,
        # everything in units of 2**-16 of a step for stochastic rounding (see hashed_dither).
        inverse = inverse * unit
        offset_term = -low_w * inverse
        if rounding == "nearest":
            offset_term = offset_term + 0.5
        return offset_term, inverse

    return Kernel(params, "uniform_params")


@cache
def _uniform_decode_params(steps: int, work: torch.dtype) -> Kernel:
    """The uniform quantizer's decoding parameters, compiled: ``(low, high, prescale) -> (min,
    step, max)`` per group in ``work``, prescaled."""

    def params(low: Tensor, high: Tensor, prescale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        low_w, high_w = low.to(work) * prescale, high.to(work) * prescale
        return low_w, (high_w - low_w) / steps, high_w

    return Kernel(params, "uniform_decode_params")


@cache
def _uniform_encoder(steps: int, work: torch.dtype, rounding: str) -> Callable[..., tuple[Tensor]]:
    """The uniform quantizer's encoding loop: ``(x[, dither int16], prescale, offset, L / spread
    per row) -> codes``."""
    unit = 1.0 if rounding == "nearest" else 2.0**16
    top = (steps + 1) * unit - 1

    def encode(x: Tensor, prescale: Tensor, offset_term: Tensor, inverse: Tensor, *dither_args: Tensor) -> tuple[Tensor]:
        units = (x.to(work) * prescale) * inverse + offset_term
        if rounding == "stochastic":
            key_low, key_high, pos = dither_args
            units = units + (hashed_dither(pos, key_low, key_high).to(work) + 0.5)
        return ((units.clamp(0, top) * (1.0 / unit)).to(torch.int32),)

    return encode


@cache
def _uniform_decoder(work: torch.dtype, out: torch.dtype) -> Callable[..., Tensor]:
    """The uniform quantizer's decoding loop: ``(codes, min, step, max per row, prescale) -> values``."""

    def decode(code: Tensor, low: Tensor, step_size: Tensor, high: Tensor, unscale: Tensor) -> Tensor:
        values = code.to(work) * step_size + low
        # Rounding can step one ulp past max; the clamp keeps it in the group's range (and
        # finite after unscaling a prescaled group).
        # unscale = 1 / prescale, a power of two: the product is exact.
        values = torch.minimum(torch.maximum(values, low), high) * unscale
        return values.to(out)

    return decode


#: per float dtype: the integer view, mantissa bits, exponent bits
_FLOAT_LAYOUT = {
    torch.float16: (torch.int16, 10, 5),
    torch.bfloat16: (torch.int16, 7, 8),
    torch.float32: (torch.int32, 23, 8),
    torch.float64: (torch.int64, 52, 11),
}


@register
class Natural(Compressor):
    """Natural compression: each value rounded at random to a neighbouring power of two (``natural``).

    Source: Horvath, Ho, Horvath, Sahu, Canini & Richtarik, "Natural Compression for
    Distributed Deep Learning" (2019, arXiv 1905.10988). ``|x|`` in ``[2**e, 2**(e+1))`` becomes
    ``2**(e+1)`` with probability ``|x| / 2**e - 1``, else ``2**e``; the sign is kept. Only sign
    and exponent travel: 9 bits per element for fp32 and bf16 (8-bit exponent), 9 for fp16 (its
    5-bit exponent in a byte), 17 for fp64 (11-bit exponent in 2 bytes). Unbiased (variance at
    most ``||x||**2 / 8``), up to the 2**-17 dither resolution and except above the dtype's
    largest power of two, which rounds down (2**(e+1) would be inf); subnormals round to 0 or
    the smallest normal power. Not aggregatable; no error feedback needed.

    Args:
        seed: seed of the rounding dither (drawn per (seed, step, key)).

    Shapes and dtypes: any shape, fp16, bf16, fp32 or fp64 in. Payload tensors: signs
    ``(ceil(n / 8),)`` uint8, exponents ``(n,)`` uint8 (int16 for fp64). Payload:
    ``ceil(n / 8) + n * (2 if fp64 else 1)`` bytes.

    Raises:
        ValueError: if ``seed < 0``.
    """

    name = "natural"
    unbiased = True

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.seed = check_int(seed, name="seed", low=0)

    @staticmethod
    def exponent_dtype(dtype: torch.dtype) -> torch.dtype:
        """uint8 for exponents of up to 8 bits, int16 for fp64's 11."""
        return torch.int16 if dtype == torch.float64 else torch.uint8

    def payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """``ceil(n / 8) + n * itemsize(exponent)``."""
        return wire.packed_nbytes(numel, 1) + numel * wire.dtype_nbytes(self.exponent_dtype(dtype))

    def compress(self, x: Tensor, *, step: int = 0, key: Hashable = 0) -> Payload:
        """Args: x of any shape and floating dtype. Returns: ``Payload((signs, exponents))``."""
        flat = x.reshape(-1).contiguous()
        numel = flat.numel()
        if numel == 0:
            return Payload((torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=self.exponent_dtype(flat.dtype))))
        encode = _natural_encoder(flat.dtype)
        signs, exponent = encode_rows(
            encode,
            (flat,),
            hash_key(self.seed, step, key),
            group=BLOCK,
            out_bits=(1, _exponent_bits(flat.dtype)),
            with_positions=True,
            native=native.natural_encode if flat.dtype == torch.float32 else None,
        )
        return Payload((signs, exponent))

    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        """Returns: ``sign * 2**exponent`` shaped and typed as ``like``."""
        signs, exponent = payload.tensors
        numel = like.numel()
        if numel == 0:
            return torch.empty_like(like, memory_format=torch.contiguous_format)
        codes = ((signs, 1), (exponent, _exponent_bits(like.dtype)))
        fast = native.natural_decode if like.dtype == torch.float32 else None
        values = decode_rows(_natural_decoder(like.dtype), codes, (), group=BLOCK, numel=numel, native=fast)
        return values.view(like.shape)


def _exponent_bits(dtype: torch.dtype) -> int | None:
    """Natural compression's exponents travel as 8-bit codes (packed four to a word, one
    byte each on the wire), fp64's 11-bit ones as int16 values."""
    return None if dtype == torch.float64 else 8


@cache
def _natural_encoder(dtype: torch.dtype) -> Callable[..., tuple[Tensor, Tensor]]:
    """Natural compression's encoding loop: ``(bits of x, dither int16) -> (signs, exponents)``."""
    int_dtype, mantissa_bits, exponent_bits = _FLOAT_LAYOUT[dtype]
    exponent_dtype = Natural.exponent_dtype(dtype)
    packed = _exponent_bits(dtype) is not None

    def encode(x: Tensor, key_low: Tensor, key_high: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        # The bits viewed in the loop: the kernel loads floats (see fused.float_bits).
        bits = x.view(int_dtype)
        magnitude = bits & ((1 << (mantissa_bits + exponent_bits)) - 1)
        # Adding a uniform integer in [0, 2**M) to the magnitude bits carries into the exponent
        # with probability mantissa / 2**M: exactly the rounding-up probability.
        dither = hashed_dither(pos, key_low, key_high)
        if mantissa_bits >= 16:
            # 16 random high bits, centred in the 2**(M - 16) they stand for.
            offset = (dither.to(int_dtype) << (mantissa_bits - 16)) + (1 << (mantissa_bits - 17))
        else:
            offset = (dither >> (16 - mantissa_bits)).to(int_dtype)
        exponent = ((magnitude + offset) >> mantissa_bits).clamp(max=(1 << exponent_bits) - 2)
        return (bits < 0).to(torch.int32), (exponent.to(torch.int32) if packed else exponent.to(exponent_dtype))

    return encode


@cache
def _natural_decoder(dtype: torch.dtype) -> Callable[..., Tensor]:
    """Natural compression's decoding loop: ``(signs, exponents) -> sign * 2**exponent``,
    assembled as the value's bits (stored as floats: see fused.float_bits)."""
    int_dtype, mantissa_bits, exponent_bits = _FLOAT_LAYOUT[dtype]

    def decode(negative: Tensor, exponent: Tensor) -> Tensor:
        return ((exponent.to(int_dtype) << mantissa_bits) | (negative.to(int_dtype) << (mantissa_bits + exponent_bits))).view(dtype)

    return decode
