"""Reducers: the mean over a process group of compressed tensors.

:func:`make_reducer` picks the reducer from the codec's declared properties: multi-round
codecs (PowerSGD) bring their own; single-round codecs use :class:`CompressedReducer`.
"""

from __future__ import annotations

from typing import Protocol

import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gradzip.comm.queue import CollectiveQueue
from gradzip.comm.reducer import CompressedReducer
from gradzip.compressors import Compressor, build
from gradzip.metrics import StepMetrics


class Reducer(Protocol):
    """Averages a tensor over a process group, asynchronously."""

    def reduce(self, key, grad: Tensor, *, step: int, shapes=None) -> Future: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def make_reducer(
    compressor: str | Compressor,
    *,
    group: dist.ProcessGroup | None = None,
    error_feedback: bool | None = None,
    collective: str = "auto",
    queue: CollectiveQueue | None = None,
    metrics: StepMetrics | None = None,
) -> Reducer:
    """Build the reducer for ``compressor`` (a spec string or a built codec).

    Args:
        compressor: e.g. ``"topk:ratio=0.01"``.
        group: process group; None for the default group.
        error_feedback: override the codec's default (single-round codecs only).
        collective: ``auto``, ``allreduce`` or ``allgather`` (single-round codecs only).
        queue: the group's ordered launch queue; share one among all reducers of a group.
        metrics: collects bytes and times.

    Raises:
        ValueError: for a bad spec or an impossible collective.
    """
    codec = build(compressor)
    if codec.multi_round:
        from gradzip.comm.powersgd import PowerSGDReducer

        return PowerSGDReducer(codec, group=group, queue=queue, metrics=metrics)
    return CompressedReducer(
        codec, group=group, error_feedback=error_feedback, collective=collective, queue=queue, metrics=metrics
    )


__all__ = ["CollectiveQueue", "CompressedReducer", "Reducer", "make_reducer"]
