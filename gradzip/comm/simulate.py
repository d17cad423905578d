"""Single-process reference: what N ranks' compress / exchange / decode would produce.

Used by tests as the oracle for the distributed reducers: same codec calls, but the exchange is
a sum over a Python list instead of a collective.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from gradzip.comm import guard
from gradzip.comm.reducer import decode_gathered, predivide
from gradzip.compressors import Compressor, Payload, build
from gradzip.feedback import ErrorFeedback


def simulate_ranks(
    compressor: str | Compressor,
    grads: Sequence[Tensor],
    *,
    step: int = 0,
    key: Hashable = 0,
    feedback: Sequence[ErrorFeedback] | None = None,
    collective: str = "auto",
) -> Tensor:
    """The mean over simulated ranks of ``grads`` through a single-round codec.

    Args:
        compressor: spec or codec (not multi-round).
        grads: one tensor per rank, all the same shape and dtype.
        step, key: as passed to the codec.
        feedback: one :class:`ErrorFeedback` per rank, updated in place; None for no feedback.
        collective: ``auto``, ``allreduce`` or ``allgather``, as in the reducer.

    Returns:
        the tensor every rank would hold, shaped and typed like ``grads[0]``.
    """
    codec = build(compressor)
    world_size = len(grads)
    like = grads[0]
    payloads = []
    for rank, grad in enumerate(grads):
        compensated = grad if feedback is None else feedback[rank].compensate(key, grad, step=step)
        payload = codec.compress(compensated, step=step, key=key)
        if feedback is not None:
            feedback[rank].update(key, compensated, codec.decompress(payload, like=compensated), step=step)
        payloads.append(payload)
    use_allreduce = codec.aggregatable if collective == "auto" else collective == "allreduce"
    if use_allreduce:
        parts = [predivide(p, world_size) for p in payloads]
        summed = tuple(torch.stack(column).sum(0) if column[0].is_floating_point() else column[0] for column in zip(*parts))
        guard.received_marker(summed)  # saturates a sum that overflowed, as the reducer does
        return codec.decompress(Payload(summed, payloads[0].ctx), like=like)
    return decode_gathered(codec, payloads, like)
