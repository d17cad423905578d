"""``allgather``: every rank's payload packed into one byte buffer and ``all_gather``-ed; every
rank decodes all of them in rank order, sums and divides, so all ranks end with bit-identical
results. Takes any single-round codec whose payload shapes depend only on ``numel`` and the
dtype. Hands ``P = payload_nbytes(numel)`` bytes; sends ``(W-1) P``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gradzip.comm import compat, nonfinite
from gradzip.comm.routes.base import Cost, Round, Route, raw_nbytes
from gradzip.comm.traffic import allgather_bytes
from gradzip.comm.twophase import mean_of_payloads
from gradzip.compressors import Payload
from gradzip.compressors.kernels import wire

if TYPE_CHECKING:
    from gradzip.comm.reducer import CompressedReducer


class AllGather(Route):
    """See the module docstring."""

    name = "allgather"
    requestable = True
    by_bytes = True

    def auto_takes(self, codec) -> bool:
        # An aggregatable codec's ring all_reduce already moves fewer bytes, decoding once.
        return super().auto_takes(codec) and not codec.aggregatable

    def payload_nbytes(self, codec, numel, dtype, world_size) -> int:
        return codec.payload_nbytes(numel, dtype)

    def nbytes(self, codec, numel, dtype, world_size, rank=0) -> int:
        return codec.payload_nbytes(numel, dtype)

    def sent_nbytes(self, codec, numel, dtype, world_size, rank=0, *, backend="gloo") -> int:
        return allgather_bytes(codec.payload_nbytes(numel, dtype), world_size)

    def cost(self, payload_nbytes, numel, dtype, world_size) -> Cost:
        payload, dense = payload_nbytes(numel, dtype), raw_nbytes(numel, dtype)
        # Every worker decodes all p payloads.
        return Cost((Round("allgather", world_size * payload),), payload, dense, world_size * dense)

    def reference(self, codec, grads, *, step=0, key=0, feedback=None, server_feedback=None) -> list[Tensor]:
        payloads = []
        for rank, grad in enumerate(grads):
            compensated = grad if feedback is None else feedback[rank].compensate(key, grad, step=step)
            payload = codec.compress(compensated, step=step, key=key)
            if feedback is not None:
                feedback[rank].update(key, compensated, codec.decompress(payload, like=compensated), step=step)
            payloads.append(payload)
        return [mean_of_payloads(codec, payloads, grads[0])] * len(grads)

    def launch(self, reducer: CompressedReducer, key: Hashable, grad: Tensor, *, step: int) -> Future:
        world_size = dist.get_world_size(reducer.group)
        codec = reducer.compressor
        payload_bytes = codec.payload_nbytes(grad.numel(), grad.dtype)
        sent = self.sent_nbytes(codec, grad.numel(), grad.dtype, world_size)
        reducer.metrics.add_bucket(
            key, payload_bytes=payload_bytes, dense_bytes=wire.nbytes([grad]), collective=self.metric_name,
            sent_bytes=sent, received_bytes=sent, codec=codec.spec,
        )
        recv = torch.empty(world_size * payload_bytes, dtype=torch.uint8, device=grad.device)
        box: dict[str, Any] = {}

        def launch() -> Future:
            with reducer.metrics.timed("compress_s", key):
                box["payload"] = reducer.encode(key, grad, step, box)
                tensors = box["payload"].tensors
                if "ok" in box:  # on a device: the NaN marker where this rank's bucket is not finite
                    tensors = nonfinite.mark(tensors, box["ok"])
                send = wire.to_bytes(tensors)
            reducer.record_quality(key, grad, box)
            work = compat.all_gather_single(recv, send, group=reducer.group, async_op=True)
            return reducer.metrics.track(work.get_future(), (key,))

        def decode(fut: Future) -> Tensor:
            fut.value()  # re-raises a failed collective
            with reducer.metrics.timed("decompress_s", key):
                template = box["payload"]
                rows = recv.view(world_size, -1)
                payloads = [Payload(wire.from_bytes(rows[r], template.tensors), template.ctx) for r in range(world_size)]
                bad = nonfinite.received([t for p in payloads for t in p.tensors])
                return reducer.deliver(bad, step, grad, lambda: mean_of_payloads(codec, payloads, grad))

        return reducer.queue.submit(launch, device=grad.device).then(decode)
