"""Single-process reference: what N ranks' compress / exchange / decode would produce.

Used by tests as the oracle for the distributed reducers: same codec calls, but the exchange is
a sum over a Python list instead of a collective. Each route computes its own
(:meth:`gradzip.comm.routes.Route.reference`); this module picks the route as the reducer does.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from torch import Tensor

from gradzip.comm import nonfinite
from gradzip.comm.routes import REGISTRY, check_collective, choose_collective
from gradzip.compressors import Compressor, build
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
        collective: ``auto`` or a requestable route (:data:`gradzip.comm.routes.COLLECTIVES`),
            resolved to a route exactly as the reducer does
            (:func:`gradzip.comm.routes.choose_collective`).

    Returns:
        the tensor every rank would hold, shaped and typed like ``grads[0]``.

    Raises:
        ValueError: for an unknown ``collective`` or ``allreduce`` with a non-aggregatable codec.
    """
    codec = build(compressor)
    like = grads[0]
    if like.numel() == 0:
        return like.clone()
    # The route is chosen on the codec as the reducer sends it, marker slot included.
    sent = nonfinite.with_marker_slot(codec)
    name = choose_collective(check_collective(collective, codec), sent, like.numel(), like.dtype, len(grads))
    if step < codec.start_step:
        name = "dense"
    # Payloads are encoded by the codec itself: a marker slot carries nothing for finite input.
    return REGISTRY[name].reference(
        codec, grads, step=step, key=key, feedback=feedback, server_feedback=server_feedback
    )[0]
