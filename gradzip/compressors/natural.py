"""Natural compression: each value rounded stochastically to a power of two (see :mod:`.quant` for the shared wire layout)."""

from __future__ import annotations

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
    decode_rows,
    encode_rows,
)

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
    the smallest normal power; inf and NaN become the largest power of two, with their sign. Not aggregatable; no error feedback needed.

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
            empty = torch.empty(0, dtype=torch.uint8, device=flat.device)
            return Payload((empty, torch.empty(0, dtype=self.exponent_dtype(flat.dtype), device=flat.device)))
        encode = _natural_encoder(flat.dtype)
        signs, exponent = encode_rows(
            encode,
            (flat,),
            hash_key(self.seed, step, key, flat.device),
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
        # NaN's magnitude bits are clamped to inf's: above them the dither's sum could overflow
        # the integer into its sign, a negative exponent whose bits would spill into the codes
        # packed beside it.
        magnitude = (bits & ((1 << (mantissa_bits + exponent_bits)) - 1)).clamp(max=((1 << exponent_bits) - 1) << mantissa_bits)
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
