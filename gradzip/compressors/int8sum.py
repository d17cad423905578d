"""``int8``: 8-bit integer codes on a scale every rank shares, summed by a plain all_reduce.

The arithmetic (group scales, codes, decode); the two collectives are in
:mod:`gradzip.comm.int8sum`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch
from torch import Tensor

from gradzip.compressors import register
from gradzip.compressors.base import Compressor, Payload, check_int

#: int8's largest code: a sum over ``world_size`` ranks stays within it
INT8_MAX = 127


def levels_for(world_size: int) -> int:
    """Code levels each of ``world_size`` ranks may use, ``floor(127 / world_size)``, so that the
    int8 sum cannot overflow.

    Raises:
        ValueError: if ``world_size`` is not in [1, 127] (no level would be left).
    """
    if not 1 <= world_size <= INT8_MAX:
        raise ValueError(f"int8 sums codes over 1 to {INT8_MAX} ranks; world_size is {world_size}")
    return INT8_MAX // world_size


def group_scales(x: Tensor, group: int) -> Tensor:
    """``max |x|`` over each run of ``group`` elements of flat ``x`` (the last run may be
    shorter), fp32, ``ceil(numel / group)`` values."""
    # amax and amin apart, and no |x| of the whole tensor: aminmax along a dimension is several
    # times slower than both on the CPU
    rows = _grouped(x.float(), group)
    return torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg())


def rounded(x: Tensor, scale: float | Tensor, levels: int) -> Tensor:
    """``round(x / scale * levels)`` in fp32, within ``[-levels, levels]``, ``|x| <= scale``;
    ``scale`` is one number or a tensor that broadcasts against ``x`` (one per column, one per
    row of groups); a zero scale gives zeros."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    # x / scale first: levels / scale overflows for a scale below levels / 3.4e38, and 0 * inf
    # is NaN; a zero scale (a group of zeros) divides by 1
    safe = torch.where(scale > 0, scale, 1.0)
    return torch.div(x.float(), safe).mul_(levels).round_().clamp_(-levels, levels)


def to_codes(x: Tensor, scale: float | Tensor, levels: int) -> Tensor:
    """:func:`rounded` as int8 codes."""
    return rounded(x, scale, levels).to(torch.int8)


def from_codes(codes: Tensor, scale: float | Tensor, levels: int) -> Tensor:
    """``codes / levels * scale`` in fp32 (codes of any integer or floating dtype; ``scale`` as
    for :func:`to_codes`); dividing first keeps ``|result| <= scale`` wherever
    ``|codes| <= levels``, so a scale near the fp32 maximum does not overflow. Pass
    ``levels * world_size`` to turn summed codes into a mean. ``codes`` is never modified (an
    fp32 ``codes.float()`` would be ``codes`` itself, so the division makes the new tensor)."""
    return torch.div(codes.float(), levels).mul_(scale)


def _grouped(x: Tensor, group: int) -> Tensor:
    """Flat ``x`` as rows of ``group`` elements, the last padded with zeros (one row of all of
    ``x`` where ``group`` is larger: the padding never outgrows the tensor)."""
    flat = x.reshape(-1)
    group = max(1, min(group, flat.numel()))
    pad = (-flat.numel()) % group
    return (torch.cat([flat, flat.new_zeros(pad)]) if pad else flat).view(-1, group)


def group_codes(x: Tensor, scales: Tensor, levels: int, group: int) -> Tensor:
    """:func:`to_codes` of flat ``x`` with one scale per group: flat int8, ``x.numel()`` codes."""
    return group_rounded(x, scales, levels, group).to(torch.int8)


def group_rounded(x: Tensor, scales: Tensor, levels: int, group: int) -> Tensor:
    """:func:`rounded` of flat ``x`` with one scale per group: flat fp32, ``x.numel()`` values."""
    return rounded(_grouped(x, group), scales.reshape(-1, 1), levels).reshape(-1)[: x.numel()]


def group_values(codes: Tensor, scales: Tensor, levels: int, group: int) -> Tensor:
    """:func:`from_codes` of flat ``codes`` with one scale per group: flat fp32."""
    return from_codes(_grouped(codes, group), scales.reshape(-1, 1), levels).reshape(-1)[: codes.numel()]


