"""The two collectives the subspace optimizers issue themselves, counted in a StepMetrics.

TSR-Adam averages small dense buffers (cores, sketches) with :func:`mean_all_reduce`; DeMo
gathers every rank's sparse payload with :func:`gather_payloads`. Both go through the group's
:class:`~gradzip.comm.queue.CollectiveQueue`, wait for their result (the optimizer needs it to
continue), record ``payload_bytes`` (what this rank hands to the collective) and ``sent_bytes``
by the formulas of :mod:`gradzip.comm.traffic`, and follow :mod:`gradzip.comm.nonfinite`: a rank
whose input holds inf or NaN sends NaN in the same collective, so every rank receives the marker
and can skip the step with the others, with no extra collective and no extra byte.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist
from torch import Tensor

from gradzip.comm import compat, nonfinite
from gradzip.comm.queue import CollectiveQueue
from gradzip.comm.traffic import allgather_bytes, allreduce_bytes
from gradzip.compressors.kernels import wire
from gradzip.metrics import StepMetrics


def mean_all_reduce(
    flat: Tensor, *, key: Hashable, dense_bytes: int, group: dist.ProcessGroup | None,
    queue: CollectiveQueue, metrics: StepMetrics, codec: str, wire_dtype: torch.dtype | None = None,
) -> tuple[Tensor, bool]:
    """The mean of ``flat`` over ``group``: each rank divides by ``world_size``, then one
    ``all_reduce`` sums (dividing first keeps the sum from overflowing, as gradzip's reducers do).

    Args:
        flat: 1-D floating tensor, the same numel and dtype on every rank; not modified.
        key: the bucket's name in ``metrics``.
        dense_bytes: the raw gradient bytes this buffer stands for (0 for extra traffic).
        codec: the name recorded for the bucket.
        wire_dtype: the floating dtype summed on the wire (None: ``flat``'s own). A narrower one
            is rounded to after the division, saturated at its largest finite value divided by
            ``world_size``, and summed in that dtype (a sum that still overflows by rounding is
            saturated, as in the wire's own dtype).

    Returns:
        ``(mean, finite)``, ``mean`` in ``flat``'s dtype; ``finite`` is False on every rank when
        some rank's ``flat`` held inf or NaN (``mean`` is then all NaN).
    """
    world_size = dist.get_world_size(group)
    out = torch.empty_like(flat, dtype=wire_dtype or flat.dtype)
    payload = wire.nbytes([out])
    sent = allreduce_bytes(payload, world_size)
    metrics.add_bucket(key, payload_bytes=payload, dense_bytes=dense_bytes, collective="allreduce",
                       sent_bytes=sent, received_bytes=sent, codec=codec)

    def launch():
        if out.dtype == flat.dtype:
            torch.div(flat, world_size, out=out)
        else:
            limit = torch.finfo(out.dtype).max / world_size
            out.copy_(torch.div(flat, world_size).clamp_(-limit, limit))
        if not nonfinite.is_finite(flat):
            out.fill_(float("nan"))  # the marker; an inf alone could pass for an overflow
        work = dist.all_reduce(out, group=group, async_op=True)
        return metrics.track(work.get_future(), (key,))

    queue.submit(launch, device=flat.device).wait()
    # the marker test first: it saturates in place an inf that the narrower wire's sum produced by
    # rounding (ten bfloat16 shares of max / 10 add up to inf), and the copy back to flat's dtype
    # must be taken after that, or the mean carries the inf on with finite True
    finite = not nonfinite.received_marker([out])
    return out.to(flat.dtype), finite


def gather_payloads(
    tensors: tuple[Tensor, ...], *, key: Hashable, dense_bytes: int, group: dist.ProcessGroup | None,
    queue: CollectiveQueue, metrics: StepMetrics, codec: str,
) -> tuple[list[tuple[Tensor, ...]], bool]:
    """Every rank's ``tensors``, in rank order, by one ``all_gather`` of their bytes.

    Args:
        tensors: this rank's payload; the same shapes and dtypes on every rank. Its floating
            tensors must already carry NaN if this rank's input was not finite.
        key, dense_bytes, codec: as for :func:`mean_all_reduce`.

    Returns:
        ``(payloads, finite)``: ``payloads[r]`` is rank ``r``'s tuple (views of one receive
        buffer); ``finite`` is False on every rank when any payload's floating tensors hold
        inf or NaN.
    """
    world_size = dist.get_world_size(group)
    send = wire.to_bytes(tensors)
    payload = send.numel()
    sent = allgather_bytes(payload, world_size)
    metrics.add_bucket(key, payload_bytes=payload, dense_bytes=dense_bytes, collective="allgather",
                       sent_bytes=sent, received_bytes=sent, codec=codec)
    recv = torch.empty(world_size * payload, dtype=torch.uint8, device=send.device)

    def launch():
        work = compat.all_gather_single(recv, send, group=group, async_op=True)
        return metrics.track(work.get_future(), (key,))

    queue.submit(launch, device=send.device).wait()
    rows = recv.view(world_size, payload)
    payloads = [wire.from_bytes(rows[r], tensors) for r in range(world_size)]
    finite = all(nonfinite.is_finite(t) for p in payloads for t in p)
    return payloads, finite
