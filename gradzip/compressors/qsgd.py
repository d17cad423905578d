"""QSGD: stochastic quantization to ``2**bits - 1`` levels per bucket scale (see :mod:`.quant` for the shared wire layout)."""

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
    abs_max_rows,
    decode_rows,
    encode_rows,
    reduce_rows,
)
from gradzip.compressors.quant import (
    NORMS,
    _fits_fp32,
    check_choice,
    compute_dtype,
    grouped,
)


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

    A ``bucket`` larger than the tensor is clamped to its size (one bucket): buffers follow the
    tensor, not the parameter.

    Shapes and dtypes: any shape, fp16, bf16, fp32 or fp64 in. Payload tensors: signs
    ``(ceil(n / 8),)`` uint8, levels ``(ceil(n * bits / 8),)`` uint8, scales ``(ceil(n /
    bucket),)`` in the input dtype for ``norm=max``, fp32 (fp64 for fp64 input) for ``l2``.
    Payload: ``ceil(n / 8) + ceil(n * bits / 8) + ceil(n / bucket) * itemsize(scale)`` bytes.

    Raises:
        ValueError: if ``bits`` is not 1, 2, 4 or 8, ``bucket < 1``, ``norm`` is not max or
            l2, or ``seed < 0``.
    """

    name = "qsgd"
    host_reads = "the range of the bucket scales, which picks fp32 or fp64 arithmetic"
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
        """``ceil(n / 8) + ceil(n * bits / 8) + ceil(n / bucket) * itemsize(scale)``, ``bucket``
        clamped to ``n`` as the codec uses it (the same count of buckets)."""
        buckets = -(-numel // clamped_group(self.bucket, numel))
        return (
            wire.packed_nbytes(numel, 1)
            + wire.packed_nbytes(numel, self.bits)
            + buckets * wire.dtype_nbytes(self.scale_dtype(dtype))
        )

    def _scales(self, flat: Tensor, bucket: int) -> Tensor:
        if self.norm == "max":
            return reduce_rows(abs_max_rows, flat, group=bucket)[0]
        parts = [torch.linalg.vector_norm(view, dim=1, dtype=torch.float64) for _offset, view in grouped(flat, bucket)]
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
        keys = hash_key(self.seed, step, key, flat.device)
        bucket = clamped_group(self.bucket, numel)
        if flat.dtype == torch.float32 and self.norm == "max":
            # fp32 arithmetic assumed: scales, parameters and codes in one loop over the
            # tensor; kept unless the scales need fp64.
            signs, levels, scales = encode_rows(
                _qsgd_encoder(self.levels, torch.float32),
                (flat,),
                keys,
                group=bucket,
                out_bits=(1, self.bits),
                with_positions=True,
                row_stats=(_abs_max_column, _qsgd_params(self.levels, torch.float32)),
                native=native.qsgd_encoder(self.levels, self.bits),
            )
            if _fits_fp32(scales, low=self.levels * 2.0**-100):
                return Payload((signs, levels, scales))
        scales = self._scales(flat, bucket)
        work = compute_dtype(flat.dtype)
        if work == torch.float32 and not _fits_fp32(scales, low=self.levels * 2.0**-100):
            work = torch.float64
        params = _qsgd_params(self.levels, work)(scales, *keys)
        signs, levels = encode_rows(
            _qsgd_encoder(self.levels, work), (flat,), params, group=bucket, out_bits=(1, self.bits), with_positions=True
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
        values = decode_rows(decode, codes, (scales.to(work),), group=clamped_group(self.bucket, numel), numel=numel, native=fast)
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
