"""Casts: the identity and half-precision codecs. All aggregatable and deterministic."""

from __future__ import annotations

from collections.abc import Hashable
from typing import ClassVar

import torch
from torch import Tensor

from gradzip.compressors import register
from gradzip.compressors.base import Compressor, Payload
from gradzip.compressors.kernels import wire


@register
class Identity(Compressor):
    """No compression: the tensor itself travels (``none``).

    With the all_reduce reducer this equals PyTorch's ``allreduce_hook`` bit for bit.
    Unbiased, aggregatable. Payload: ``numel * itemsize(dtype)`` bytes.
    """

    name = "none"
    aggregatable = True
    unbiased = True

    def __init__(self) -> None:
        super().__init__()

    def compress(self, x: Tensor, *, step: int = 0, key: Hashable = 0) -> Payload:
        """Args: x of any shape and floating dtype. Returns: ``Payload((x.reshape(-1),))``."""
        return Payload((x.reshape(-1),))

    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        """Returns: ``payload.tensors[0]`` shaped and typed as ``like``."""
        return payload.tensors[0].reshape(like.shape).to(like.dtype)

    def payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """``numel * itemsize(dtype)``."""
        return numel * wire.dtype_nbytes(dtype)


class _Cast(Compressor):
    wire_dtype: ClassVar[torch.dtype]
    aggregatable = True
    unbiased = False

    def __init__(self) -> None:
        super().__init__()

    def compress(self, x: Tensor, *, step: int = 0, key: Hashable = 0) -> Payload:
        out = x.reshape(-1).to(self.wire_dtype)
        if x.dtype != self.wire_dtype and out.numel():
            # Saturate instead of overflowing: a finite value past the wire range must not
            # become inf (inf in the input saturates too; NaN stays NaN).
            limit = torch.finfo(self.wire_dtype).max
            out.nan_to_num_(nan=float("nan"), posinf=limit, neginf=-limit)
        return Payload((out,))

    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        wire_tensor = payload.tensors[0]
        out = wire_tensor.reshape(like.shape).to(like.dtype)
        limit = torch.finfo(like.dtype).max
        if limit < torch.finfo(wire_tensor.dtype).max:
            # A new tensor here. bf16 rounds fp16's maximum up past it: saturate, not inf.
            out.nan_to_num_(nan=float("nan"), posinf=limit, neginf=-limit)
        return out

    def payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        # An input already at (or below) the wire width travels as it is.
        if wire.dtype_nbytes(dtype) <= wire.dtype_nbytes(self.wire_dtype):
            return numel * wire.dtype_nbytes(dtype)
        return numel * wire.dtype_nbytes(self.wire_dtype)


@register
class FP16(_Cast):
    """Cast to IEEE half precision (``fp16``) for the wire, back to the input dtype after.

    Equals PyTorch's ``fp16_compress_hook`` bit for bit (cast, divide by world_size, all_reduce)
    for values within fp16's range. Biased only by rounding (relative error <= 2**-11 for normal
    values); values beyond +-65504 saturate at +-65504 instead of overflowing to inf, and the
    reducer divides by world_size before summing. Aggregatable.
    Payload: ``2 * numel`` bytes (an fp16 input: the same).
    """

    name = "fp16"
    wire_dtype = torch.float16


@register
class BF16(_Cast):
    """Cast to bfloat16 (``bf16``) for the wire, back to the input dtype after.

    Equals PyTorch's ``bf16_compress_hook`` for values within bf16's range. About the range of
    fp32, 8 bits of mantissa (relative error <= 2**-8); the few fp32 values past bf16's largest
    finite value (about 3.39e38) saturate there instead of rounding to inf. Aggregatable.
    Payload: ``2 * numel`` bytes.
    """

    name = "bf16"
    wire_dtype = torch.bfloat16
