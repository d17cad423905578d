"""The uncompressed routes of the DDP reducers: ``dense`` (one bucket, raw, ``all_reduce``) and
``fused`` (buckets below ``min_compress_bytes``, held back and sent raw in one ``all_reduce``).

Both divide by ``world_size`` before summing, PyTorch's ``allreduce_hook`` order. A rank whose
bucket is not finite fills what it sends with NaN (:mod:`gradzip.comm.nonfinite`): an inf alone
could pass for an overflow.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gradzip.comm import nonfinite
from gradzip.comm.routes.base import Cost, Round, Route, raw_nbytes
from gradzip.comm.traffic import allreduce_bytes
from gradzip.compressors import Compressor
from gradzip.compressors.kernels import wire
from gradzip.metrics import quality_figures

if TYPE_CHECKING:
    from gradzip.comm.reducer import CompressedReducer, Held


def dense_mean(grads: Sequence[Tensor]) -> Tensor:
    """The mean as the dense all_reduce forms it: each term divided by the world size, summed in
    rank order (what gloo does at two ranks; beyond, its order may differ by rounding)."""
    world_size = len(grads)
    total = grads[0].div(world_size)
    for grad in grads[1:]:
        total = total + grad.div(world_size)
    return total


class DenseAllReduce(Route):
    """``dense``: the raw bucket divided by ``world_size`` and ``all_reduce``-d, where compressing
    would not send fewer bytes (and before a codec's ``start_step``). Hands ``B = numel *
    itemsize`` bytes; sends ``2 (W-1) B // W``."""

    name = "dense"
    compressed = False
    by_bytes = True
    sums_on_wire = True

    def payload_nbytes(self, codec: Compressor, numel: int, dtype: torch.dtype, world_size: int) -> int:
        return raw_nbytes(numel, dtype)

    def nbytes(self, codec, numel, dtype, world_size, rank=0) -> int:
        return raw_nbytes(numel, dtype)

    def sent_nbytes(self, codec, numel, dtype, world_size, rank=0, *, backend="gloo") -> int:
        return allreduce_bytes(raw_nbytes(numel, dtype), world_size)

    def cost(self, payload_nbytes, numel, dtype, world_size) -> Cost:
        nbytes = raw_nbytes(numel, dtype)
        return Cost((Round("allreduce", nbytes),), nbytes)

    def reference(self, codec, grads, *, step=0, key=0, feedback=None, server_feedback=None) -> list[Tensor]:
        return [dense_mean(grads)] * len(grads)

    def launch(self, reducer: CompressedReducer, key: Hashable, grad: Tensor, *, step: int) -> Future:
        world_size = dist.get_world_size(reducer.group)
        raw = wire.nbytes([grad])
        sent = self.sent_nbytes(reducer.compressor, grad.numel(), grad.dtype, world_size)
        reducer.metrics.add_bucket(
            key, payload_bytes=raw, dense_bytes=raw, collective=self.metric_name, compressed=False,
            sent_bytes=sent, received_bytes=sent, codec=reducer.compressor.spec,
        )
        if reducer.metrics.wants_quality(step):
            reducer.metrics.add_quality(key, quality_figures(grad, grad))
        tensor = torch.empty_like(grad)

        def launch() -> Future:
            nonfinite.mark_if_nonfinite(torch.div(grad, world_size, out=tensor), grad)
            work = dist.all_reduce(tensor, group=reducer.group, async_op=True)
            return reducer.metrics.track(work.get_future(), (key,))

        def finish(fut: Future) -> Tensor:
            fut.value()  # re-raises a failed collective
            return reducer.deliver(nonfinite.received([tensor]), step, tensor, lambda: tensor, all_nan=True)

        return reducer.queue.submit(launch, device=grad.device).then(finish)


class FusedAllReduce(DenseAllReduce):
    """``fused``: a bucket below the reducer's ``min_compress_bytes``, held back and sent raw,
    concatenated with the step's other small buckets of its dtype into one ``all_reduce`` when
    the reducer flushes (:mod:`gradzip.comm.reducer`). Counted per bucket as its own share of
    that all_reduce: hands ``B`` bytes, sends ``2 (W-1) B // W``. Chosen by size, not bytes."""

    name = "fused"
    by_bytes = False

    def launch(self, reducer: CompressedReducer, key: Hashable, grad: Tensor, *, step: int) -> Future:
        """Hold ``grad`` back; its future completes when :meth:`send` delivers the fused sum."""
        world_size = dist.get_world_size(reducer.group)
        raw = wire.nbytes([grad])
        sent = self.sent_nbytes(reducer.compressor, grad.numel(), grad.dtype, world_size)
        reducer.metrics.add_bucket(
            key, payload_bytes=raw, dense_bytes=raw, collective=self.metric_name, compressed=False,
            sent_bytes=sent, received_bytes=sent,
        )
        if reducer.metrics.wants_quality(step):
            reducer.metrics.add_quality(key, quality_figures(grad, grad))
        return reducer.hold(key, grad, step)

    def send(self, reducer: CompressedReducer, held: list[Held]) -> None:
        """One all_reduce of the held buckets (all of one dtype), in the order they were held."""
        world_size = dist.get_world_size(reducer.group)
        flat = torch.empty(sum(h.grad.numel() for h in held), dtype=held[0].grad.dtype, device=held[0].grad.device)

        def launch() -> Future:
            torch.cat([h.grad.reshape(-1) for h in held], out=flat).div_(world_size)
            nonfinite.mark_if_nonfinite(flat, flat)  # the marker, for every bucket of this fused message
            work = dist.all_reduce(flat, group=reducer.group, async_op=True)
            return reducer.metrics.track(work.get_future(), tuple(h.key for h in held))

        def deliver(fut: Future) -> None:
            try:
                fut.value()
            except Exception as exc:  # noqa: BLE001 - handed to every waiting bucket
                for h in held:
                    h.future.set_exception(exc)
                return
            bad = nonfinite.received([flat])
            offset = 0
            for h in held:
                # A copy, not a view: DDP reads a hook's result with as_strided from the start of
                # its storage, so a view at an offset would hand every bucket the first one's values.
                part = flat[offset : offset + h.grad.numel()]
                h.future.set_result(
                    reducer.deliver(bad, h.step, h.grad, lambda part=part, h=h: part.view(h.grad.shape).clone(), all_nan=True)
                )
                offset += h.grad.numel()

        reducer.queue.submit(launch, device=flat.device).add_done_callback(deliver)
