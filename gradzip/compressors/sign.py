"""Sign codecs: one bit per element plus one scale.

Both send ``sign(x)`` packed eight to a byte and the scale ``||x||_1 / n`` (the mean magnitude),
and decode ``scale * sign(x)``. An exact zero (either sign of zero) is sent as +1, since one bit
has room for two signs only: it decodes to ``+scale``. An all-zero tensor has scale 0 and decodes
to exact zeros.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch
from torch import Tensor

from gradzip import wire
from gradzip.compressors import register
from gradzip.compressors.base import Compressor, Payload
from gradzip.compressors.elementwise import at_least, pack_flags

#: elements summed per step (1 MiB of fp32: stays in cache)
SUM_CHUNK = 1 << 18


def mean_magnitude(flat: Tensor) -> Tensor:
    """``||x||_1 / n`` as a ``(1,)`` tensor in ``flat``'s dtype, 0 for an empty tensor.

    Summed in fp32 (fp64 for fp64 input) over cache-sized chunks, the chunk sums in fp64; a
    chunk sum that overflows fp32 (values near its top) is redone in fp64. The mean is at most the largest magnitude,
    so it is finite in the input dtype.
    """
    numel = flat.numel()
    if numel == 0:
        return flat.new_zeros(1)
    wide = torch.float64 if flat.dtype == torch.float64 else torch.float32
    chunk = min(SUM_CHUNK, numel)
    magnitude = torch.empty(chunk, dtype=wide, device=flat.device)
    total = 0.0
    for start in range(0, numel, chunk):
        part = magnitude[: min(chunk, numel - start)]
        part.copy_(flat[start : start + part.numel()]).abs_()
        partial = float(part.sum())
        if not math.isfinite(partial):
            partial = float(part.sum(dtype=torch.float64))
        total += partial
    total = torch.tensor(total, dtype=torch.float64)
    # Rounding in the sum can put the mean a hair above the largest finite value of a half dtype.
    return (total / numel).clamp(max=torch.finfo(flat.dtype).max).to(flat.dtype).reshape(1)


class _ScaledSign(Compressor):
    def __init__(self) -> None:
        super().__init__()

    def payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """``ceil(n / 8) + itemsize(dtype)``."""
        return wire.packed_nbytes(numel, 1) + wire.dtype_nbytes(dtype)

    def compress(self, x: Tensor, *, step: int = 0, key: Hashable = 0) -> Payload:
        """Args: x of any shape and floating dtype. Returns: ``Payload((sign bits, scale (1,)))``."""
        flat = x.reshape(-1)
        # NaN compares false either way; ``>= 0`` sends both zeros as +1.
        return Payload((pack_flags(at_least(flat, 0)), mean_magnitude(flat)))

    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        """Returns: ``+scale`` where the bit is 1, ``-scale`` where it is 0, shaped as ``like``."""
        packed, scale = payload.tensors
        scale = scale.to(like.dtype).reshape(1)
        return wire.unpack_lookup(packed, 1, like.numel(), torch.cat([-scale, scale])).view(like.shape)


@register
class SignSGD(_ScaledSign):
    """signSGD: the sign of each element, scaled by the mean magnitude (``signsgd``).

    Source: Bernstein, Wang, Azizzadenesheli & Anandkumar, "signSGD: Compressed Optimisation
    for Non-Convex Problems" (ICML 2018, arXiv 1802.04434). Each rank sends ``sign(x)`` (1 bit
    per element, zero sent as +1) and ``||x||_1 / n``; the reducer averages the decoded
    ``scale * sign(x)`` over ranks (the paper's majority vote would take the sign of the sum of
    signs instead). Biased; not aggregatable; no error feedback (see ``efsignsgd``).

    Shapes and dtypes: any shape, fp16, bf16, fp32 or fp64 in. Payload tensors: sign bits
    ``(ceil(n / 8),)`` uint8, the scale ``(1,)`` in the input dtype. Payload: ``ceil(n / 8) +
    itemsize(dtype)`` bytes.
    """

    name = "signsgd"


@register
class EFSignSGD(_ScaledSign):
    """EF-signSGD: scaled sign with error feedback (``efsignsgd``).

    Source: Karimireddy, Rebjock, Stich & Jaggi, "Error Feedback Fixes SignSGD and other
    Gradient Compression Schemes" (ICML 2019, arXiv 1901.09847). Compresses ``p = g + e`` to
    ``(||p||_1 / n) * sign(p)`` (zero sent as +1) and keeps ``e = p - that`` as the residual;
    the reducer averages the decoded tensors. Biased; not aggregatable; error feedback on.

    Shapes, dtypes and payload: as ``signsgd``, ``ceil(n / 8) + itemsize(dtype)`` bytes.
    """

    name = "efsignsgd"
    error_feedback = True
