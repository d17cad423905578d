"""The routes of FSDP's gradient reduce-scatter (family ``shard``): each rank ends with its own
``1/W`` chunk of the reduced buffer, not the whole mean.

``numel`` in the byte formulas is the whole buffer, ``W c`` elements for chunks of ``c``; ``P``
below is ``payload_nbytes(c)``. The launches run inside
:class:`~gradzip.comm.reduce_scatter.CompressedReduceScatter` (the ``comm`` argument), which holds
the codec, the residuals and the metrics, and apply FSDP's op (``AVG``, ``SUM`` or
``PREMUL_SUM(f)``; see :mod:`gradzip.comm.reduce_scatter`).

- ``reduce_scatter``: the ``W`` chunk payloads reduce-scattered, summed on the wire, decoded once
  (aggregatable codecs whose payload is all floating point). Hands ``W P``; sends
  ``reduce_scatter_bytes(W P)`` (a ring's ``(W-1) P``; gloo's ``2 (W-1) P``).
- ``all_to_all``: the ``W`` chunk payloads exchanged, the own chunk's ``W`` versions decoded and
  summed in rank order (any single-round codec). Hands ``W P``; sends ``(W-1) P``.
- ``dense_reduce_scatter`` (recorded as ``dense``): FSDP's own reduce-scatter of the raw buffer.
  Hands ``B = numel * itemsize``; sends ``reduce_scatter_bytes(B)``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradzip.comm import nonfinite
from gradzip.comm.routes.base import SHARD, Cost, Round, Route, raw_nbytes
from gradzip.comm.traffic import all_to_all_bytes, chunk_size_counts, reduce_scatter_bytes
from gradzip.compressors import Compressor, Payload
from gradzip.compressors.cast import Identity
from gradzip.compressors.kernels import wire
from gradzip.feedback import ErrorFeedback

if TYPE_CHECKING:
    from gradzip.comm.reduce_scatter import CompressedReduceScatter

AVG = dist.ReduceOp.AVG


def _chunk_numel(numel: int, world_size: int) -> int:
    assert numel % world_size == 0, "a reduce-scatter buffer holds world_size equal chunks"
    return numel // world_size


def _apply_op(total: Tensor, kind: str, factor: float, world_size: int) -> Tensor:
    if kind == "avg":
        return total.div_(world_size)
    if kind == "premul":
        return total.mul_(factor)
    return total


def _wire_sum(inputs: Sequence[Tensor], rank: int, op: Any) -> Tensor:
    """What a reduce-scatter hands rank ``rank``: its chunk of the inputs as
    :func:`~gradzip.comm.reduce_scatter.wire_op` converts them, summed in rank order (AVG divided
    after)."""
    from gradzip.comm.reduce_scatter import op_kind, wire_op

    world_size = len(inputs)
    kind, factor = op_kind(op, world_size)
    parts = []
    for x in inputs:
        converted, wire = wire_op(x, op, kind, factor, world_size)
        parts.append(converted.view(world_size, -1)[rank])
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total.div_(world_size) if wire == AVG else total


def _encode_all(
    codec: Compressor, inputs: Sequence[Tensor], key: Hashable, step: int, feedback: Sequence[ErrorFeedback] | None
) -> list[list[Payload]]:
    """payloads[rank][j]: rank's payload of destination chunk ``j``, as the comm encodes it."""
    from gradzip.comm.reduce_scatter import encode_chunk

    world_size = len(inputs)
    out = []
    for rank, x in enumerate(inputs):
        chunks = x.view(world_size, -1)
        memory = None if feedback is None else feedback[rank]
        out.append([encode_chunk(codec, memory, key, chunks[j], j, step, True) for j in range(world_size)])
    return out


class DenseReduceScatter(Route):
    """FSDP's own reduce-scatter of the raw buffer (see the module docstring)."""

    name = "dense_reduce_scatter"
    label = "dense"
    family = SHARD
    compressed = False
    sums_on_wire = True

    def payload_nbytes(self, codec, numel, dtype, world_size) -> int:
        return raw_nbytes(numel, dtype)

    def nbytes(self, codec, numel, dtype, world_size, rank=0) -> int:
        return raw_nbytes(numel, dtype)

    def sent_nbytes(self, codec, numel, dtype, world_size, rank=0, *, backend="gloo") -> int:
        return reduce_scatter_bytes(raw_nbytes(numel, dtype), world_size, backend)

    def cost(self, payload_nbytes, numel, dtype, world_size) -> Cost:
        dense = raw_nbytes(numel, dtype)
        return Cost((Round("reducescatter", dense),), dense)

    def reference(self, codec, grads, *, step=0, key="", feedback=None, server_feedback=None, op=AVG) -> list[Tensor]:
        return [_wire_sum(grads, rank, op) for rank in range(len(grads))]

    def launch(self, comm: CompressedReduceScatter, output: Tensor, input: Tensor, group, op: Any, *, step: int) -> None:
        nbytes = wire.nbytes([input])
        comm.last_exchange = self.metric_name
        comm.reduce_scatter(output, input, group, op)
        sent = self.sent_nbytes(comm.compressor, input.numel(), input.dtype, group.size(), backend=dist.get_backend(group))
        comm.metrics.add_bucket(
            comm.name, payload_bytes=nbytes, dense_bytes=nbytes, collective=self.metric_name, compressed=False,
            sent_bytes=sent, received_bytes=sent,
        )