@register
class Int8Sum(Compressor):
    """``int8``: integer codes on a scale every rank shares, so that ``all_reduce`` sums them.

    Source: the shared-scale integer aggregation of SwitchML (Sapio et al., "Scaling Distributed
    Machine Learning with In-Network Aggregation", NSDI 2021, arXiv 1903.06701): the workers
    agree on a scale per block, send integers, and integer addition sums them exactly. What
    differs: SwitchML sums 32-bit integers in a switch and agrees on the scale from the blocks'
    exponents; here 8-bit codes are summed by a plain ``all_reduce``, each rank using at most
    ``L = floor(127 / world_size)`` levels so the sum cannot overflow, and the scale of each
    group is the largest magnitude over every rank, agreed by an ``all_reduce`` MAX in the same
    step.

    The flat tensor is cut into groups of ``group`` elements (the last may be shorter). Round 1:
    ``all_reduce`` MAX of each group's ``max |x|`` (fp32). Round 2: ``all_reduce`` SUM of the
    codes ``round(x / s * L)`` (int8). Every rank decodes ``sum / (L * world_size) * s``: the
    mean of the ranks' quantized tensors, exactly (the sum of integers has no rounding), and
    bit-identical on every rank. Rounding to nearest errs by at most ``s / (2 L)`` per element;
    with ``error_feedback`` (the default) the residual keeps that error and sends it later.
    Biased per step (rounding; unbiased over steps with error feedback), aggregatable. Bytes per
    worker do not grow with the world size, but the precision does fall with it: ``L`` is 63
    at 2 ranks, 31 at 4, 15 at 8, 7 at 16 and 1 from 64 to 127; more than 127 ranks are refused.

    Args:
        group: elements per shared scale, an integer >= 1 (fp32 scales cost ``4 / group``
            bytes per element).
        error_feedback: keep what rounding dropped and add it to the next step's gradient.
        start_step: steps of plain all_reduce before compression starts (>= 0).

    Payload per flat tensor of ``numel`` elements: ``numel + 4 * ceil(numel / group)`` bytes
    (the codes and the scales), whatever the gradient's dtype; a tensor whose payload would not
    be smaller than its raw bytes travels dense. A lone payload (:meth:`compress`, one rank)
    uses all 127 levels.

    Raises:
        ValueError: naming the parameter, for ``group < 1`` or ``start_step < 0``; at reduce
            time, for more than 127 ranks.
    """

    name = "int8"
    host_reads = "the non-finite checks and whether the agreed scales are finite"
    aggregatable = True
    unbiased = False
    own_reducer = "gradzip.comm.int8sum:Int8SumReducer"  # the scales are agreed before the codes
    max_world_size = INT8_MAX

    def __init__(self, *, group: int = 256, error_feedback: bool = True, start_step: int = 0) -> None:
        super().__init__(group=group, error_feedback=error_feedback, start_step=start_step)
        self.group = check_int(group, name="group", low=1)
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be true or false; got {error_feedback!r}")
        self.error_feedback = error_feedback
        self.start_step = check_int(start_step, name="start_step", low=0)

    def n_scales(self, numel: int) -> int:
        """Scales of a flat tensor of ``numel`` elements: ``ceil(numel / group)``."""
        return math.ceil(numel / self.group)

    def payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """``numel + 4 * ceil(numel / group)``."""
        return numel + 4 * self.n_scales(numel)

    def compress(self, x: Tensor, *, step: int = 0, key: Hashable = 0) -> Payload:
        """One rank's payload ``(codes int8, scales fp32)`` at 127 levels."""
        scales = group_scales(x, self.group)
        return Payload((group_codes(x, scales, INT8_MAX, self.group), scales))

    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        """``codes / 127 * scale`` in ``like``'s shape and dtype."""
        codes, scales = payload.tensors
        out = group_values(codes, scales, INT8_MAX, self.group)
        limit = min(torch.finfo(like.dtype).max, torch.finfo(out.dtype).max)  # fp64: fp32's own
        return out.clamp_(-limit, limit).to(like.dtype).view(like.shape)
