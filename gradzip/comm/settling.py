"""The part every reducer with an error memory of its own shares (PowerSGD, SEPARATE, the count
sketch, int8 sums, the per-layer reducer): one deferred residual memory whose updates stay undoable until
the step is known to be finite on every rank (:mod:`gradzip.comm.nonfinite`), settled when the
next step starts or before the state is read."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gradzip.comm import nonfinite
from gradzip.comm.queue import CollectiveQueue
from gradzip.comm.traffic import allreduce_bytes
from gradzip.compressors.kernels import wire
from gradzip.feedback import ErrorFeedback
from gradzip.metrics import StepMetrics


class SettlingReducer:
    """Base of reducers that keep an fp32 error memory and settle it per step.

    Args:
        compressor: the codec's parameters (None for a reducer of several codecs).
        group: the process group (None: the default group).
        queue: the ordered launch queue shared by every reducer of ``group``.
        metrics: where bytes and times go.
        ledger: the steps whose gradient was not finite, shared by every reducer of one hook;
            None for a ledger of this reducer's own.
    """

    #: dtype of the error memory (None: the gradient's own)
    feedback_dtype: torch.dtype | None = torch.float32

    def __init__(
        self,
        compressor: Any,
        *,
        group: dist.ProcessGroup | None = None,
        queue: CollectiveQueue | None = None,
        metrics: StepMetrics | None = None,
        ledger: nonfinite.StepLedger | None = None,
    ) -> None:
        self.compressor = compressor
        self.group = group
        self.queue = queue or CollectiveQueue()
        self.metrics = metrics or StepMetrics()
        # Error-memory updates stay undoable until the step is known to be finite everywhere.
        self.feedback = ErrorFeedback(dtype=self.feedback_dtype, deferred=True)
        self.ledger = ledger or nonfinite.StepLedger()
        self.open_step = nonfinite.OpenStep()

    def _begin(self, key: Hashable, step: int) -> None:
        """Open ``step`` for ``key``, settling the step it closes."""
        closed = self.open_step.begin(key, step)
        if closed is not None:
            self._settle(self.ledger.finite(closed))

    def settle_closed(self, key: Hashable, step: int) -> None:
        """Settle the open step if a ``reduce`` of ``key`` at ``step`` would close it (as
        :meth:`_begin` would), and leave a step still in progress open: for moving ``key``'s
        residual out before its reduce, without keeping the updates of other buckets whose
        exchange of this step may still turn out non-finite."""
        open_step = self.open_step
        if open_step.step is not None and (step != open_step.step or key in open_step.keys):
            self._settle(self.ledger.finite(open_step.finish()))

    def _settle(self, keep: bool) -> None:
        if keep:
            self.feedback.commit()
        else:
            self.feedback.discard()

    def settle(self) -> None:
        """End the current step now: keep the error memories it changed, or put them back if any
        bucket of the step was non-finite on some rank (``reduce`` does this when the next step
        starts, and :meth:`state_dict` before it reads the state)."""
        closed = self.open_step.finish()
        self._settle(closed is None or self.ledger.finite(closed))

    def flush(self) -> None:
        """Nothing is held back."""

    def state_dict(self) -> dict[str, Any]:
        """The error memories (they differ across ranks), after settling the step in progress."""
        self.settle()
        return {"feedback": self.feedback.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (anything undoable is forgotten, and so is
        the ledger's record of non-finite steps: step numbers restart from the loaded state)."""
        self.open_step.finish()
        self.ledger.clear()
        self.feedback.load_state_dict(state["feedback"])

    def take_residual(self, key: Hashable, shapes: Sequence[torch.Size] | None = None) -> Tensor | None:
        """Remove and return the residual of bucket ``key`` (flat), or None: for a bucket that
        changes codec (reducers keyed per gradient, as PowerSGD's, lay theirs out themselves)."""
        residual = self.feedback.take(key)
        return None if residual is None else residual.reshape(-1)

    def _reduce_dense(self, key: Hashable, grad: Tensor, world_size: int, step: int) -> Future:
        """The plain mean of a bucket the codec does not compress (before ``start_step``, below a
        size, or where its payload would not be smaller), through one all_reduce."""
        tensor = grad.div(world_size)
        if not nonfinite.is_finite(grad):
            tensor.fill_(float("nan"))  # the marker; an inf alone could pass for an overflow
        raw = wire.nbytes([tensor])
        self.metrics.add_bucket(
            key, payload_bytes=raw, dense_bytes=raw, collective="dense", compressed=False,
            sent_bytes=allreduce_bytes(raw, world_size), received_bytes=allreduce_bytes(raw, world_size),
            codec=self.compressor.spec,
        )

        def launch() -> Future:
            work = dist.all_reduce(tensor, group=self.group, async_op=True)
            return self.metrics.track(work.get_future(), (key,))

        def finish(fut: Future) -> Tensor:
            fut.value()
            if not nonfinite.received_marker([tensor]):
                return tensor
            return self.ledger.marked_result(step, tensor)

        return self.queue.submit(launch, device=grad.device).then(finish)
