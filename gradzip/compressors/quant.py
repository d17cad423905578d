"""Quantizers: a few bits per element plus a few scales.

All of them pack their codes as :func:`gradzip.wire.pack_bits` lays them out, so a 2-bit code costs 2 bits
on the wire. Arithmetic runs in fp32 (fp64 for fp64 input, and for fp32 input whose scales sit
near the ends of the fp32 range), so no finite input turns into inf or NaN: zeros, denormals,
values near the dtype's largest and a single huge outlier all decode to finite values.
Stochastic rounding draws its dither from :mod:`gradzip.compressors.dither` (exact to
2**-17 of a quantization step).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor

from gradzip import wire
from gradzip.compressors import register
from gradzip.compressors.base import Compressor, Payload, check_int
from gradzip.compressors.dither import dither_int16, dither_source, dither_units
from gradzip.compressors.elementwise import cast_into, less, pack_codes, pack_flags, scaled_cast_into, unpack_codes

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


def _fits_fp32(scales: Tensor, low: float) -> bool:
    """Whether per-group scales (any float dtype) are safe for fp32 arithmetic: none above a
    quarter of fp32's range, and no nonzero one so small that its reciprocal overflows."""
    if scales.numel() == 0:
        return True
    top = float(scales.abs().max())
    nonzero = scales.abs()[scales != 0]
    bottom = float(nonzero.min()) if nonzero.numel() else 1.0
    return top <= torch.finfo(torch.float32).max / 4 and bottom >= low


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
        parts = []
        for _offset, view in grouped(flat, self.bucket):
            if self.norm == "max":
                # amax and amin separately: torch.aminmax along a dim runs several times slower.
                parts.append(torch.maximum(view.amax(1), view.amin(1).neg_()))
            else:
                parts.append(torch.linalg.vector_norm(view, dim=1, dtype=torch.float64))
        scales = torch.cat(parts)
        if self.norm == "max":
            return scales
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
        scales = self._scales(flat)
        work = compute_dtype(flat.dtype)
        if work == torch.float32 and not _fits_fp32(scales, low=self.levels * 2.0**-100):
            work = torch.float64
        wide = scales.to(work)
        tiny = torch.finfo(work).tiny * (1 << 10)
        # Buckets with a scale below tiny (only fp64 denormals) send level 0: an exact zero
        # would otherwise need a reciprocal beyond the dtype's range.
        inverse = torch.where(wide >= tiny, self.levels / wide.clamp(min=tiny), torch.zeros_like(wide))
        # In units of 2**-16 of a level: the dither, plus 2**16 * |v| * s / scale below.
        dither = dither_units(dither_source(self.seed, step, key), numel, work).to(flat.device)
        inverse *= 1 << 16
        levels = torch.empty(numel, dtype=torch.uint8, device=flat.device)
        scratch = torch.empty(min(numel, CHUNK + self.bucket), dtype=work, device=flat.device)
        row = 0
        for offset, view in grouped(flat, self.bucket):
            size = view.shape[1]
            for first, start, block in row_chunks(offset, view):
                count = block.numel()
                magnitude = scratch[:count].view(block.shape)
                magnitude.copy_(block).abs_()
                part = dither[start : start + count].view(block.shape)
                # level = floor(|v| * s / scale + u): rounds up with probability frac(|v| * s / scale).
                part.addcmul_(magnitude, inverse[row + first : row + first + block.shape[0], None])
                scaled_cast_into(part.view(-1), 2.0**-16, levels[start : start + count])
            row += view.numel() // size
        levels.clamp_(max=self.levels)
        signs = pack_flags(less(flat, 0))
        return Payload((signs, pack_codes(levels, self.bits), scales))

    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        """Returns: ``scale * sign * level / s`` shaped and typed as ``like``."""
        signs, packed, scales = payload.tensors
        numel = like.numel()
        if numel == 0:
            return torch.empty_like(like, memory_format=torch.contiguous_format)
        work = compute_dtype(like.dtype)
        if work == torch.float32 and not _fits_fp32(scales, low=self.levels * 2.0**-100):
            work = torch.float64
        # level * (1 / s) rounds to at most 1, so the product with the scale never exceeds it.
        values = torch.empty(numel, dtype=work, device=like.device)
        scaled_cast_into(unpack_codes(packed, self.bits, numel), 1.0 / self.levels, values)
        negative = cast_into(unpack_codes(signs, 1, numel), torch.empty_like(values))
        values.addcmul_(values, negative, value=-2.0)  # v * (1 - 2 * negative)
        wide = scales.to(work)
        row = 0
        for _offset, view in grouped(values, self.bucket):
            view.mul_(wide[row : row + view.shape[0], None])
            row += view.shape[0]
        if self.norm == "l2":
            limit = torch.finfo(like.dtype).max
            values.clamp_(-limit, limit)
        return values.to(like.dtype).view(like.shape)


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
        work = compute_dtype(flat.dtype)
        magnitude = flat.to(work).abs() if flat.dtype != work else flat.abs()
        if self.clip > 0 and flat.numel() > 1:
            sigma = float(torch.std(flat if flat.dtype == work else flat.to(work), correction=0))
            if not sigma < float("inf"):
                # Squares of values near the top of fp32 overflow; fp64 holds them.
                sigma = float(torch.std(flat.to(torch.float64), correction=0))
            bound = self.clip * sigma
            if 0 < bound < torch.finfo(work).max:
                magnitude.clamp_(max=bound)
        scaler = magnitude.max().reshape(1) if flat.numel() else torch.zeros(1, dtype=work)
        dither = dither_units(dither_source(self.seed, step, key), flat.numel(), work).to(flat.device)
        # b_i = [u_i < |g_i| / s], compared as 2**16 u_i < |g_i| * (2**16 / s); a scaler so small
        # that 2**16 / s overflows leaves inf * 0 = nan for zeros, which compares false.
        factor = (2.0**16 / scaler.double()).clamp(max=torch.finfo(work).max).to(work)
        keep = less(dither, magnitude.mul_(factor)).view(torch.uint8)
        # code = b_i << [g_i < 0]: 0 for zero, 1 for plus, 2 for minus.
        codes = keep << less(flat, 0).view(torch.uint8)
        return Payload((pack_codes(codes, 2), scaler))

    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        """Returns: ``scaler * {0, +1, -1}[code]`` shaped and typed as ``like``."""
        packed, scaler = payload.tensors
        ternary = wire.unpack_bits(packed, 2, like.numel(), lut=torch.tensor([0, 1, -1, 0], dtype=torch.int8))
        values = scaled_cast_into(ternary, float(scaler), torch.empty(like.numel(), dtype=scaler.dtype))
        return values.to(like.dtype).view(like.shape)


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
    dtype. Payload: ``ceil(n * bits / 8) + 2 * ceil(n / group) * itemsize(dtype)`` bytes.

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
        ends = torch.cat([low, high])
        spread = high.to(torch.float64) - low.to(torch.float64)
        if work == torch.float32 and not (
            _fits_fp32(ends, low=0.0) and _fits_fp32(spread, low=self.steps * 2.0**-100)
        ):
            work = torch.float64
        prescale = 1.0
        if ends.numel() and float(ends.abs().max()) > torch.finfo(work).max / 4:
            prescale = 2.0**-4
        return work, prescale

    def compress(self, x: Tensor, *, step: int = 0, key: Hashable = 0) -> Payload:
        """Args: x of any shape and floating dtype. Returns: ``Payload((codes, minima, maxima))``."""
        flat = x.reshape(-1)
        numel = flat.numel()
        if numel == 0:
            return Payload((torch.empty(0, dtype=torch.uint8, device=flat.device), flat.new_empty(0), flat.new_empty(0)))
        lows, highs = [], []
        for _offset, view in grouped(flat, self.group):
            # amin and amax separately: torch.aminmax along a dim runs several times slower.
            lows.append(view.amin(1))
            highs.append(view.amax(1))
        low = torch.cat(lows) if lows else flat.new_empty(0)
        high = torch.cat(highs) if highs else flat.new_empty(0)
        work, prescale = self._frame(low, high, flat.dtype)
        low_w, high_w = low.to(work) * prescale, high.to(work) * prescale
        spread = high_w - low_w
        tiny = torch.finfo(work).tiny * (1 << 10)
        # A group whose spread is below tiny (fp64 denormals) is sent as its minimum.
        inverse = torch.where(spread >= tiny, self.steps / spread.clamp(min=tiny), torch.zeros_like(spread))
        # code = floor((x - min) * L / (max - min) + shift), shift 1/2 (nearest) or the dither,
        # everything in units of 2**-16 of a step for stochastic rounding (see dither_units).
        unit = 1.0 if self.rounding == "nearest" else 2.0**16
        inverse = inverse * unit
        offset_term = -low_w * inverse
        if self.rounding == "nearest":
            offset_term += 0.5
        dither = None
        if self.rounding == "stochastic":
            dither = dither_units(dither_source(self.seed, step, key), numel, work).to(flat.device)
        codes = torch.empty(numel, dtype=torch.uint8, device=flat.device)
        scratch = torch.empty(min(numel, CHUNK + self.group), dtype=work, device=flat.device)
        row = 0
        for offset, view in grouped(flat, self.group):
            for first, start, block in row_chunks(offset, view):
                count = block.numel()
                rows = slice(row + first, row + first + block.shape[0])
                part = scratch[:count].view(block.shape)
                if prescale != 1.0:
                    block = block * prescale
                torch.addcmul(offset_term[rows, None], block, inverse[rows, None], out=part)
                if dither is not None:
                    part.add_(dither[start : start + count].view(block.shape))
                part.clamp_(0, (self.steps + 1) * unit - 1)
                scaled_cast_into(part.view(-1), 1.0 / unit, codes[start : start + count])
            row += view.shape[0]
        return Payload((pack_codes(codes, self.bits), low, high))

    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        """Returns: ``min + code * (max - min) / L`` shaped and typed as ``like``."""
        packed, low, high = payload.tensors
        numel = like.numel()
        if numel == 0:
            return torch.empty_like(like, memory_format=torch.contiguous_format)
        work, prescale = self._frame(low, high, like.dtype)
        low_w, high_w = low.to(work) * prescale, high.to(work) * prescale
        step_size = (high_w - low_w) / self.steps
        values = cast_into(unpack_codes(packed, self.bits, numel), torch.empty(numel, dtype=work, device=like.device))
        row = 0
        for _offset, view in grouped(values, self.group):
            rows = view.shape[0]
            lo, hi = low_w[row : row + rows, None], high_w[row : row + rows, None]
            torch.addcmul(lo, view, step_size[row : row + rows, None], out=view)
            if prescale != 1.0:
                # Rounding could step one ulp past max; the clamp keeps it finite after unscaling.
                torch.minimum(torch.maximum(view, lo), hi, out=view)
            row += rows
        if prescale != 1.0:
            values /= prescale
        return values.to(like.dtype).view(like.shape)


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
        int_dtype, mantissa_bits, exponent_bits = _FLOAT_LAYOUT[flat.dtype]
        bits = flat.view(int_dtype)
        magnitude = bits & ((1 << (mantissa_bits + exponent_bits)) - 1)
        # Adding a uniform integer in [0, 2**M) to the magnitude bits carries into the exponent
        # with probability mantissa / 2**M: exactly the rounding-up probability.
        dither = dither_int16(dither_source(self.seed, step, key), flat.numel())
        if mantissa_bits >= 16:
            # 16 random high bits, centred in the 2**(M - 16) they stand for.
            dither = ((dither.to(int_dtype) + (1 << 15)) << (mantissa_bits - 16)) + (1 << (mantissa_bits - 17))
        else:
            dither = ((dither.to(torch.int32) + (1 << 15)) >> (16 - mantissa_bits)).to(int_dtype)
        magnitude += dither
        exponent = (magnitude >> mantissa_bits).clamp_(max=(1 << exponent_bits) - 2)
        signs = pack_flags(less(bits, 0))
        packed = torch.empty(flat.numel(), dtype=self.exponent_dtype(flat.dtype), device=flat.device)
        return Payload((signs, cast_into(exponent, packed)))

    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        """Returns: ``sign * 2**exponent`` shaped and typed as ``like``."""
        signs, exponent = payload.tensors
        int_dtype, mantissa_bits, exponent_bits = _FLOAT_LAYOUT[like.dtype]
        bits = exponent.to(int_dtype) << mantissa_bits
        negative = unpack_codes(signs, 1, like.numel()).to(int_dtype) << (mantissa_bits + exponent_bits)
        bits |= negative
        return bits.view(like.dtype).view(like.shape)
