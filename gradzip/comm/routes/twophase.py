"""``twophase``: the compressed all_reduce of 1-bit Adam (:mod:`gradzip.comm.twophase` holds the
exchange and its paper), for any single-round codec.

A bucket cut into ``W`` chunks with payloads ``p_0 .. p_{W-1}``: rank ``r`` hands ``sum_j p_j``
to the all_to_all and ``p_r`` to the all_gather (``W p_r`` to an all_to_all where chunk payloads
differ in size, which all_gather cannot carry), and sends ``sum_{j != r} p_j + (W-1) p_r``:
about ``2 (W-1) P / W``, flat in the world size.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.futures import Future

from gradzip.comm.routes.base import Cost, Round, Route
from gradzip.comm.traffic import chunk_size_counts, plan_chunks
from gradzip.comm.twophase import chunk_key, mean_key, mean_of_payloads
from gradzip.compressors import Payload
from gradzip.compressors.kernels import wire

if TYPE_CHECKING:
    from gradzip.comm.reducer import CompressedReducer


class TwoPhase(Route):
    """See the module docstring."""

    name = "twophase"
    requestable = True
    by_bytes = True
    rounds_per_bucket = 2

    def auto_takes(self, codec) -> bool:
        # A ring all_reduce already is a reduce-scatter and an all-gather of a summable payload;
        # two phases would add a second compression for at most a few bytes of rounding. A codec
        # whose second compression costs loss says so (``twophase_cost``): weighed on quality.
        return super().auto_takes(codec) and not codec.aggregatable and not codec.twophase_cost

    def payload_nbytes(self, codec, numel, dtype, world_size) -> int:
        return plan_chunks(codec, numel, dtype, world_size).total_payload_nbytes

    def nbytes(self, codec, numel, dtype, world_size, rank=0) -> int:
        plan = plan_chunks(codec, numel, dtype, world_size)
        own = plan.payload_nbytes[rank]
        second = own if len(set(plan.payload_nbytes)) == 1 else world_size * own
        return plan.total_payload_nbytes + second

    def sent_nbytes(self, codec, numel, dtype, world_size, rank=0, *, backend="gloo") -> int:
        return plan_chunks(codec, numel, dtype, world_size).sent_bytes(rank)

    def total_sent_nbytes(self, codec, numel, dtype, world_size, *, backend="gloo") -> int:
        # Each chunk payload crosses W-1 links in each round.
        return 2 * (world_size - 1) * plan_chunks(codec, numel, dtype, world_size).total_payload_nbytes

    def cost(self, payload_nbytes, numel, dtype, world_size) -> Cost:
        counts = chunk_size_counts(numel, world_size)
        total = sum(payload_nbytes(size, dtype) * count for size, count in counts.items() if size)
        own = max(counts)
        item = wire.dtype_nbytes(dtype)
        return Cost(
            (Round("alltoall", total), Round("allgather", total)),
            total,
            encode_bytes=(numel + own) * item,  # every chunk, then the own averaged chunk again
            decode_bytes=(world_size * own + numel) * item,  # p versions of the own chunk, then every mean
        )

    def reference(self, codec, grads, *, step=0, key=0, feedback=None, server_feedback=None) -> list[Tensor]:
        world_size = len(grads)
        plan = plan_chunks(codec, grads[0].numel(), grads[0].dtype, world_size)
        chunks = list(zip(plan.offsets, plan.sizes))
        # payloads[rank][j]: what rank sends for chunk j in round 1.
        payloads: list[list[Payload | None]] = []
        for rank, grad in enumerate(grads):
            flat = grad.reshape(-1)
            compensated = flat if feedback is None else feedback[rank].compensate(key, flat, step=step)
            decoded = torch.zeros_like(compensated)
            row: list[Payload | None] = []
            for j, (start, size) in enumerate(chunks):
                if size == 0:
                    row.append(None)
                    continue
                payload = codec.compress(compensated[start : start + size], step=step, key=chunk_key(key, j))
                decoded[start : start + size] = codec.decompress(payload, like=compensated[start : start + size])
                row.append(payload)
            if feedback is not None:
                feedback[rank].update(key, compensated, decoded, step=step)
            payloads.append(row)
        out = torch.empty_like(grads[0].reshape(-1))
        for j, (start, size) in enumerate(chunks):
            if size == 0:
                continue
            mean = mean_of_payloads(codec, [payloads[rank][j] for rank in range(world_size)], out.new_empty(size))
            server = None if server_feedback is None else server_feedback[j]
            compensated = mean if server is None else server.compensate(key, mean, step=step)
            payload = codec.compress(compensated, step=step, key=mean_key(key, j))
            if server is not None:
                server.update(key, compensated, codec.decompress(payload, like=compensated), step=step)
            out[start : start + size] = codec.decompress(payload, like=out[start : start + size])
        return [out.view(grads[0].shape)] * world_size

    def launch(self, reducer: CompressedReducer, key: Hashable, grad: Tensor, *, step: int) -> Future:
        return reducer.twophase.reduce(key, grad, step=step)
