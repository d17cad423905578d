"""Random dither for stochastic rounding, seeded from ``(seed, step, key)``.

Stochastic rounding needs one uniform number per element. ``torch.rand`` with a
``torch.Generator`` (Mersenne Twister, one call per element) costs several elementwise passes
on CPU; NumPy's SFC64 bit generator yields 64 random bits per call, cut here into four 16-bit
dither values, at a fraction of that cost. The rounding probability is then exact to 2**-17
of a quantization step (the dither is centred in its 2**-16 grid), which the codecs document.

Every rank draws the same dither for the same ``(seed, step, key)``, as the single-process
reference (:func:`gradzip.comm.simulate.simulate_ranks`) does, so distributed results equal it
exactly; the ranks' inputs differ, so their rounding decisions still differ.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import torch
from torch import Tensor

from gradzip.compressors.base import seed_hash
from gradzip.compressors.elementwise import offset_cast_into

#: dither values per 64 random bits
_PER_DRAW = 4


def dither_source(seed: int, step: int, key: Hashable) -> np.random.Generator:
    """A NumPy generator for ``(seed, step, key)``; never a global RNG."""
    return np.random.Generator(np.random.SFC64(seed_hash(seed, step, key)))


def dither_int16(source: np.random.Generator, numel: int) -> Tensor:
    """``numel`` independent integers uniform on ``[-2**15, 2**15)``, int16, shape ``(numel,)``."""
    draws = source.bit_generator.random_raw(-(-numel // _PER_DRAW))
    return torch.from_numpy(draws.view(np.int16)[:numel])


def dither_units(source: np.random.Generator, numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """A uniform dither in units of ``2**-16``: values ``j + 0.5``, ``j`` uniform on ``0 .. 2**16 - 1``.

    Codecs add it to ``2**16 * y`` (``y >= 0``) and truncate ``2**-16`` times the sum, which
    rounds ``y`` up with probability ``frac(y)`` to within ``2**-17``: stochastic rounding with
    no separate pass to scale the dither.

    Returns:
        tensor of shape ``(numel,)`` and ``dtype`` (float32 or float64).
    """
    out = torch.empty(numel, dtype=dtype)
    return offset_cast_into(dither_int16(source, numel), 2**15 + 0.5, out)
