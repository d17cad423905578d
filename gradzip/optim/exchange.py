"""The exchanges the compressed optimizers use, built in one place.

:func:`onebit_reducer` is the compressed one: the two-phase 1-bit all-reduce with worker and
server error feedback (Tang et al. 2021, arXiv 2102.02888, Algorithm 1's "compressed allreduce";
the same exchange DeepSpeed calls ``compressed_allreduce``). :func:`dense_reducer` is the
uncompressed mean (``all_reduce`` of ``tensor / world_size``) for full-precision steps.
Both are ordinary gradzip reducers from :func:`gradzip.comm.make_reducer`, so their bytes and
times land in the same :class:`~gradzip.metrics.StepMetrics` as the DDP hook's.
"""

from __future__ import annotations

import torch.distributed as dist

from gradzip.comm import Reducer, make_reducer
from gradzip.comm.queue import CollectiveQueue
from gradzip.metrics import StepMetrics

#: the codec of the compressed exchange: one sign bit per element plus one scale per tensor
ONEBIT_SPEC = "efsignsgd"


def onebit_reducer(
    *, group: dist.ProcessGroup | None, queue: CollectiveQueue, metrics: StepMetrics
) -> Reducer:
    """The 1-bit two-phase reducer: worker error feedback, chunked all-to-all, server
    error feedback, all-gather. Traffic per worker: about ``numel / 8 * (1 + 1 / world_size)``
    bytes plus the scales, whatever the world size.

    Raises:
        ValueError: if this gradzip has no two-phase collective or no 1-bit codec.
    """
    return make_reducer(
        ONEBIT_SPEC, group=group, error_feedback=True, collective="twophase", queue=queue, metrics=metrics
    )


def dense_reducer(
    *, group: dist.ProcessGroup | None, queue: CollectiveQueue, metrics: StepMetrics
) -> Reducer:
    """The uncompressed mean: ``all_reduce`` of ``tensor / world_size`` (4 bytes per fp32 element)."""
    return make_reducer("none", group=group, queue=queue, metrics=metrics)
