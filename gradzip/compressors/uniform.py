"""The uniform quantizer: ``bits``-bit codes between per-group extremes (see :mod:`.quant` for the shared wire layout)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from functools import cache

import torch
from torch import Tensor

from gradzip.compressors import register
from gradzip.compressors.base import Compressor, Payload, check_int, clamped_group
from gradzip.compressors.kernels import native, wire
from gradzip.compressors.kernels.dither import hash_key, hashed_dither
from gradzip.compressors.kernels.fused import (
    Kernel,
    decode_rows,
    encode_rows,
    min_max_rows,
    reduce_rows,
)
from gradzip.compressors.kernels.placement import scalar
from gradzip.compressors.quant import (
    ROUNDINGS,
    check_choice,
    compute_dtype,
)


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

    A ``group`` larger than the tensor is clamped to its size (one group): buffers follow the
    tensor, not the parameter.

    Shapes and dtypes: any shape, fp16, bf16, fp32 or fp64 in. Payload tensors: codes
    ``(ceil(n * bits / 8),)`` uint8, minima and maxima ``(ceil(n / group),)`` each in the input
    dtype (a zero among them as +0.0). Payload: ``ceil(n * bits / 8) + 2 * ceil(n / group) * itemsize(dtype)`` bytes.

    Raises:
        ValueError: if ``bits`` is not 1, 2, 4 or 8, ``group < 1``, ``rounding`` is not
            nearest or stochastic, or ``seed < 0``.
    """

    name = "uniform"
    host_reads = "the range of the group extremes, which picks fp32 or fp64 arithmetic and a prescale"

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
        """``ceil(n * bits / 8) + 2 * ceil(n / group) * itemsize(dtype)``, ``group`` clamped to ``n``
        as the codec uses it (the same count of groups)."""
        groups = -(-numel // clamped_group(self.group, numel))
        return wire.packed_nbytes(numel, self.bits) + 2 * groups * wire.dtype_nbytes(dtype)

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
        group = clamped_group(self.group, numel)
        extremes = native.min_max(flat, group)
        low, high = extremes if extremes is not None else reduce_rows(min_max_rows, flat, group=group)
        work, prescale = self._frame(low, high, flat.dtype)
        prescale_w = scalar(prescale, work, flat.device)
        stochastic = self.rounding == "stochastic"
        fp32 = work == flat.dtype == torch.float32
        group_params = native.uniform_params(low, high, prescale, self.steps, stochastic) if fp32 else None
        if group_params is None:
            group_params = _uniform_params(self.steps, work, self.rounding)(low, high, prescale_w)
        params = (prescale_w, *group_params, *hash_key(self.seed, step, key, flat.device))
        (codes,) = encode_rows(
            _uniform_encoder(self.steps, work, self.rounding),
            (flat,),
            params,
            group=group,
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
            group_params = _uniform_decode_params(self.steps, work)(low, high, scalar(prescale, work, low.device))
        decode = _uniform_decoder(work, like.dtype)
        params = (*group_params, scalar(1 / prescale, work, low.device))
        fast = native.uniform_decoder(self.bits) if fp32 else None
        return decode_rows(
            decode, ((packed, self.bits),), params, group=clamped_group(self.group, numel), numel=numel, native=fast
        ).view(like.shape)


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
        # Divided by a tensor: CUDA divides by a Python number as a multiplication by its
        # reciprocal, which can differ from the CPU's (and the native loop's) division.
        return low_w, (high_w - low_w) / torch.full((), steps, dtype=work, device=low.device), high_w

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
