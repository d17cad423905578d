"""SEPARATE: a shared Gaussian random projection whose payloads all_reduce sums.

Source: Zhao, Xie, Fang & Lin, "SEPARATE: A Simple Low-rank Projection for Gradient Compression
in Modern Large-scale Model Training Process" (ICLR 2025, OpenReview 8HuLgtjqOD).

This module holds the arithmetic (the projection, encode, decode, the moving-average error
feedback rule) and no communication; the one-round reducer that sends a bucket of gradients is
:mod:`gradzip.comm.separate`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator

import torch
from torch import Tensor

from gradzip.compressors import register
from gradzip.compressors.base import Compressor, Payload, check_int, seeded_generator
from gradzip.compressors.kernels import wire
from gradzip.compressors.kernels.placement import to_device
from gradzip.compressors.lowrank import matrix_view_shape

#: rows of the projection drawn at a time: A is never held whole, so its memory stays
#: ``BLOCK_ROWS * r`` floats however wide the matrix, and each block is drawn from its own
#: generator, seeded from (seed, step, (key, block)), so encode and decode redraw it alike.
BLOCK_ROWS = 2048


def projection_blocks(
    seed: int, step: int, key: Hashable, n: int, r: int, device: torch.device | str = "cpu"
) -> Iterator[tuple[int, Tensor]]:
    """The projection ``A`` (``n x r``, fp32, i.i.d. ``N(0, 1/r)``) in row blocks.

    ``E[A A^T] = I_n``, which makes ``G A A^T`` an unbiased estimate of ``G``. Drawn on the host
    on purpose (the same ``A`` on every device) and copied to ``device`` without blocking.

    Yields:
        ``(start, block)``: rows ``start .. start + len(block)`` of ``A``, each block
        ``min(BLOCK_ROWS, n - start) x r``, identical on every rank for the same arguments.
    """
    scale = 1.0 / math.sqrt(r)
    for index, start in enumerate(range(0, n, BLOCK_ROWS)):
        rows = min(BLOCK_ROWS, n - start)
        gen = seeded_generator(seed, step, (key, index))
        yield start, to_device(torch.randn(rows, r, generator=gen, dtype=torch.float32).mul_(scale), device)


def project(mat: Tensor, seed: int, step: int, key: Hashable, r: int) -> Tensor:
    """``mat @ A``: ``mat`` is ``m x n`` fp32; returns ``m x r`` fp32. Where fp32 overflows (a
    finite input near the fp32 range), recomputed in float64 and saturated at the fp32 range."""
    m, n = mat.shape
    out = torch.zeros(m, r, dtype=torch.float32, device=mat.device)
    for start, block in projection_blocks(seed, step, key, n, r, mat.device):
        # (A_blk^T M_blk^T)^T: CPU GEMM is much faster with the narrow operand on the left.
        out += (block.T @ mat[:, start : start + block.shape[0]].T).T
    if _finite(out) or not _finite(mat):
        return out
    wide = torch.zeros(m, r, dtype=torch.float64, device=mat.device)
    for start, block in projection_blocks(seed, step, key, n, r, mat.device):
        wide += mat[:, start : start + block.shape[0]].double() @ block.double()
    return _saturated(wide, torch.float32)


def lift(payloads: Tensor, n: int, seed: int, step: int, key: Hashable, out: Tensor) -> Tensor:
    """``payloads @ A^T`` written into ``out`` (``k x n``, any floating dtype); ``payloads`` is
    ``k x r`` fp32. Several payloads stacked (the mean and the local one) share one draw of A.
    Blocks that overflow ``out``'s dtype are recomputed in float64 and saturated."""
    for start, block in projection_blocks(seed, step, key, n, payloads.shape[1], payloads.device):
        piece = out[:, start : start + block.shape[0]]
        piece.copy_(payloads @ block.T)
        if not _finite(piece) and _finite(payloads):
            piece.copy_(_saturated(payloads.double() @ block.double().T, out.dtype))
    return out


def _finite(t: Tensor) -> bool:
    return t.numel() == 0 or bool(torch.isfinite(t).all())


def _saturated(t: Tensor, dtype: torch.dtype) -> Tensor:
    limit = torch.finfo(dtype).max
    return t.clamp(-limit, limit).to(dtype)


def moving_average_error(previous: Tensor | None, compensated: Tensor, decoded: Tensor, beta: float) -> Tensor:
    """The new error memory ``e' = beta * e + (1 - beta) * (c - D(C(c)))`` (fp32).

    Args:
        previous: ``e`` (None: zeros).
        compensated: ``c = g + e``, the tensor that was encoded.
        decoded: ``D(C(c))``, this rank's own decode of it.
        beta: the moving-average weight in [0, 1).
    """
    error = compensated.float() - decoded.float()
    if previous is not None and beta != 0.0:
        error.mul_(1.0 - beta).add_(previous, alpha=beta)
    else:
        error.mul_(1.0 - beta)
    # Near the fp32 range the difference can overflow; the memory stays finite.
    limit = torch.finfo(torch.float32).max
    return error.clamp_(-limit, limit)


