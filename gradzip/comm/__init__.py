"""Reducers: the mean over a process group of compressed tensors.

:func:`make_reducer` picks the reducer from the codec's declared properties: codecs that
bring their own (``multi_round``: PowerSGD, SEPARATE, the count sketch, Radius) get the one they
name in ``own_reducer``; single-round codecs use :class:`CompressedReducer`, which
picks a route per bucket by bytes (:mod:`gradzip.comm.routes`): all_reduce, all_gather,
the two-phase compressed all_reduce (:mod:`gradzip.comm.twophase`) or dense.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gradzip.comm.queue import CollectiveQueue
from gradzip.comm.reducer import CompressedReducer
from gradzip.comm.routes import COLLECTIVES
from gradzip.comm.twophase import TwoPhaseAllReduce
from gradzip.compressors import Compressor, build
from gradzip.feedback import check_error_feedback, check_own_feedback
from gradzip.metrics import StepMetrics


class Reducer(Protocol):
    """Averages a tensor over a process group, asynchronously.

    ``flush=False`` lets a reducer hold a small tensor back to send it fused with later ones;
    ``flush()`` (or a later ``reduce`` with ``flush=True``) sends whatever is held.

    Non-finite input (:mod:`gradzip.comm.nonfinite`): if ``grad`` holds inf or NaN on any rank, the
    result is all NaN on every rank, with no extra collective, and the state the step changed is
    put back when the next step starts or on ``settle()``; finite input gives finite output.
    """

    def reduce(self, key, grad: Tensor, *, step: int, shapes=None, flush: bool = True) -> Future: ...

    def flush(self) -> None: ...

    def settle(self) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def make_reducer(
    compressor: str | Compressor,
    *,
    group: dist.ProcessGroup | None = None,
    error_feedback: bool | None = None,
    collective: str = "auto",
    min_compress_bytes: int = 0,
    queue: CollectiveQueue | None = None,
    metrics: StepMetrics | None = None,
    feedback_decay: float = 1.0,
    ledger=None,
) -> Reducer:
    """Build the reducer for ``compressor`` (a spec string or a built codec).

    ``make_reducer("efsignsgd", collective="twophase").reduce(key, tensor, step=step)`` is the
    two-phase compressed all_reduce of any tensor, with worker- and server-side error feedback.

    Args:
        compressor: e.g. ``"topk:ratio=0.01"``.
        group: process group; None for the default group.
        error_feedback: override the codec's default (single-round codecs; a codec that brings
            its own rounds keeps its own error feedback, and turning it off raises).
        collective: ``auto``, ``allreduce``, ``allgather`` or ``twophase`` (single-round codecs;
            multi-round codecs take only ``auto``).
        min_compress_bytes: tensors with fewer raw bytes travel uncompressed, fused (single-round
            codecs; an integer >= 0).
        queue: the group's ordered launch queue; share one among all reducers of a group.
        metrics: collects bytes and times.
        feedback_decay: the error-feedback residual is multiplied by this in (0, 1] before it
            is added back (SparseLoCo's decayed accumulator; single-round codecs with error
            feedback on); 1 is plain error feedback.
        ledger: the non-finite steps' :class:`~gradzip.comm.nonfinite.StepLedger`, shared by the
            reducers of one hook; None for one of the reducer's own.

    Raises:
        ValueError: for a bad spec, an impossible collective, a negative
            ``min_compress_bytes``, or a ``feedback_decay`` or ``error_feedback`` that does not apply.
    """
    check_error_feedback(error_feedback)
    codec = build(compressor)
    if codec.multi_round:
        if collective != "auto":
            raise ValueError(f"collective must be auto for {codec.name}, which brings its own rounds; got {collective!r}")
        if min_compress_bytes:
            raise ValueError(f"min_compress_bytes applies to single-round codecs, not {codec.name}; got {min_compress_bytes!r}")
        if feedback_decay != 1.0:
            raise ValueError(f"feedback_decay applies to single-round codecs, not {codec.name}; got {feedback_decay!r}")
        check_own_feedback(codec, error_feedback)
        return own_reducer(codec, group=group, queue=queue, metrics=metrics, ledger=ledger)
    return CompressedReducer(
        codec, group=group, error_feedback=error_feedback, collective=collective,
        min_compress_bytes=min_compress_bytes, queue=queue, metrics=metrics, feedback_decay=feedback_decay,
        ledger=ledger,
    )


def own_reducer(codec: Compressor, **kwargs) -> Reducer:
    """The reducer a codec that brings its own rounds (``multi_round``) declares in
    ``own_reducer``; ``kwargs`` go to the reducer (``group``, ``queue``, ``metrics``, ``ledger``)."""
    assert codec.own_reducer is not None, f"{codec.name} runs in the default reducer"
    module, _, name = codec.own_reducer.partition(":")
    return getattr(importlib.import_module(module), name)(codec, **kwargs)


__all__ = ["COLLECTIVES", "CollectiveQueue", "CompressedReducer", "Reducer", "TwoPhaseAllReduce", "make_reducer", "own_reducer"]
