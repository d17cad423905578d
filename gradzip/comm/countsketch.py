"""The count-sketch reducer (TAGC-style; arithmetic in :mod:`gradzip.compressors.countsketch`).

For one bucket at a step past ``start_step`` with at least ``min_numel`` elements (smaller ones,
and those whose payload would not be smaller than their raw bytes, take a plain all_reduce), in
one launch of the group's queue (two with ``fill="union"``):

1. Error-compensate the flat bucket in fp32; keep its top entries (``ratio``); the packed
   bitmap of the kept coordinates.
2. An all_reduce of the bitmaps with ``ReduceOp.BOR`` (gloo and MPI), or, on backends without it
   (NCCL), with ``ReduceOp.MAX`` on one byte per element (MAX of packed bytes is not an OR): the
   support. And an all_reduce (sum) of the count sketches of the compensated values divided by
   world_size: with ``fill="union"`` queued after the bitmaps' (each rank sketches its values on
   the support, and its residual keeps what lies off it); with ``fill="own"`` issued with them
   (each rank sketches its kept values, and its residual keeps what thresholding dropped).
3. Decode the summed sketch on the support by peeling, then median estimates for the
   coordinates that did not peel (the same on every rank; the bucket's metrics count them,
   ``unpeeled``). The estimates' errors are not fed back: feeding ``kept - estimate`` back made
   the residuals grow without bound on a sketch too small for its support, and sending those
   coordinates again later instead of estimating them ended further from ``none`` on the demo
   job (``benchmarks/results/remedies_main_job``).

Non-finite gradients (:mod:`gradzip.comm.nonfinite`): a rank whose bucket holds inf or NaN sends an
all-NaN sketch; every rank sees the NaN sum, returns all NaN, and the step's residual updates are
put back when the next step starts.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gradzip.comm import nonfinite
from gradzip.comm.queue import completed
from gradzip.comm.settling import SettlingReducer
from gradzip.comm.traffic import allreduce_bytes
from gradzip.compressors.kernels import wire

#: backends whose all_reduce takes ReduceOp.BOR on uint8
_BOR_BACKENDS = ("gloo", "mpi")


def packed_bitmaps(group: dist.ProcessGroup | None) -> bool:
    """Whether the bitmaps travel packed (the group's backend ORs bytes), else one byte each."""
    return str(dist.get_backend(group)) in _BOR_BACKENDS


class CountSketchReducer(SettlingReducer):
    """Averages buckets over ``group`` through a shared bitmap and a summed count sketch.

    Args:
        compressor: the :class:`~gradzip.compressors.countsketch.CountSketch` parameters.
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
            key: the bucket's name across steps; keys the residual and the hashes.
            grad: any shape (read flat), floating dtype; must stay unchanged until the future
                completes.
            step: the training step (seeds the hashes).
            shapes: ignored (the sketch sees the flat bucket).
            flush: accepted for the :class:`~gradzip.comm.Reducer` interface; nothing is held.

        Returns:
            a future whose value is the decoded mean, ``grad``'s shape and dtype; all NaN on every
            rank if the bucket held inf or NaN on any rank.
        """
        self._begin(key, step)
        world_size = dist.get_world_size(self.group)
        if grad.numel() == 0:
            return completed(grad.clone())
        codec = self.compressor
        numel = grad.numel()
        raw = numel * grad.element_size()
        packed = packed_bitmaps(self.group)
        payload_bytes = codec.payload_nbytes(numel, packed=packed)
        if step < codec.start_step or numel < codec.min_numel or payload_bytes >= raw:
            return self._reduce_dense(key, grad, world_size, step)
        bitmap_bytes = wire.packed_nbytes(numel, 1) if packed else numel
        self.metrics.add_bucket(
            key, payload_bytes=payload_bytes, dense_bytes=raw, collective="allreduce",
            sent_bytes=allreduce_bytes(bitmap_bytes, world_size) + allreduce_bytes(payload_bytes - bitmap_bytes, world_size),
            received_bytes=allreduce_bytes(bitmap_bytes, world_size) + allreduce_bytes(payload_bytes - bitmap_bytes, world_size),
            codec=codec.spec,
        )
        if codec.fill == "union":
            return self._reduce_on_union(key, grad, step, world_size, packed, payload_bytes)
        box: dict[str, Any] = {}

        def launch() -> Future:
            with self.metrics.timed("compress_s", key):
                compensated, sendable = self._compensated(key, grad, step)
                mask, bitmap, table = codec.encode(compensated, step=step, key=key, scale=1.0 / world_size)
                self._keep_or_mark(key, compensated, mask, table, sendable, step)
                box["bitmap"] = bitmap if packed else mask.to(torch.uint8)
                box["table"] = table
            assert wire.nbytes([box["bitmap"], table]) == payload_bytes, "payload differs from its formula"
            works = [
                dist.all_reduce(box["bitmap"], op=_bitmap_op(packed), group=self.group, async_op=True).get_future(),
                dist.all_reduce(box["table"], group=self.group, async_op=True).get_future(),
            ]
            return self.metrics.track(torch.futures.collect_all(works), (key,))

        return self.queue.submit(launch, device=grad.device).then(self._finish(key, grad, step, box, packed))

    def _reduce_on_union(self, key: Hashable, grad: Tensor, step: int, world_size: int, packed: bool,
                         payload_bytes: int) -> Future:
        """``fill="union"``: the bitmaps' OR first, then each rank's sketch of its values on it."""
        codec = self.compressor
        box: dict[str, Any] = {}

        def launch_bitmap() -> Future:
            with self.metrics.timed("compress_s", key):
                box["compensated"], box["sendable"] = self._compensated(key, grad, step)
                mask = codec.keep(box["compensated"])
                box["bitmap"] = wire.pack_bits(mask, 1) if packed else mask.to(torch.uint8)
            work = dist.all_reduce(box["bitmap"], op=_bitmap_op(packed), group=self.group, async_op=True).get_future()
            return self.metrics.track(work, (key,))

        def launch_sketch() -> Future:
            with self.metrics.timed("compress_s", key):
                compensated = box.pop("compensated")
                support = _support(box["bitmap"], grad.numel(), packed)
                # The decode peels this same support: hash its coordinates once for both.
                box["located"] = codec.locate(support, step=step, key=key)
                table = codec.sketch_on(compensated, box["located"], step=step, key=key, scale=1.0 / world_size)
                self._keep_or_mark(key, compensated, support, table, box["sendable"], step)
                box["table"] = table
            assert wire.nbytes([box["bitmap"], table]) == payload_bytes, "payload differs from its formula"
            return self.metrics.track(dist.all_reduce(table, group=self.group, async_op=True).get_future(), (key,))

        first = self.queue.submit(launch_bitmap, device=grad.device)
        second = self.queue.submit(launch_sketch, after=first, device=grad.device)
        return second.then(self._finish(key, grad, step, box, packed))

    def _compensated(self, key: Hashable, grad: Tensor, step: int) -> tuple[Tensor, bool]:
        """The error-compensated flat bucket (zeros where it is not finite) and whether it is."""
        flat = grad.reshape(-1)
        compensated, sendable = nonfinite.checked_input(flat, self.feedback.compensate(key, flat, step=step))
        return (compensated if sendable else torch.zeros_like(compensated)), sendable

    def _keep_or_mark(self, key: Hashable, compensated: Tensor, sent: Tensor, table: Tensor, sendable: bool,
                      step: int) -> None:
        """Keep what the mask ``sent`` leaves of ``compensated`` as the residual, or, for a bucket
        that is not finite, mark ``table`` instead (every rank's sum turns NaN)."""
        if not sendable:
            table.fill_(float("nan"))
        else:
            self.feedback.update(key, compensated, compensated * sent, step=step)

    def _finish(self, key: Hashable, grad: Tensor, step: int, box: dict[str, Any], packed: bool):
        """The callback that decodes the summed sketch in ``box`` on the support in ``box``."""
        codec = self.compressor

        def finish(fut: Future) -> Tensor:
            fut.value()  # re-raises a failed collective
            if nonfinite.received_marker([box["table"]]):
                return self.ledger.marked_result(step, grad)
            with self.metrics.timed("decompress_s", key):
                support = box.pop("located", None) or _support(box["bitmap"], grad.numel(), packed)
                out, unpeeled = codec.decode_peeled(support, box["table"], step=step, key=key, like=grad)
                self.metrics.add_figures(key, unpeeled=unpeeled)
                return out

        return finish


def _bitmap_op(packed: bool) -> dist.ReduceOp:
    """The OR of the bitmaps: BOR on packed bits; MAX on one byte per element (MAX of packed bytes
    is not an OR)."""
    return dist.ReduceOp.BOR if packed else dist.ReduceOp.MAX


def _support(bitmap: Tensor, numel: int, packed: bool) -> Tensor:
    """The bool mask of an OR-ed bitmap (packed bits, or one byte per element)."""
    return wire.unpack_bits(bitmap, 1, numel).bool() if packed else bitmap.bool()