@register
class Separate(Compressor):
    """SEPARATE: ``G A`` with a shared Gaussian ``A``, summed by all_reduce, decoded ``mean(G A) A^T``.

    Source: Zhao, Xie, Fang & Lin, "SEPARATE: A Simple Low-rank Projection for Gradient Compression
    in Modern Large-scale Model Training Process" (ICLR 2025, OpenReview 8HuLgtjqOD).

    Each gradient of 2 or more dims is viewed as an ``m x n`` matrix ``G`` (``n`` the product of
    the trailing dims, as PowerSGD views it). ``A`` (``n x r``, fp32, i.i.d. ``N(0, 1/r)``) is
    drawn from a generator seeded from ``(seed, step, key)`` on every rank, in row blocks of
    :data:`BLOCK_ROWS`, so it is never sent and never held whole. Each rank sends
    ``G_i A / world_size`` (``m x r``, in the gradient's dtype); one all_reduce sums them; every
    rank decodes ``(sum_i G_i A / world_size) A^T``. ``r = min(approx_rank, n)``; matrices with
    ``r >= n`` and all 1-D tensors travel uncompressed in the same all_reduce.

    Unbiased: ``E_A[G A A^T] = G`` over the draw of ``A`` (fresh each step), with variance
    ``E||G A A^T - G||^2 = ((n + 1) / r) ||G||^2`` for Gaussian ``A``. Aggregatable: the decode is
    linear in the payload, so the sum of payloads decodes to the sum of the (compensated) inputs'
    projections, bit-identical on every rank.

    Error feedback (moving average): ``c = g + e``, ``e' = ef_beta * e + (1 - ef_beta) * (c - c A A^T)``,
    kept per gradient in fp32. With ``ef_beta = 0`` it is plain error feedback; for an unbiased
    compressor of relative variance ``w = (n + 1) / r`` the memory stays bounded in expectation
    when ``ef_beta^2 + (1 - ef_beta)^2 w < 1``; the default 0.99 holds that for ``w`` below 199.
    What differs from the paper: the paper's exact moving-average rule and its constants could not
    be read here (its text was not in the reference corpus); the rule above is this library's
    reading of "moving-average error feedback", with ``ef_beta`` a parameter. ``A`` is drawn
    blockwise (the paper draws it whole); the values are the same distribution.

    Drawing ``A`` costs ``n r`` Gaussian samples per matrix per encode and again per decode,
    against ``m n r`` multiply-adds for ``G A``. Measured on one CPU thread at ``r = 4``
    (``benchmarks/separate_projection.py``, medians, rows interleaved): the draw took 1.27x the
    product for a 64 x 4096 matrix, 0.36x at 256 x 4096, 0.12x at 768 x 3072 and 0.03x at
    3072 x 768; only matrices of a few dozen rows pay more to draw ``A`` than to apply it.

    Args:
        approx_rank: ``r``, columns of the projection, an integer >= 1.
        ef_beta: weight of the old error in the moving average, a number in [0, 1).
        seed: seed of the projection, an integer >= 0 (the same on every rank).
        start_step: steps of plain all_reduce before compression starts (>= 0).

    Payload per matrix: ``m * r * itemsize(dtype)`` bytes; uncompressed tensors
    ``numel * itemsize(dtype)``. :meth:`payload_nbytes` takes a flat tensor, which travels
    uncompressed; :meth:`matrix_payload_nbytes` gives the matrix formula.

    Raises:
        ValueError: if ``approx_rank < 1``, ``ef_beta`` is not in [0, 1), ``seed < 0`` or
            ``start_step < 0``.
    """

    name = "separate"
    host_reads = "overflow checks of the projections and the non-finite checks"
    aggregatable = True
    unbiased = True
    needs_shared_seed = True
    error_feedback = True
    own_reducer = "gradzip.comm.separate:SeparateReducer"  # it needs the bucket's per-gradient shapes

    def __init__(self, *, approx_rank: int = 4, ef_beta: float = 0.99, seed: int = 0, start_step: int = 0) -> None:
        super().__init__(approx_rank=approx_rank, ef_beta=ef_beta, seed=seed, start_step=start_step)
        self.approx_rank = check_int(approx_rank, name="approx_rank", low=1)
        if isinstance(ef_beta, bool) or not isinstance(ef_beta, (int, float)) or not 0.0 <= ef_beta < 1.0:
            raise ValueError(f"ef_beta must be a number in [0, 1); got {ef_beta!r}")
        self.ef_beta = float(ef_beta)
        self.seed = check_int(seed, name="seed", low=0)
        self.start_step = check_int(start_step, name="start_step", low=0)

    def effective_rank(self, n: int) -> int:
        """``min(approx_rank, n)``."""
        return min(self.approx_rank, n)

    def compresses(self, shape: torch.Size | tuple[int, ...]) -> bool:
        """Whether a gradient of ``shape`` is sent projected (else uncompressed): 2 or more dims
        and ``r < n``."""
        view = matrix_view_shape(shape)
        return view is not None and self.effective_rank(view[1]) < view[1]

    def matrix_payload_nbytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        """Bytes sent for one gradient of ``shape``: ``m r`` elements if it compresses, else dense."""
        item = wire.dtype_nbytes(dtype)
        if not self.compresses(shape):
            return math.prod(shape) * item
        m, n = matrix_view_shape(shape)
        return m * self.effective_rank(n) * item

    def payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return numel * wire.dtype_nbytes(dtype)

    def encode(self, mat: Tensor, *, step: int, key: Hashable) -> Tensor:
        """``mat @ A`` (``m x r`` fp32) for an ``m x n`` matrix that :meth:`compresses`."""
        return project(mat.float(), self.seed, step, key, self.effective_rank(mat.shape[1]))

    def decode(self, payloads: Tensor, n: int, *, step: int, key: Hashable, out: Tensor) -> Tensor:
        """``payloads @ A^T`` into ``out`` (``k x n``); ``payloads`` is ``k x r``."""
        return lift(payloads.float(), n, self.seed, step, key, out)

    def compress(self, x: Tensor, *, step: int = 0, key: Hashable = 0) -> Payload:
        raise TypeError("separate projects each gradient of a bucket by its shape; use gradzip.comm.make_reducer")

    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        raise TypeError("separate projects each gradient of a bucket by its shape; use gradzip.comm.make_reducer")
