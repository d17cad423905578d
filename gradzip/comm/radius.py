"""Radius's reducer (Zheng & Zhang, MLSys 2025; arithmetic in :mod:`gradzip.compressors.radius`).

For one bucket at a step past ``start_step``, one all_reduce in one launch of the group's queue:

1. Error-compensate the flat bucket (``c = g + e``; fp32, or fp64 for an fp64 bucket).
2. A refresh step (the bucket has no ranges yet, or its ranges are ``period`` steps old): all_reduce
   ``c / world_size`` whole; the residual is emptied; the mean, the same on every rank, picks the
   bucket's next ranges.
3. Any other step: all_reduce ``c / world_size`` at the bucket's ranges and tail; decode into
   zeros elsewhere; the residual is ``c`` with the sent coordinates set to 0.

The ranges are state shared by every rank (chosen from the same sum); they are saved in
:meth:`RadiusReducer.state_dict` with the step that chose them, so a resume between refreshes
continues exactly.

Non-finite gradients (:mod:`gradzip.comm.nonfinite`): a rank whose bucket holds inf or NaN sends an
all-NaN payload; every rank sees the NaN sum and returns all NaN, and the step's residual and
range updates are put back when the next step starts. Payloads are divided by world_size and
saturated at the wire dtype's range before they are summed, so finite input gives finite output.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gradzip.comm import nonfinite
from gradzip.comm.queue import completed
from gradzip.comm.settling import SettlingReducer
from gradzip.comm.traffic import allreduce_bytes
from gradzip.compressors.kernels import wire


@dataclass(frozen=True)
class Ranges:
    """A bucket's kept ranges: chosen at step ``chosen_at`` for a bucket of ``numel`` elements.

    Attributes:
        chosen_at: the refresh step whose all-reduced gradient chose them.
        numel: elements of the bucket they were chosen for.
        starts: int64 start coordinates of the kept ranges, ascending.
        index: int64 coordinates sent between refreshes (the ranges and the tail), ascending.
    """

    chosen_at: int
    numel: int
    starts: Tensor
    index: Tensor


class RadiusReducer(SettlingReducer):
    """Averages buckets over ``group`` with Radius: shared ranges, refreshed every ``period`` steps.

    Args:
        compressor: the :class:`~gradzip.compressors.radius.Radius` parameters.
        group: the process group (None: the default group).
        queue: the ordered launch queue shared by every reducer of ``group``.
        metrics: where bytes and times go (no quality figures are recorded).
        ledger: the steps whose gradient was not finite, shared by every reducer of one hook;
            None for a ledger of this reducer's own.
    """

    #: residuals in the compensated dtype chosen per bucket (fp32, or fp64 for fp64 buckets)
    feedback_dtype = None

    def __init__(self, compressor: Any, **kwargs: Any) -> None:
        super().__init__(compressor, **kwargs)
        self.ranges: dict[Hashable, Ranges] = {}
        # Ranges a refresh replaced in the open step (None: the key had none), put back if the
        # step turns out non-finite. Stored from the collectives' callback threads: locked.
        self._replaced: dict[Hashable, Ranges | None] = {}
        self._lock = threading.Lock()

    def reduce(
        self,
        key: Hashable,
        grad: Tensor,
        *,
        step: int,
        shapes: Sequence[torch.Size] | None = None,
        flush: bool = True,
    ) -> Future:
        """Start averaging a bucket; returns at once.

        Args:
            key: the bucket's name across steps; keys the residual and the ranges.
            grad: any shape (read flat), floating dtype; must stay unchanged until the future
                completes.
            step: the training step (decides refreshes).
            shapes: ignored (ranges are cut from the flat bucket).
            flush: accepted for the :class:`~gradzip.comm.Reducer` interface; nothing is held.

        Returns:
            a future whose value is the decoded mean, ``grad``'s shape and dtype; all NaN on every
            rank if the bucket held inf or NaN on any rank.
        """
        self._begin(key, step)
        if grad.numel() == 0:
            return completed(grad.clone())
        codec = self.compressor
        if step < codec.start_step:
            return self._reduce_whole(key, grad, step, refresh=False)
        with self._lock:
            held = self.ranges.get(key)
        if held is None or held.numel != grad.numel() or step - held.chosen_at >= codec.period:
            return self._reduce_whole(key, grad, step, refresh=True)
        return self._reduce_ranges(key, grad, step, held)

    def _compensated(self, key: Hashable, flat: Tensor, step: int) -> tuple[Tensor, bool]:
        """``g + e`` in fp32 (fp64 for an fp64 bucket), and whether it may be sent."""
        work = torch.promote_types(flat.dtype, torch.float32)
        compensated = self.feedback.compensate(key, flat, step=step).to(work)
        return nonfinite.checked_input(flat, compensated)

    def _record(self, key: Hashable, grad: Tensor, payload_bytes: int, *, dense: bool) -> None:
        sent = allreduce_bytes(payload_bytes, dist.get_world_size(self.group))
        self.metrics.add_bucket(
            key, payload_bytes=payload_bytes, dense_bytes=wire.nbytes([grad]), collective="dense" if dense else "allreduce",
            compressed=not dense, sent_bytes=sent, received_bytes=sent, codec=self.compressor.spec,
        )

    def _reduce_whole(self, key: Hashable, grad: Tensor, step: int, *, refresh: bool) -> Future:
        """One dense all_reduce. ``refresh``: of the compensated gradient, which empties the
        residual and picks the next ranges from the mean; else (before ``start_step``) of the
        gradient itself, the residual untouched."""
        world_size = dist.get_world_size(self.group)
        codec = self.compressor
        self._record(key, grad, codec.refresh_payload_nbytes(grad.numel(), grad.dtype), dense=True)
        box: dict[str, Tensor] = {}

        def launch() -> Future:
            with self.metrics.timed("compress_s", key):
                flat = grad.reshape(-1)
                if refresh:
                    compensated, sendable = self._compensated(key, flat, step)
                    if sendable:
                        self.feedback.drop(key, step=step)  # all of it is sent
                else:
                    compensated, sendable = flat, nonfinite.is_finite(flat)
                payload = nonfinite.saturate(compensated / world_size, grad.dtype).to(grad.dtype)
                if not sendable:
                    payload.fill_(float("nan"))  # the marker: every rank's sum turns NaN
                box["payload"] = payload
            work = dist.all_reduce(payload, group=self.group, async_op=True)
            return self.metrics.track(work.get_future(), (key,))

        def finish(fut: Future) -> Tensor:
            fut.value()  # re-raises a failed collective
            mean = box["payload"]
            if nonfinite.received_marker([mean]):
                return self.ledger.marked_result(step, grad)
            if refresh:
                with self.metrics.timed("decompress_s", key):
                    starts = codec.select(mean)
                    self._keep(key, Ranges(step, mean.numel(), starts, codec.covered(starts, mean.numel())))
            return mean.view(grad.shape)

        return self.queue.submit(launch, device=grad.device).then(finish)

    def _reduce_ranges(self, key: Hashable, grad: Tensor, step: int, held: Ranges) -> Future:
        """One all_reduce of the compensated gradient at the bucket's ranges and tail."""
        world_size = dist.get_world_size(self.group)
        index = held.index.to(grad.device)
        self._record(key, grad, self.compressor.payload_nbytes(grad.numel(), grad.dtype), dense=False)
        box: dict[str, Tensor] = {}

        def launch() -> Future:
            with self.metrics.timed("compress_s", key):
                compensated, sendable = self._compensated(key, grad.reshape(-1), step)
                payload = nonfinite.saturate(compensated[index] / world_size, grad.dtype).to(grad.dtype)
                if sendable:
                    compensated[index] = 0  # the residual: exactly what was not sent
                    self.feedback.store(key, compensated, step=step)
                else:
                    payload.fill_(float("nan"))  # the marker: every rank's sum turns NaN
                box["payload"] = payload
            assert wire.nbytes([payload]) == self.compressor.payload_nbytes(grad.numel(), grad.dtype), "payload differs from its formula"
            work = dist.all_reduce(payload, group=self.group, async_op=True)
            return self.metrics.track(work.get_future(), (key,))

        def finish(fut: Future) -> Tensor:
            fut.value()  # re-raises a failed collective
            payload = box["payload"]
            if nonfinite.received_marker([payload]):
                return self.ledger.marked_result(step, grad)
            with self.metrics.timed("decompress_s", key):
                out = torch.zeros(grad.numel(), dtype=grad.dtype, device=grad.device)
                out[index] = payload
            return out.view(grad.shape)

        return self.queue.submit(launch, device=grad.device).then(finish)

    def _keep(self, key: Hashable, ranges: Ranges) -> None:
        """Hold ``ranges`` for ``key``, undoably until the step is settled."""
        with self._lock:
            if key not in self._replaced:
                self._replaced[key] = self.ranges.get(key)
            self.ranges[key] = ranges

    def _settle(self, keep: bool) -> None:
        super()._settle(keep)
        with self._lock:
            if not keep:
                for key, old in self._replaced.items():
                    if old is None:
                        self.ranges.pop(key, None)
                    else:
                        self.ranges[key] = old
            self._replaced = {}

    def state_dict(self) -> dict[str, Any]:
        """The residuals (they differ across ranks) and every bucket's ranges with the step that
        chose them (the same on every rank), after settling the step in progress."""
        state = super().state_dict()
        with self._lock:
            state["ranges"] = {
                key: {"chosen_at": r.chosen_at, "numel": r.numel, "starts": r.starts.detach().clone()}
                for key, r in self.ranges.items()
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (anything undoable is forgotten)."""
        super().load_state_dict(state)
        codec = self.compressor
        with self._lock:
            self._replaced = {}
            self.ranges = {
                key: Ranges(r["chosen_at"], r["numel"], r["starts"].clone(), codec.covered(r["starts"], r["numel"]))
                for key, r in state["ranges"].items()
            }
