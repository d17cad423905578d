"""Single-process reference: what N ranks' compress / exchange / decode would produce.

Used by tests as the oracle for the distributed reducers: same codec calls, but the exchange is
a sum over a Python list instead of a collective.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from gradzip.comm import nonfinite
from gradzip.comm.reducer import decode_gathered, predivide
from gradzip.comm.traffic import check_collective, choose_collective, plan_chunks
from gradzip.comm.twophase import chunk_key, mean_key
from gradzip.compressors import Compressor, Payload, build
from gradzip.feedback import ErrorFeedback


def simulate_ranks(
    compressor: str | Compressor,
    grads: Sequence[Tensor],
    *,
    step: int = 0,
    key: Hashable = 0,
    feedback: Sequence[ErrorFeedback] | None = None,
    server_feedback: Sequence[ErrorFeedback] | None = None,
    collective: str = "auto",
) -> Tensor:
    """The mean over simulated ranks of ``grads`` through a single-round codec.

    Args:
        compressor: spec or codec (not multi-round).
        grads: one tensor per rank, all the same shape and dtype.
        step, key: as passed to the codec.
        feedback: one worker-side :class:`ErrorFeedback` per rank, updated in place; None for
            no feedback.
        server_feedback: one server-side :class:`ErrorFeedback` per rank for the two-phase
            route (rank ``j`` keeps chunk ``j``'s), updated in place; None for none.
        collective: ``auto``, ``allreduce``, ``allgather`` or ``twophase``, resolved to a route
            exactly as the reducer does (:func:`gradzip.comm.traffic.choose_collective`).

    Returns:
        the tensor every rank would hold, shaped and typed like ``grads[0]``.

    Raises:
        ValueError: for an unknown ``collective`` or ``allreduce`` with a non-aggregatable codec.
    """
    codec = build(compressor)
    world_size = len(grads)
    like = grads[0]
    if like.numel() == 0:
        return like.clone()
    # The route is chosen on the codec as the reducer sends it, marker slot included.
    route = choose_collective(
        check_collective(collective, codec), nonfinite.with_marker_slot(codec), like.numel(), like.dtype, world_size
    )
    if route == "dense" or step < codec.start_step:
        total = grads[0].div(world_size)
        for grad in grads[1:]:
            total = total + grad.div(world_size)
        return total
    if route == "twophase":
        return _two_phase(codec, grads, step, key, feedback, server_feedback)
    payloads = []
    for rank, grad in enumerate(grads):
        compensated = grad if feedback is None else feedback[rank].compensate(key, grad, step=step)
        payload = codec.compress(compensated, step=step, key=key)
        if feedback is not None:
            feedback[rank].update(key, compensated, codec.decompress(payload, like=compensated), step=step)
        payloads.append(payload)
    if route == "allreduce":
        parts = [predivide(p, world_size) for p in payloads]
        summed = tuple(torch.stack(column).sum(0) if column[0].is_floating_point() else column[0] for column in zip(*parts))
        nonfinite.received_marker(summed)  # saturates a sum that overflowed, as the reducer does
        return codec.decompress(Payload(summed, payloads[0].ctx), like=like)
    return decode_gathered(codec, payloads, like)


def _two_phase(
    codec: Compressor,
    grads: Sequence[Tensor],
    step: int,
    key: Hashable,
    feedback: Sequence[ErrorFeedback] | None,
    server_feedback: Sequence[ErrorFeedback] | None,
) -> Tensor:
    """The two-phase route (:mod:`gradzip.comm.twophase`) with lists in place of collectives."""
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
        mean = decode_gathered(codec, [payloads[rank][j] for rank in range(world_size)], out.new_empty(size))
        server = None if server_feedback is None else server_feedback[j]
        compensated = mean if server is None else server.compensate(key, mean, step=step)
        payload = codec.compress(compensated, step=step, key=mean_key(key, j))
        if server is not None:
            server.update(key, compensated, codec.decompress(payload, like=compensated), step=step)
        out[start : start + size] = codec.decompress(payload, like=out[start : start + size])
    return out.view(grads[0].shape)