class ShardReduceScatter(Route):
    """Chunk payloads reduce-scattered, summed on the wire (see the module docstring)."""

    name = "reduce_scatter"
    family = SHARD
    needs_aggregatable = True
    sums_on_wire = True

    def accepts(self, codec) -> bool:
        # The identity codec is FSDP's own collective, whatever it declares.
        return isinstance(codec, Identity) or super().accepts(codec)

    def payload_nbytes(self, codec, numel, dtype, world_size) -> int:
        return world_size * codec.payload_nbytes(_chunk_numel(numel, world_size), dtype)

    def nbytes(self, codec, numel, dtype, world_size, rank=0) -> int:
        return self.payload_nbytes(codec, numel, dtype, world_size)

    def sent_nbytes(self, codec, numel, dtype, world_size, rank=0, *, backend="gloo") -> int:
        return reduce_scatter_bytes(self.payload_nbytes(codec, numel, dtype, world_size), world_size, backend)

    def cost(self, payload_nbytes, numel, dtype, world_size) -> Cost:
        # The model prices the payload of the whole unit, reduce-scattered on a ring.
        payload, dense = payload_nbytes(numel, dtype), raw_nbytes(numel, dtype)
        return Cost((Round("reducescatter", payload),), payload, dense, dense / world_size)

    def reference(self, codec, grads, *, step=0, key="", feedback=None, server_feedback=None, op=AVG) -> list[Tensor]:
        world_size = len(grads)
        payloads = _encode_all(codec, grads, key, step, feedback)
        out = []
        for rank in range(world_size):
            own = payloads[rank][rank]
            summed = []
            for t in range(len(own.tensors)):
                stacked = [torch.stack([p.tensors[t].reshape(-1) for p in row]).view(-1) for row in payloads]
                summed.append(_wire_sum(stacked, rank, op).view(own.tensors[t].shape))
            like = grads[rank].view(world_size, -1)[rank]
            out.append(codec.decompress(Payload(tuple(summed), own.ctx), like=like).to(grads[rank].dtype))
        return out

    def launch(self, comm: CompressedReduceScatter, output: Tensor, input: Tensor, group, op: Any, *, step: int) -> None:
        world_size, rank = group.size(), group.rank()
        chunks = input.view(world_size, output.numel())
        sendable = nonfinite.is_finite(input)
        with comm.metrics.timed("compress_s", comm.name):
            payloads = [comm.encode(chunks[j], j, step, sendable) for j in range(world_size)]
        comm.last_exchange = self.metric_name
        own = payloads[rank]
        summed = []
        handed = 0
        for t in range(len(own.tensors)):
            stacked = torch.stack([p.tensors[t].reshape(-1) for p in payloads])
            recv = stacked.new_empty(stacked.shape[1])
            comm.reduce_scatter(recv, stacked.view(-1), group, op)
            summed.append(recv.view(own.tensors[t].shape))
            handed += wire.nbytes([stacked])
        comm.check_bytes(handed, chunks)
        sent = self.sent_nbytes(comm.compressor, input.numel(), input.dtype, world_size, backend=dist.get_backend(group))
        comm.metrics.add_bucket(
            comm.name, payload_bytes=handed, dense_bytes=wire.nbytes([input]), collective=self.metric_name,
            sent_bytes=sent, received_bytes=sent,
        )
        with comm.metrics.timed("decompress_s", comm.name):
            marked = nonfinite.received_marker(summed)
            if marked:
                output.fill_(float("nan"))
            else:
                # The op was applied to the payload on the wire; the decoder is linear.
                output.copy_(comm.compressor.decompress(Payload(tuple(summed), own.ctx), like=chunks[rank]))
        # A non-finite rank marks its payload for every chunk, so every rank sees the marker.
        comm.settle(marked)


