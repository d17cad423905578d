"""Low-rank codecs. PowerSGD needs two collective rounds, so its reducer lives in
:mod:`gradzip.comm.powersgd`; this module holds its parameters and payload formula."""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor

from gradzip.compressors import register
from gradzip.compressors.base import Compressor, Payload, check_int
from gradzip.compressors.int8sum import INT8_MAX
from gradzip.compressors.kernels import wire
from gradzip.compressors.values import shown


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

    Low-bit factors (``factor_bits=16``): ``P`` and ``Q`` travel as fp16, divided by world_size
    and saturated at the fp16 range before they are summed (in fp16), as PyTorch's
    ``fp16_compress_hook`` sends a gradient; uncompressed tensors keep the gradient's dtype. The
    residual is taken against this rank's fp16-rounded ``Q``, so what the wire rounds is fed back.
    Not in the paper, which sends fp32 factors; the low-rank and quantization families composed,
    as the seeds' hybrid compression describes. Values below fp16's subnormal range (about 6e-8
    after the division) flush to zero and are carried by the residual.

    ``factor_bits=8``: before each factor round an all_reduce MAX agrees on one fp32 scale per
    column of each factor, ``s_j = max over ranks of max_i |factor[i, j]|`` (a factor's columns
    carry magnitudes that follow the singular values, so one scale for the whole factor would
    leave the weaker columns few levels); each rank then sends ``round(factor[:, j] / s_j * L)``
    as int8 with ``L = floor(127 / world_size)`` levels, so the int8 sum of all ranks' codes
    cannot overflow, and every rank decodes ``sum[:, j] * s_j / L``. ``P``'s summed codes are
    orthogonalized as they are: a positive scale per column does not change the orthonormal basis
    QR returns. Bytes stay
    one per factor element at every world size; the price is resolution: each rank's factor is
    rounded to ``2 L + 1`` levels (127 at 2 ranks, 31 at 4, 15 at 8; world sizes above 127 are
    refused). Summing int8 codes in a wider integer type instead would keep 255 levels but send
    2 bytes per element, no fewer than fp16. The residual is taken against this rank's decoded
    codes. Each of the two factor rounds becomes two collectives (the MAX, then the codes). At
    equal bytes a higher rank at 8 bits can beat the paper's: on the demo job at 3 workers, rank
    16 at 8 bits (the bytes of rank 4 at 32) ended 0.5% above dense, rank 4 at 32 bits 3.0%
    (``benchmarks/results/remedies_main_job``).

    Args:
        approx_rank: rank of the approximation, an integer >= 1.
        start_step: steps of plain all_reduce before compression starts (>= 0).
        warm_start: reuse last step's ``Q`` as the start of the power iteration.
        seed: seed of the initial ``Q`` (drawn identically on every rank).
        factor_bits: 32 sends the factors in the gradient's own dtype (the paper); 16 sends them
            as fp16; 8 as int8 codes with shared scales.

    Payload per matrix: ``(n + m) * r * f`` bytes, ``f = itemsize(dtype)`` at ``factor_bits=32``,
    2 at ``factor_bits=16``, and 1 plus ``8 r`` bytes of scales (an fp32 per column of each
    factor) at ``factor_bits=8``;
    uncompressed tensors ``numel * itemsize(dtype)``. :meth:`payload_nbytes` takes a flat tensor, which travels
    uncompressed; :meth:`matrix_payload_nbytes` gives the matrix formula.

    Raises:
        ValueError: if ``approx_rank < 1``, ``start_step < 0`` or ``factor_bits`` is not 8, 16 or 32.
    """

    name = "powersgd"
    host_reads = "overflow checks of the factor products, the peak of P before QR and the non-finite checks"
    aggregatable = True
    error_feedback = True
    own_reducer = "gradzip.comm.powersgd:PowerSGDReducer"

    def __init__(
        self, *, approx_rank: int = 4, start_step: int = 0, warm_start: bool = True, seed: int = 0, factor_bits: int = 32
    ) -> None:
        super().__init__(
            approx_rank=approx_rank, start_step=start_step, warm_start=warm_start, seed=seed, factor_bits=factor_bits
        )
        self.approx_rank = check_int(approx_rank, name="approx_rank", low=1)
        self.start_step = check_int(start_step, name="start_step", low=0)
        if not isinstance(warm_start, bool):
            raise ValueError(f"warm_start must be true or false; got {shown(warm_start)}")
        self.warm_start = warm_start
        self.seed = check_int(seed, name="seed", low=0)
        self.factor_bits = wire.check_bits(factor_bits, allowed=(8, 16, 32), name="factor_bits")

    @property
    def max_world_size(self) -> int | None:
        """127 with 8-bit factors (their int8 codes are summed), else no limit."""
        return INT8_MAX if self.factor_bits == 8 else None

    def factor_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype ``P`` and ``Q`` travel in for a gradient of ``dtype``."""
        return {8: torch.int8, 16: torch.float16}.get(self.factor_bits, dtype)

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
        if not self.compresses(shape):
            numel = 1
            for d in shape:
                numel *= d
            return numel * wire.dtype_nbytes(dtype)
        n, m = matrix_view_shape(shape)
        r = self.effective_rank(n, m)
        scales = 8 * r if self.factor_bits == 8 else 0
        return (n + m) * r * wire.dtype_nbytes(self.factor_dtype(dtype)) + scales

    def payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return numel * wire.dtype_nbytes(dtype)

    def compress(self, x: Tensor, *, step: int = 0, key: Hashable = 0) -> Payload:
        raise TypeError("powersgd takes two collective rounds; use gradzip.comm.make_reducer")

    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        raise TypeError("powersgd takes two collective rounds; use gradzip.comm.make_reducer")
