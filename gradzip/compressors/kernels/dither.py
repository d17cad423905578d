"""Random dither for stochastic rounding, seeded from ``(seed, step, key)``.

Stochastic rounding needs one uniform number per element. The quantizers draw it from
:func:`hashed_dither`, a counter-based hash of the element's position and a key derived from
``(seed, step, key)``: integer operations that a compiled kernel computes inside its loop, so no
dither buffer is generated or read. Its 16 bits make the rounding probability exact to 2**-17
of a quantization step (the dither is centred in its 2**-16 grid), which the codecs document.
Every rank draws the same dither for the same ``(seed, step, key)``, as the single-process
reference (:func:`gradzip.comm.reference.simulate_ranks`) does, so distributed results equal it
exactly; the ranks' inputs differ, so their rounding decisions still differ.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor

from gradzip.compressors.base import seed_hash
from gradzip.compressors.kernels.placement import scalar


def _int32(value: int) -> int:
    """``value`` modulo 2**32 as a signed 32-bit integer."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


#: the hash's multipliers (Wellons' lowbias32 finaliser), as signed int32
_MIX1, _MIX2 = _int32(0x7FEB352D), _int32(0x846CA68B)


def hash_key(seed: int, step: int, key: Hashable, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """The two 32-bit words of :func:`seed_hash` for ``(seed, step, key)``, 0-d int32 tensors on
    ``device`` (filled there: a compiled kernel takes every input from its own device)."""
    h = seed_hash(seed, step, key)
    return scalar(_int32(h), torch.int32, device), scalar(_int32(h >> 32), torch.int32, device)


def hashed_dither(positions: Tensor, key_low: Tensor, key_high: Tensor) -> Tensor:
    """A uniform integer on ``[0, 2**16)`` per element position, from a counter-based hash.

    A 32-bit integer hash (the two-multiply finaliser "lowbias32" of C. Wellons' hash
    prospector) of ``position + key_low``, with ``key_high`` mixed in half way so that the
    streams of two keys are not shifts of one another; the high 16 bits of the result. Integer
    arithmetic only, wrapping modulo 2**32, so a compiled kernel that computes it inside its
    loop (no dither buffer in memory) gives the same integers as eager torch, on every rank.

    Args:
        positions: int32 tensor of element positions (any shape).
        key_low, key_high: 0-d int32 tensors from :func:`hash_key`.

    Returns:
        int32 tensor of ``positions``' shape.
    """
    h = positions + key_low
    # Logical shifts: int32 ``>>`` copies the sign bit, the mask clears what it copied.
    h = h ^ ((h >> 16) & 0xFFFF)
    h = (h * _MIX1) ^ key_high
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * _MIX2
    # The finaliser's last step, h ^ (h >>> 16), leaves the high 16 bits as they are, and
    # only those are returned: it is skipped (the same integers, three operations fewer).
    return (h >> 16) & 0xFFFF
