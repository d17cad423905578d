"""Low-rank codecs. PowerSGD needs two collective rounds, so its reducer lives in
:mod:`gradzip.comm.powersgd`; this module holds its parameters and payload formula."""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor

from gradzip.compressors import register
from gradzip.compressors.base import Compressor, Payload, check_int
from gradzip.compressors.kernels import wire


def matrix_view_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int] | None:
    """The 2-D view PowerSGD compresses: ``(shape[0], prod(shape[1:]))``; None for 0-D and 1-D."""
    if len(shape) < 2:
        return None
    n = shape[0]
    m = 1
    for d in shape[1:]:
        m *= d
    return n, m


@register
class PowerSGD(Compressor):
    """PowerSGD: rank-``r`` approximation by one step of subspace iteration per training step.

    Source: Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
    Distributed Optimization" (NeurIPS 2019, arXiv 1905.13727). Biased; aggregatable per round
    (both factors are all_reduce-d); used with error feedback.

    Each gradient of 2 or more dims is viewed as an ``n x m`` matrix ``M`` (``m`` the product of
    the trailing dims). Round 1 all_reduces ``P = M Q`` (``n x r``), which is orthogonalized in
    fp32; round 2 all_reduces ``Q = M^T P`` (``m x r``); the result is ``P Q^T / world_size``.
    ``r = min(approx_rank, n, m)``. Matrices where ``(n + m) * r >= n * m`` and all 1-D tensors
    travel uncompressed in round 1.

    Args:
        approx_rank: rank of the approximation, an integer >= 1.
        start_step: steps of plain all_reduce before compression starts (>= 0).
        warm_start: reuse last step's ``Q`` as the start of the power iteration.
        seed: seed of the initial ``Q`` (drawn identically on every rank).

    Payload per matrix: ``(n + m) * r * itemsize(dtype)`` bytes; uncompressed tensors
    ``numel * itemsize(dtype)``. :meth:`payload_nbytes` takes a flat tensor, which travels
    uncompressed; :meth:`matrix_payload_nbytes` gives the matrix formula.

    Raises:
        ValueError: if ``approx_rank < 1`` or ``start_step < 0``.
    """

    name = "powersgd"
    aggregatable = True
    error_feedback = True
    multi_round = True

    def __init__(self, *, approx_rank: int = 4, start_step: int = 0, warm_start: bool = True, seed: int = 0) -> None:
        super().__init__(approx_rank=approx_rank, start_step=start_step, warm_start=warm_start, seed=seed)
        self.approx_rank = check_int(approx_rank, name="approx_rank", low=1)
        self.start_step = check_int(start_step, name="start_step", low=0)
        if not isinstance(warm_start, bool):
            raise ValueError(f"warm_start must be true or false; got {warm_start!r}")
        self.warm_start = warm_start
        self.seed = check_int(seed, name="seed", low=0)

    def effective_rank(self, n: int, m: int) -> int:
        """``min(approx_rank, n, m)``."""
        return min(self.approx_rank, n, m)

    def compresses(self, shape: torch.Size | tuple[int, ...]) -> bool:
        """Whether a gradient of ``shape`` is sent as factors (else uncompressed)."""
        view = matrix_view_shape(shape)
        if view is None:
            return False
        n, m = view
        r = self.effective_rank(n, m)
        return (n + m) * r < n * m

    def matrix_payload_nbytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        """Bytes sent for one gradient of ``shape``: factors if it compresses, else dense."""
        item = wire.dtype_nbytes(dtype)
        if not self.compresses(shape):
            numel = 1
            for d in shape:
                numel *= d
            return numel * item
        n, m = matrix_view_shape(shape)
        return (n + m) * self.effective_rank(n, m) * item

    def payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return numel * wire.dtype_nbytes(dtype)

    def compress(self, x: Tensor, *, step: int = 0, key: Hashable = 0) -> Payload:
        raise TypeError("powersgd takes two collective rounds; use gradzip.comm.make_reducer")

    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        raise TypeError("powersgd takes two collective rounds; use gradzip.comm.make_reducer")
