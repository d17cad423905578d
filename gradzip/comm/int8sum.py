"""The ``int8`` reducer: a scale per group agreed by every rank, then int8 codes summed
(arithmetic in :mod:`gradzip.compressors.int8sum`).

For one bucket at a step past ``start_step`` whose payload is smaller than its raw bytes, two
collectives, the second launched when the first has finished:

1. Error-compensate the flat bucket in fp32 (with ``error_feedback``); ``all_reduce`` MAX of
   each group's ``max |x|`` (fp32, ``ceil(numel / group)`` values).
2. Codes ``round(x / s * L)``, ``L = floor(127 / world_size)``, as int8; ``all_reduce`` SUM.
   The residual keeps ``x - codes / L * s``, what this rank's rounding dropped.
3. Every rank decodes ``sum / (L * world_size) * s``, the same bits everywhere.

Bytes each rank hands to the collectives: ``4 ceil(numel / group)`` and ``numel``; on the wire
each is an all_reduce (``2 (W - 1) / W`` times its size on a ring), so bytes per worker do not
grow with the world size.

Non-finite gradients (:mod:`gradzip.comm.nonfinite`): a rank whose bucket holds inf or NaN sends
+inf scales; the MAX is +inf on every rank, no rank sends codes, every rank returns all NaN, and
the step's residual updates are put back when the next step starts.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gradzip.comm import nonfinite
from gradzip.comm.queue import completed
from gradzip.comm.settling import SettlingReducer
from gradzip.comm.traffic import allreduce_bytes, dense_probe
from gradzip.compressors.int8sum import group_rounded, group_scales, group_values, levels_for


def sent_nbytes(n_scales: int, numel: int, world_size: int) -> int:
    """Bytes one rank hands to the collectives for ``n_scales`` group scales and ``numel`` codes:
    two ring all_reduces, the fp32 scales (MAX) and the int8 codes (SUM)."""
    return allreduce_bytes(4 * n_scales, world_size) + allreduce_bytes(numel, world_size)


def mean_of_codes(codes: Tensor, scales: Tensor, levels: int, world_size: int, group: int, dtype: torch.dtype) -> Tensor:
    """The mean over ``world_size`` ranks of flat int8 ``codes`` summed at ``levels`` levels on
    the agreed group ``scales``: flat, in ``dtype``, saturated to its range (a mean that fits fp32
    may not fit fp16)."""
    return nonfinite.saturate(group_values(codes, scales, levels * world_size, group), dtype).to(dtype)


class Int8SumReducer(SettlingReducer):
    """Averages buckets over ``group`` as int8 codes on shared scales (see the module docstring).

    Args:
        compressor: the :class:`~gradzip.compressors.int8sum.Int8Sum` parameters.
        group: the process group (None: the default group).
        queue: the ordered launch queue shared by every reducer of ``group``.
        metrics: where bytes and times go (no quality figures are recorded).
        ledger: the steps whose gradient was not finite, shared by every reducer of one hook;
            None for a ledger of this reducer's own.
    """

    def reduce(
        self,
        key: Hashable,
        grad: Tensor,
        *,
        step: int,
        shapes: Sequence[torch.Size] | None = None,
        flush: bool = True,
    ) -> Future:
        """Start averaging a bucket; returns at once.

        Args:
            key: the bucket's name across steps; keys the residual.
            grad: any shape (read flat), floating dtype; must stay unchanged until the future
                completes.
            step: the training step.
            shapes: ignored (the groups run over the flat bucket).
            flush: accepted for the :class:`~gradzip.comm.Reducer` interface; nothing is held.

        Returns:
            a future whose value is the mean, ``grad``'s shape and dtype; all NaN on every rank
            if the bucket held inf or NaN on any rank.

        Raises:
            ValueError: if the group has more than 127 ranks.
        """
        self._begin(key, step)
        world_size = dist.get_world_size(self.group)
        levels = levels_for(world_size)
        if grad.numel() == 0:
            return completed(grad.clone())
        codec = self.compressor
        numel = grad.numel()
        if self._dense(grad, step):
            return self._reduce_dense(key, grad, world_size, step)
        device = grad.device
        scales = torch.zeros(codec.n_scales(numel), dtype=torch.float32, device=device)
        codes = torch.zeros(numel, dtype=torch.int8, device=device)
        sent = sent_nbytes(codec.n_scales(numel), numel, world_size)
        self.metrics.add_bucket(
            key, payload_bytes=codec.payload_nbytes(numel, grad.dtype), dense_bytes=numel * grad.element_size(),
            collective="allreduce", sent_bytes=sent, received_bytes=sent, codec=codec.spec,
        )
        box: dict[str, Any] = {}

        def launch_scales() -> Future:
            with self.metrics.timed("compress_s", key):
                flat = grad.reshape(-1)
                own = self.feedback.compensate(key, flat, step=step) if codec.error_feedback else flat.float()
                box["x"], sendable = nonfinite.checked_input(flat, own)
                if sendable:
                    scales.copy_(group_scales(box["x"], codec.group))
                else:
                    scales.fill_(float("inf"))  # the marker: every rank's MAX turns +inf
            work = dist.all_reduce(scales, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            return self.metrics.track(work.get_future(), (key,))

        def launch_codes() -> Future:
            if not nonfinite.is_finite(scales):  # the same MAX on every rank: all skip together
                box["skip"] = True
                return completed(None)
            with self.metrics.timed("compress_s", key):
                steps = group_rounded(box["x"], scales, levels, codec.group)  # whole numbers, fp32
                codes.copy_(steps)
                if codec.error_feedback:
                    # what this rank's codes carry, so the rounding is fed back
                    self.feedback.update(key, box["x"], group_values(steps, scales, levels, codec.group), step=step)
            work = dist.all_reduce(codes, group=self.group, async_op=True)
            return self.metrics.track(work.get_future(), (key,))

        def finish(fut: Future) -> Tensor:
            fut.value()  # re-raises a failed collective
            if box.get("skip"):
                return self.ledger.marked_result(step, grad)
            with self.metrics.timed("decompress_s", key):
                return mean_of_codes(codes, scales, levels, world_size, codec.group, grad.dtype).view(grad.shape)

        first = self.queue.submit(launch_scales, device=device)
        return self.queue.submit(launch_codes, after=first, device=device).then(finish)

    def probe(self, key: Hashable, grad: Tensor, *, step: int, shapes: Sequence[torch.Size] | None = None) -> dict[str, Any]:
        """Code and decode ``grad`` locally at the group's levels, on this rank's own scales (the
        agreed ones are no smaller, so the error read here is a lower bound): no collective, no
        state change. Used by controllers to price ``int8`` on a real bucket.

        Returns:
            ``compress_s``, ``decompress_s``, ``payload_bytes``, ``sent_bytes`` (both ring
            all_reduces), ``collectives`` (2) and ``decoded`` (``grad``'s shape and dtype).
        """
        world_size = dist.get_world_size(self.group) if dist.is_initialized() else 1
        codec = self.compressor
        numel = grad.numel()
        if numel == 0 or self._dense(grad, step):
            return dense_probe(grad, world_size)
        levels = levels_for(world_size)
        start = time.perf_counter()
        scales = group_scales(grad, codec.group)
        steps = group_rounded(grad, scales, levels, codec.group)
        middle = time.perf_counter()
        decoded = nonfinite.saturate(group_values(steps, scales, levels, codec.group), grad.dtype)
        end = time.perf_counter()
        return {
            "compress_s": middle - start, "decompress_s": end - middle,
            "payload_bytes": codec.payload_nbytes(numel, grad.dtype), "sent_bytes": sent_nbytes(codec.n_scales(numel), numel, world_size),
            "collectives": 2, "decoded": decoded.to(grad.dtype).view(grad.shape),
        }

    def _dense(self, grad: Tensor, step: int) -> bool:
        """Whether ``grad`` travels dense at ``step``: before ``start_step``, or where its payload
        would not be smaller than its raw bytes."""
        return step < self.compressor.start_step or self._codes_not_smaller(grad.numel(), grad.dtype)

    def bucket_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes a bucket of ``numel`` elements of ``dtype`` hands to the collectives past
        ``start_step``: its codes and scales, or its raw bytes where those would be no smaller."""
        raw = numel * dtype.itemsize
        return raw if self._codes_not_smaller(numel, dtype) else self.compressor.payload_nbytes(numel, dtype)

    def _codes_not_smaller(self, numel: int, dtype: torch.dtype) -> bool:
        return self.compressor.payload_nbytes(numel, dtype) >= numel * dtype.itemsize
