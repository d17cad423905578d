"""The multiple-choice knapsack that splits a byte budget across layers.

Each layer ``l`` must take exactly one of its candidates ``c``, which costs ``weights[l][c]``
(bytes, as integers) and leaves ``errors[l][c]`` (a compression error, any unit); the choice
minimises ``sum_l errors[l][c_l]`` subject to ``sum_l weights[l][c_l] <= capacity``. This is the
problem L-GreCo (Markov et al., "L-GreCo: Layerwise-Adaptive Gradient Compression for Efficient
and Accurate Deep Learning", MLSys 2024, arXiv 2210.17357) solves by dynamic programming over a
discretised budget, and Kimad+ (Xin et al., arXiv 2312.08053) uses to split a step's byte
budget across layers.

:func:`solve` is that dynamic programme: ``O(layers * candidates * capacity)`` time in numpy,
``O(layers * capacity)`` memory for the back-pointers. Exact for integer weights; callers
discretise byte counts into ``capacity`` units first (:func:`discretise`, rounding each weight up
so a solution within the discretised budget is within the real one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def solve(errors: Sequence[Sequence[float]], weights: Sequence[Sequence[int]], capacity: int) -> list[int] | None:
    """The candidate per layer with the least summed error within ``capacity``.

    Args:
        errors: per layer, one finite number per candidate.
        weights: per layer, one integer >= 0 per candidate (same shape as ``errors``).
        capacity: the budget, an integer >= 0.

    Returns:
        the chosen candidate index per layer; among equal summed errors the one with the smaller
        summed weight, then the earlier candidate of the last layers. None if no choice fits
        (even the lightest candidate of every layer exceeds ``capacity``). ``[]`` for no layers.

    Raises:
        ValueError: for mismatched shapes, a layer without candidates, a negative or
            non-integer weight or capacity, or a non-finite error.
    """
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 0:
        raise ValueError(f"capacity must be an integer >= 0; got {capacity!r}")
    if len(errors) != len(weights):
        raise ValueError(f"errors and weights must list the same layers; got {len(errors)} and {len(weights)}")
    capacity = int(capacity)
    inf = math.inf
    # best[b]: least summed error of the layers so far with summed weight exactly b
    best = np.full(capacity + 1, inf)
    best[0] = 0.0
    back = []
    for layer, (errs, wts) in enumerate(zip(errors, weights)):
        if len(errs) == 0 or len(errs) != len(wts):
            raise ValueError(f"layer {layer} needs one weight per error and at least one candidate")
        new = np.full(capacity + 1, inf)
        pick = np.full(capacity + 1, -1, dtype=np.int32)
        for c, (err, w) in enumerate(zip(errs, wts)):
            if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 0:
                raise ValueError(f"weights must be integers >= 0; got {w!r} (layer {layer}, candidate {c})")
            if not math.isfinite(err):
                raise ValueError(f"errors must be finite; got {err!r} (layer {layer}, candidate {c})")
            w = int(w)
            if w > capacity:
                continue
            cand = np.full(capacity + 1, inf)
            cand[w:] = best[: capacity + 1 - w] + err
            better = cand < new  # strict: the earlier candidate keeps ties
            new[better] = cand[better]
            pick[better] = c
        best = new
        back.append(pick)
    if not back:
        return []
    finite = np.isfinite(best)
    if not finite.any():
        return None
    # least error; among ties the smallest total weight (argmin returns the first)
    lowest = best[finite].min()
    b = int(np.flatnonzero(best == lowest)[0])
    choice = [0] * len(back)
    for layer in range(len(back) - 1, -1, -1):
        c = int(back[layer][b])
        choice[layer] = c
        b -= int(weights[layer][c])
    return choice


def discretise(weights: Sequence[Sequence[float]], budget: float, units: int) -> tuple[list[list[int]], int]:
    """Byte weights and a byte budget as integers for :func:`solve`: ``units`` units span the
    budget, each weight rounded up (a choice within the integer capacity is within ``budget``).

    Args:
        weights: per layer, bytes per candidate (>= 0).
        budget: bytes, > 0.
        units: resolution, an integer >= 1 (L-GreCo's discretisation; 1000 resolves a budget to 0.1%).

    Returns:
        ``(integer weights, capacity)`` with capacity ``units``.
    """
    if not budget > 0 or not math.isfinite(budget):
        raise ValueError(f"budget must be a finite number > 0; got {budget!r}")
    unit = budget / units
    return [[math.ceil(w / unit - 1e-9) for w in layer] for layer in weights], units
