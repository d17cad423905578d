"""``allreduce``: aggregatable payloads divided by ``world_size`` and ``all_reduce``-d, one
collective per payload tensor, decoded once.

Dividing first keeps fp16 sums from overflowing, and is the order of PyTorch's ``allreduce_hook``
and ``fp16_compress_hook``. Integer payload parts (shared by every rank, such as Random-K's
count) travel as they are. Hands ``P = payload_nbytes(numel)`` bytes; sends ``2 (W-1) P // W``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gradzip.comm import nonfinite
from gradzip.comm.routes.base import Cost, Round, Route, raw_nbytes
from gradzip.comm.traffic import allreduce_bytes
from gradzip.compressors import Payload
from gradzip.compressors.kernels import wire

if TYPE_CHECKING:
    from gradzip.comm.reducer import CompressedReducer


def predivide(payload: Payload, world_size: int) -> tuple[Tensor, ...]:
    """Floating payload tensors divided by ``world_size`` (new tensors; integer parts as they are)."""
    return tuple(t.div(world_size) if t.is_floating_point() else t for t in payload.tensors)


class AllReduce(Route):
    """See the module docstring. Takes aggregatable codecs only: the sum of their payloads
    decodes to the sum of their inputs."""

    name = "allreduce"
    requestable = True
    by_bytes = True
    needs_aggregatable = True
    sums_on_wire = True

    def payload_nbytes(self, codec, numel, dtype, world_size) -> int:
        return codec.payload_nbytes(numel, dtype)

    def nbytes(self, codec, numel, dtype, world_size, rank=0) -> int:
        return codec.payload_nbytes(numel, dtype)

    def sent_nbytes(self, codec, numel, dtype, world_size, rank=0, *, backend="gloo") -> int:
        return allreduce_bytes(codec.payload_nbytes(numel, dtype), world_size)

    def cost(self, payload_nbytes, numel, dtype, world_size) -> Cost:
        payload, dense = payload_nbytes(numel, dtype), raw_nbytes(numel, dtype)
        return Cost((Round("allreduce", payload),), payload, dense, dense)

    def reference(self, codec, grads, *, step=0, key=0, feedback=None, server_feedback=None) -> list[Tensor]:
        world_size = len(grads)
        payloads = []
        for rank, grad in enumerate(grads):
            compensated = grad if feedback is None else feedback[rank].compensate(key, grad, step=step)
            payload = codec.compress(compensated, step=step, key=key)
            if feedback is not None:
                feedback[rank].update(key, compensated, codec.decompress(payload, like=compensated), step=step)
            payloads.append(payload)
        parts = [predivide(p, world_size) for p in payloads]
        summed = tuple(torch.stack(column).sum(0) if column[0].is_floating_point() else column[0] for column in zip(*parts))
        nonfinite.received_marker(summed)  # saturates a sum that overflowed, as the reducer does
        return [codec.decompress(Payload(summed, payloads[0].ctx), like=grads[0])] * world_size

    def launch(self, reducer: CompressedReducer, key: Hashable, grad: Tensor, *, step: int) -> Future:
        world_size = dist.get_world_size(reducer.group)
        codec = reducer.compressor
        sent = self.sent_nbytes(codec, grad.numel(), grad.dtype, world_size)
        reducer.metrics.add_bucket(
            key, payload_bytes=codec.payload_nbytes(grad.numel(), grad.dtype), dense_bytes=wire.nbytes([grad]),
            collective=self.metric_name, sent_bytes=sent, received_bytes=sent, codec=codec.spec,
        )
        box: dict[str, Any] = {}

        def launch() -> Future:
            with reducer.metrics.timed("compress_s", key):
                payload = reducer.encode(key, grad, step, box)
                box["ctx"], box["tensors"] = payload.ctx, predivide(payload, world_size)
                if "ok" in box:  # on a device: the NaN marker where this rank's bucket is not finite
                    box["tensors"] = nonfinite.mark(box["tensors"], box["ok"], inplace=True)
            reducer.record_quality(key, grad, box)
            works = [dist.all_reduce(t, group=reducer.group, async_op=True).get_future() for t in box["tensors"]]
            fut = works[0] if len(works) == 1 else torch.futures.collect_all(works)
            return reducer.metrics.track(fut, (key,))

        def decode(fut: Future) -> Tensor:
            fut.value()  # re-raises a failed collective
            with reducer.metrics.timed("decompress_s", key):
                bad = nonfinite.received(box["tensors"])
                # The decode is built from the received tensors, the reducer's own: markable in place.
                return reducer.deliver(bad, step, grad, lambda: codec.decompress(Payload(box["tensors"], box["ctx"]), like=grad))

        return reducer.queue.submit(launch, device=grad.device).then(decode)