class ShardAllToAll(Route):
    """Chunk payloads exchanged and decoded by their owner (see the module docstring)."""

    name = "all_to_all"
    family = SHARD

    def payload_nbytes(self, codec, numel, dtype, world_size) -> int:
        return world_size * codec.payload_nbytes(_chunk_numel(numel, world_size), dtype)

    def nbytes(self, codec, numel, dtype, world_size, rank=0) -> int:
        return self.payload_nbytes(codec, numel, dtype, world_size)

    def sent_nbytes(self, codec, numel, dtype, world_size, rank=0, *, backend="gloo") -> int:
        return all_to_all_bytes(codec.payload_nbytes(_chunk_numel(numel, world_size), dtype), world_size)

    def cost(self, payload_nbytes, numel, dtype, world_size) -> Cost:
        # One compressed chunk per shard: the first phase of the two-phase exchange.
        counts = chunk_size_counts(numel, world_size)
        total = sum(payload_nbytes(size, dtype) * count for size, count in counts.items() if size)
        item = wire.dtype_nbytes(dtype)
        return Cost((Round("alltoall", total),), total, raw_nbytes(numel, dtype), world_size * max(counts) * item)

    def reference(self, codec, grads, *, step=0, key="", feedback=None, server_feedback=None, op=AVG) -> list[Tensor]:
        from gradzip.comm.reduce_scatter import decode_sum, op_kind

        world_size = len(grads)
        kind, factor = op_kind(op, world_size)
        payloads = _encode_all(codec, grads, key, step, feedback)
        out = []
        for rank in range(world_size):
            chunk = grads[rank].view(world_size, -1)[rank]
            like = chunk if chunk.dtype == torch.float32 else chunk.float()
            total = decode_sum(codec, [payloads[i][rank] for i in range(world_size)], like)
            out.append(_apply_op(total, kind, factor, world_size).to(chunk.dtype))
        return out

    def launch(self, comm: CompressedReduceScatter, output: Tensor, input: Tensor, group, op: Any, *, step: int) -> None:
        from gradzip.comm.reduce_scatter import decode_sum, op_kind

        world_size, rank = group.size(), group.rank()
        kind, factor = op_kind(op, world_size)
        chunks = input.view(world_size, output.numel())
        sendable = nonfinite.is_finite(input)
        with comm.metrics.timed("compress_s", comm.name):
            payloads = [comm.encode(chunks[j], j, step, sendable) for j in range(world_size)]
        comm.last_exchange = self.metric_name
        send = torch.stack([wire.to_bytes(p.tensors) for p in payloads])
        comm.check_bytes(send.numel(), chunks)
        recv = torch.empty_like(send)
        sent = self.sent_nbytes(comm.compressor, input.numel(), input.dtype, world_size)
        comm.metrics.add_bucket(
            comm.name, payload_bytes=send.numel(), dense_bytes=wire.nbytes([input]), collective=self.metric_name,
            sent_bytes=sent, received_bytes=sent,
        )
        comm.timed_collective(lambda: dist.all_to_all_single(recv, send, group=group))
        with comm.metrics.timed("decompress_s", comm.name):
            own = payloads[rank]
            received = [Payload(wire.from_bytes(recv[r], own.tensors), own.ctx) for r in range(world_size)]
            marked = any(nonfinite.received_marker(p.tensors) for p in received)
            if marked:
                output.fill_(float("nan"))
            else:
                # Half-precision chunks are summed in fp32 and rounded once.
                like = chunks[rank] if chunks.dtype == torch.float32 else chunks[rank].float()
                output.copy_(_apply_op(decode_sum(comm.compressor, received, like), kind, factor, world_size))
        comm.settle(marked)


def choose_shard_route(
    codec: Compressor,
    numel: int,
    dtype: torch.dtype,
    world_size: int,
    *,
    backend: str,
    step: int,
    floating_payload: Callable[[], bool],
    routes: dict[str, Route],
) -> Route:
    """The shard route of a buffer of ``numel`` elements (a single-round codec).

    ``dense_reduce_scatter`` for an empty chunk, a payload larger than the raw buffer or a step
    before the codec's ``start_step``; else ``reduce_scatter`` where it accepts the codec, the
    payload is all floating point (integer parts, indices or codes, would be summed too) and it
    sends no more bytes than ``all_to_all`` (true of NCCL's ring, where one decode replaces
    ``world_size``; not of gloo's reduce-scatter, which moves as much as an all_reduce), or
    always for the identity codec (FSDP's own collective, bit for bit); else ``all_to_all``.
    """
    dense, summed, exchanged = routes["dense_reduce_scatter"], routes["reduce_scatter"], routes["all_to_all"]
    chunk_numel = numel // world_size
    if chunk_numel == 0 or step < codec.start_step:
        return dense
    if exchanged.payload_nbytes(codec, numel, dtype, world_size) > raw_nbytes(numel, dtype):
        return dense
    if isinstance(codec, Identity):
        return summed
    if summed.accepts(codec) and floating_payload():
        if summed.sent_nbytes(codec, numel, dtype, world_size, backend=backend) <= exchanged.sent_nbytes(
            codec, numel, dtype, world_size, backend=backend
        ):
            return summed
    return exchanged
